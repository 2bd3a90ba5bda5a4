"""The `geneval` reward plugin: GenEval's verdict on a generated image as a reward.

Row i's GenEval metadata row is `sample.meta["geneval"]` (`META_KEY`): the row exactly as
in GenEval's `evaluation_metadata.jsonl` (a JSON object, or its JSON text), checked like a
metadata file's row against the detector's classes (`parse_row`). Its response must hold
exactly one decodable image (else the row is invalid and scores 0). The reward:

- default: 1 when GenEval judges the image correct, else 0;
- `partial: true`: the fraction of the row's include clauses that hold (count, then
  colour, then position, as `judge` checks them), and 0 when any exclude clause fails
  (so a counting row never pays for too many objects).

Detections count above `threshold` (default GenEval's 0.3; Flow-GRPO-style training uses
0.6); counting rows keep GenEval's 0.9. Every other rule is GenEval's
(`GenEvalThresholds`).

Per batch the plugin counts, per tag t, `n_<t>` (rows of that tag it scored) and
`sum_<t>` (their summed reward); the service logs them with `reward/geneval/<t>_mean`
(the tag's mean reward) and `<t>_frac` (its share of rows), summed across ranks before the
division. A row whose metadata is missing or bad, a colour clause without a colour
classifier, or a detector failure raises, and the reward service's error policy
(`reward.on_error`) decides: stop naming the sample, or score it 0 and count it.

Config (`reward.plugins[]`): `path` — the detector's model directory or hub id (required,
except for `detector: digits`, where it is a digits classifier directory and, unset, the
run's own fitted digits classifier is used); kwargs `detector` (mask2former | owlv2 |
digits, default mask2former; digits colours objects itself, so it takes no `clip_path`), `clip_path` (the CLIP model
for colour clauses; without it a colour row is an error), `device` (cpu | cuda),
`batch_size` (images per detector pass, default 8), `threshold`, `partial`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from uniweave.config.errors import ConfigError
from uniweave.config.hub import resolve
from uniweave.config.schema import RewardPluginConfig
from uniweave.core.sample import Sample
from uniweave.rewards.base import Response, RewardPlugin
from uniweave.rewards.clip_score import one_image
from uniweave.rewards.geneval.colour import ClipColourClassifier
from uniweave.rewards.geneval.detectors import (
    DETECTORS,
    Detector,
    DigitsDetector,
    load_detector,
)
from uniweave.rewards.geneval.metadata import MetadataRow, parse_row
from uniweave.rewards.geneval.rules import GenEvalThresholds, Verdict
from uniweave.rewards.geneval.scorer import GenEvalScorer

META_KEY = "geneval"
"""The `Sample.meta` key holding a row's GenEval metadata."""

DEFAULT_THRESHOLD = GenEvalThresholds().threshold


def verdict_reward(verdict: Verdict, partial: bool) -> float:
    """1.0 / 0.0 by `verdict.correct`, or with `partial` the share of include clauses
    held, 0 when an exclude clause failed (module docstring)."""
    if not partial:
        return float(verdict.correct)
    if not all(verdict.excludes):
        return 0.0
    return sum(verdict.includes) / len(verdict.includes)


class GenEvalReward(RewardPlugin):
    """GenEval's verdict as a reward (module docstring)."""

    name = "geneval"
    needs_images = True
    config_kwargs = frozenset(
        {"detector", "clip_path", "device", "batch_size", "threshold", "partial"}
    )

    def __init__(
        self,
        detector: Detector,
        colours: ClipColourClassifier | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        partial: bool = False,
    ) -> None:
        self._check("partial", partial)
        self._check("threshold", threshold)
        self.scorer = GenEvalScorer(detector, colours, GenEvalThresholds(threshold=threshold))
        self.partial = partial
        self.counts: dict[str, float] = {}

    @property
    def threshold(self) -> float:
        return self.scorer.thresholds.threshold

    @classmethod
    def from_config(
        cls, cfg: RewardPluginConfig, key: str, resources: Mapping[str, Any] | None = None
    ) -> GenEvalReward:
        """Build from `reward.plugins.N` (module docstring). `resources["geneval_detector"]`
        / `["geneval_colours"]` pass a built `Detector` / `ClipColourClassifier` instead of
        loading one (then `path` / `clip_path` must be unset)."""
        resources = resources or {}
        kw: dict[str, Any] = dict(cfg.kwargs)  # user values: the constructor checks them
        for name in ("threshold", "partial"):
            if name in kw:
                try:
                    cls._check(name, kw[name])
                except ValueError as err:
                    raise ConfigError(str(err), key=f"{key}.kwargs.{name}") from err
        kind = kw.get("detector", "mask2former")
        if kind not in DETECTORS:
            raise ConfigError(
                f"unknown detector {kind!r}",
                key=f"{key}.kwargs.detector",
                expected=" | ".join(DETECTORS),
            )
        device = kw.get("device", "cpu")
        if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
            why = "CUDA is not available" if device == "cuda" else f"got {device!r}"
            raise ConfigError(f"device must be cpu or cuda ({why})", key=f"{key}.kwargs.device")
        batch_size = kw.get("batch_size", 8)
        try:
            cls._batch_size(batch_size)
        except ValueError as err:
            raise ConfigError(str(err), key=f"{key}.kwargs.batch_size") from err
        detector = resources.get("geneval_detector")
        if detector is not None and (cfg.path is not None or "detector" in kw):
            raise ConfigError(
                "a detector was passed in; path and kwargs.detector would be ignored",
                key=f"{key}.path",
            )
        if kind == "digits" and "clip_path" in kw:
            raise ConfigError(
                "acts on nothing: the digits detector gives each object's stroke colour",
                key=f"{key}.kwargs.clip_path",
            )
        try:
            classifier = resources.get("digit_classifier")
            if (
                detector is None
                and kind == "digits"
                and cfg.path is None
                and classifier is not None
            ):
                detector = DigitsDetector(
                    device=device, batch_size=batch_size, classifier=classifier
                )
            elif detector is None:
                if cfg.path is None:
                    raise ConfigError(
                        "plugin 'geneval' needs its detector's model directory",
                        key=f"{key}.path",
                        expected=f"a local directory or hub id of a {kind} model, e.g. "
                        "facebook/mask2former-swin-small-coco-instance",
                    )
                detector = load_detector(kind, cfg.path, device, batch_size)
            elif "batch_size" in kw:
                detector.batch_size = cls._batch_size(batch_size)
            colours = resources.get("geneval_colours")
            clip_path = resolve(kw.get("clip_path"), f"{key}.kwargs.clip_path")
            if colours is not None and clip_path is not None:
                raise ConfigError(
                    "a colour classifier was passed in; clip_path would be ignored",
                    key=f"{key}.kwargs.clip_path",
                )
            if clip_path is not None:
                colours = ClipColourClassifier(Path(clip_path), device)
            elif "device" in kw and resources.get("geneval_detector") is not None:
                raise ConfigError(
                    "acts on nothing: the detector was passed in and no clip_path is loaded",
                    key=f"{key}.kwargs.device",
                )
        except ConfigError:
            raise
        except FileNotFoundError as err:
            raise ConfigError(str(err), key=f"{key}.path") from err
        except ValueError as err:
            raise ConfigError(str(err), key=f"{key}.kwargs") from err
        return cls(
            detector,
            colours,
            threshold=kw.get("threshold", DEFAULT_THRESHOLD),
            partial=kw.get("partial", False),
        )

    @staticmethod
    def _check(name: str, value: Any) -> None:
        if name == "partial" and not isinstance(value, bool):
            raise ValueError(f"partial must be true or false, got {value!r}")
        if name == "threshold" and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (math.isfinite(value) and 0.0 <= value < 1.0)
        ):
            raise ValueError(f"threshold must be a number in [0, 1), got {value!r}")

    @staticmethod
    def _batch_size(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {value!r}")
        return value

    def row(self, sample: Sample) -> MetadataRow:
        """The sample's GenEval metadata row, checked; ValueError naming the sample."""
        where = f"sample {sample.id!r} meta[{META_KEY!r}]"
        value = sample.meta.get(META_KEY)
        if value is None:
            raise ValueError(f"{where}: missing (the sample's GenEval metadata row)")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
        return parse_row(value, where, self.scorer.classes)

    def score(self, samples: Sequence[Sample], responses: Sequence[Response]) -> list[float]:
        rows = [self.row(sample) for sample in samples]
        images = [one_image(r) for r in responses]
        valid = [i for i, image in enumerate(images) if image is not None]
        drawn = [image for image in images if image is not None]
        verdicts = self.scorer.verdicts([rows[i] for i in valid], drawn)
        out = [0.0] * len(samples)
        for i, verdict in zip(valid, verdicts):
            out[i] = verdict_reward(verdict, self.partial)
        self.counts["n_rows"] = self.counts.get("n_rows", 0.0) + len(samples)
        for row, value in zip(rows, out):
            self.counts[f"n_{row.tag}"] = self.counts.get(f"n_{row.tag}", 0.0) + 1
            self.counts[f"sum_{row.tag}"] = self.counts.get(f"sum_{row.tag}", 0.0) + value
        return out

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        return [one_image(r) is None for r in responses]

    def pop_counts(self) -> dict[str, float]:
        counts, self.counts = self.counts, {}
        return counts
