"""The reward service (docs/architecture.md §4): plugins (`uniweave.rewards.plugins`) behind one
batched interface, a weighted sum, truncation shaping, format and error accounting, and
`build_reward_service` from the `reward:` config.

Contract of `RewardService.score(samples, trajectories, responses)`, row i:

- `responses[i]` are the parsed parts of rollout row i (`parse_response`), or None when
  the row could not be parsed. Only the trailing run of assistant-role parts (the final
  assistant turn) is the response, so passing the whole parse or only the response is
  the same. Images are decoded once, for every plugin, with `decode_images`.
- Each plugin scores only the rows whose `Sample.task` is in its `tasks` (None = every
  row). A row it does not score gets 0 from it and is excluded from its logged mean.
  total_i = Σ_k w_k · s_k,i.
- A plugin that raises, returns a non-finite score or the wrong number of scores: with
  on_error "raise" a `RewardError` names the plugin and the sample id; with "zero" those
  rows score 0 from that plugin and are counted in `errors`. A batch that raises is
  re-run row by row to find the failing samples.
- Truncation shaping: with truncated_reward "zero", rows whose `finish_reason` is cap,
  context or cycle (`TRUNCATED_REASONS`) get total 0 — never `length_exact`, `eos` or
  `invalid` rows. Every shaped row counts as overwritten (whatever its reward was);
  when all rows are overwritten the service warns loudly: 100% is an alarm.
- Features (`features=True`, GRPO's diversity metrics): the first plugin whose
  `RewardPlugin.features` gives any (digit_classifier, clip_score) describes each row it
  scored without error, `RewardResult.features` float [N, d] (NaN rows elsewhere);
  its failure follows on_error like a score's.
- Off-target image statistics: every response image decoded (or given as pixels) is
  measured once (`uniweave.rewards.image_stats`), `RewardResult.image_counts`, logged as
  `images/...` by `RewardResult.metrics`.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from uniweave.config.errors import ConfigError
from uniweave.config.schema import RewardConfig
from uniweave.core.sample import Part, Sample
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.core.types import TRUNCATED_REASONS
from uniweave.rewards.image_stats import image_counts, image_metrics
from uniweave.rewards.plugins import (
    DecodeImages,
    Response,
    RewardPlugin,
    build_plugin,
    build_responses,
)

logger = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward plugin failed under on_error "raise"; names the plugin and the sample ids."""

    def __init__(self, message: str, plugin: str, sample_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.sample_ids = list(sample_ids)


class AllRewardsOverwrittenWarning(UserWarning):
    """Truncation shaping overwrote every reward of a batch: the update trains on nothing."""


@dataclass(frozen=True)
class PluginSpec:
    """A plugin in the service: its weight, the tasks it scores (None = all), its log key."""

    plugin: RewardPlugin
    weight: float = 1.0
    tasks: frozenset[str] | None = None
    key: str = ""

    @property
    def label(self) -> str:
        return self.key or self.plugin.name

    def applies(self, sample: Sample) -> bool:
        return self.tasks is None or sample.task in self.tasks


@dataclass
class RewardResult:
    """Scores of one batch. Tensors are [N]; per-plugin dicts are keyed by plugin label.

    total: the reward after truncation shaping (what advantages use); raw_total: before.
    per_plugin: each plugin's unweighted score (0 where not applied or errored);
    applied / invalid / errors: which rows each plugin scored / found malformed / failed on.
    truncated: finish_reason in cap/context/cycle; overwritten: rows shaping set to 0.
    """

    total: torch.Tensor
    raw_total: torch.Tensor
    per_plugin: dict[str, torch.Tensor]
    applied: dict[str, torch.Tensor]
    invalid: dict[str, torch.Tensor]
    errors: dict[str, torch.Tensor]
    truncated: torch.Tensor
    overwritten: torch.Tensor
    sample_ids: list[str] = field(default_factory=list)
    tasks: list[str | None] = field(default_factory=list)
    n_undecodable_images: int = 0
    counts: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per plugin label, its `RewardPlugin.pop_counts` of this batch (summable)."""
    features: torch.Tensor | None = None
    """float32 [N, d] scorer features of each row (NaN rows: none), or None (module
    docstring, Features); `feature_source` names the plugin that gave them."""
    feature_source: str = ""
    image_counts: dict[str, float] = field(default_factory=dict)
    """Summable counts of the off-target statistics of the rows' response images
    (`uniweave.rewards.image_stats.image_counts`; {} without a measured image)."""

    @property
    def n_errors(self) -> int:
        """Rows x plugins that failed (scored 0 under on_error "zero")."""
        return sum(int(e.sum()) for e in self.errors.values())

    @property
    def invalid_format_counts(self) -> dict[str, int]:
        return {k: int(v.sum()) for k, v in self.invalid.items()}

    @property
    def overwritten_fraction(self) -> float:
        n = self.total.numel()
        return float(self.overwritten.sum()) / n if n else 0.0

    def metrics(self) -> dict[str, float]:
        """Flat metrics: reward/total_*, reward/<plugin>/{mean,std,invalid_frac,n_errors},
        reward/task/<task>/mean, reward/{overwritten,truncated}_frac, reward/n_errors, and
        each plugin count `reward/<plugin>/<name>`, with `<x>_frac` = n_<x> / n_rows and
        `<x>_mean` = sum_<x> / n_<x> (e.g. the geneval plugin's per-tag mean reward), and
        the off-target image statistics `images/...` (`uniweave.rewards.image_stats`)."""
        out = {
            "reward/total_mean": _mean(self.total),
            "reward/total_std": _std(self.total),
            "reward/raw_total_mean": _mean(self.raw_total),
            "reward/overwritten_frac": self.overwritten_fraction,
            "reward/truncated_frac": _mean(self.truncated.double()),
            "reward/n_errors": float(self.n_errors),
            "reward/n_undecodable_images": float(self.n_undecodable_images),
        }
        for key, scores in self.per_plugin.items():
            applied = self.applied[key]
            out[f"reward/{key}/mean"] = _mean(scores[applied])
            out[f"reward/{key}/std"] = _std(scores[applied])
            out[f"reward/{key}/invalid_frac"] = _mean(self.invalid[key][applied].double())
            out[f"reward/{key}/n_errors"] = float(self.errors[key].sum())
        for key, counts in self.counts.items():
            rows = counts.get("n_rows", 0.0)
            for name, value in counts.items():
                out[f"reward/{key}/{name}"] = float(value)
                if name.startswith("n_") and name != "n_rows" and "n_rows" in counts:
                    out[f"reward/{key}/{name[2:]}_frac"] = float(value) / rows if rows else 0.0
                if name.startswith("sum_") and f"n_{name[4:]}" in counts:
                    n = counts[f"n_{name[4:]}"]
                    out[f"reward/{key}/{name[4:]}_mean"] = float(value) / n if n else 0.0
        for task in sorted({t for t in self.tasks if t is not None}):
            of_task = torch.tensor([t == task for t in self.tasks])
            out[f"reward/task/{task}/mean"] = _mean(self.total[of_task])
        out.update(image_metrics(self.image_counts))
        return out


def _mean(x: torch.Tensor) -> float:
    return float(x.double().mean()) if x.numel() else 0.0


def _std(x: torch.Tensor) -> float:
    return float(x.double().std(correction=0)) if x.numel() else 0.0


def _ids(ids: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(repr(i) for i in ids[:limit])
    return shown + (f", ... (+{len(ids) - limit} more)" if len(ids) > limit else "")


class _BadOutput(Exception):
    """A plugin returned something that is not n finite-or-NaN scores."""


def _as_scores(out: object, n: int, what: str) -> np.ndarray:
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().double().numpy()
    try:
        arr = np.asarray(out, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise _BadOutput(f"{what} are not numbers ({err})") from err
    if arr.ndim != 1 or arr.shape[0] != n:
        raise _BadOutput(f"returned {what} of shape {list(arr.shape)} for {n} samples")
    return arr


class RewardService:
    """Weighted sum of reward plugins with truncation shaping (module docstring)."""

    def __init__(
        self,
        plugins: Sequence[PluginSpec],
        truncated_reward: Literal["zero", "keep"] = "zero",
        on_error: Literal["raise", "zero"] = "raise",
        decode_images: DecodeImages | None = None,
        features: bool = False,
    ) -> None:
        if not plugins:
            raise ValueError("RewardService needs at least one plugin")
        if truncated_reward not in ("zero", "keep"):
            raise ValueError(f"truncated_reward must be 'zero' or 'keep', got {truncated_reward!r}")
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        labels = [s.label for s in plugins]
        if len(set(labels)) != len(labels):
            raise ValueError(f"reward plugin keys must be unique, got {labels}")
        for spec in plugins:
            if not math.isfinite(spec.weight):
                raise ValueError(f"reward plugin {spec.label!r}: weight must be finite")
            if spec.plugin.needs_images and decode_images is None:
                raise ValueError(
                    f"reward plugin {spec.label!r} reads images: the service needs "
                    "decode_images (e.g. the model's codec.decode)"
                )
        self.plugins = list(plugins)
        self.truncated_reward = truncated_reward
        self.on_error = on_error
        self.decode_images = decode_images
        self.with_features = bool(features)

    def score(
        self,
        samples: Sequence[Sample],
        trajectories: Sequence[Trajectory] | TrajectoryBatch,
        responses: Sequence[Sequence[Part] | None],
        *,
        alarm: bool = True,
    ) -> RewardResult:
        """Score N rollout rows: row i is (samples[i], trajectories[i], responses[i]).

        `trajectories` give each row's finish_reason / length_semantics (a list of
        `Trajectory` or a `TrajectoryBatch`); their sample ids must match the samples'.
        `alarm` False: no warning when every row is overwritten (evaluation, which trains
        on nothing and reports its finish reasons instead).
        """
        n = len(samples)
        if isinstance(trajectories, TrajectoryBatch):
            traj_ids = list(trajectories.sample_ids)
            reasons = list(trajectories.finish_reasons)
            semantics = list(trajectories.length_semantics)
        else:
            traj_ids = [t.sample_id for t in trajectories]
            reasons = [t.finish_reason for t in trajectories]
            semantics = [t.length_semantics for t in trajectories]
        if len(traj_ids) != n or len(responses) != n:
            raise ValueError(
                f"score: {n} samples, {len(traj_ids)} trajectories, {len(responses)} responses"
            )
        ids = [s.id for s in samples]
        for i, (sid, tid) in enumerate(zip(ids, traj_ids)):
            if tid and tid != sid:
                raise ValueError(f"row {i}: trajectory of {tid!r} paired with sample {sid!r}")
        truncated = self._truncated(ids, reasons, semantics)
        reads_images = any(spec.plugin.needs_images for spec in self.plugins)
        decode = self.decode_images if reads_images else None
        rows_responses, n_bad = build_responses(responses, decode)
        per_plugin, applied, invalid, errors, counts = {}, {}, {}, {}, {}
        raw_total = torch.zeros(n, dtype=torch.float64)
        for spec in self.plugins:
            key = spec.label
            rows = [i for i in range(n) if spec.applies(samples[i])]
            spec.plugin.pop_counts()  # drop what an earlier, failed call left
            scores, bad_format, failed = self._run(spec, samples, rows_responses, rows)
            plugin_counts = spec.plugin.pop_counts()
            if plugin_counts:
                counts[key] = {k: float(v) for k, v in plugin_counts.items()}
            applied[key] = torch.zeros(n, dtype=torch.bool)
            applied[key][rows] = True
            per_plugin[key], invalid[key], errors[key] = scores, bad_format, failed
            raw_total += spec.weight * scores
        overwritten = truncated if self.truncated_reward == "zero" else torch.zeros_like(truncated)
        total = torch.where(overwritten, torch.zeros_like(raw_total), raw_total)
        features, source = None, ""
        if self.with_features:
            features, source = self._features(samples, rows_responses, applied, errors)
        result = RewardResult(
            total=total.float(),
            raw_total=raw_total.float(),
            per_plugin={k: v.float() for k, v in per_plugin.items()},
            applied=applied,
            invalid=invalid,
            errors=errors,
            truncated=truncated,
            overwritten=overwritten,
            sample_ids=ids,
            tasks=[s.task for s in samples],
            n_undecodable_images=n_bad,
            counts=counts,
            features=features,
            feature_source=source,
            image_counts=image_counts(samples, [r.images for r in rows_responses]),
        )
        if alarm and n and bool(overwritten.all()):
            msg = (
                f"truncation shaping overwrote 100% of the rewards ({n}/{n} rows ended "
                "cap/context/cycle with truncated_reward=zero): this update trains on "
                "nothing; raise max_new_tokens, or use length_semantics=exact for "
                "image-only generation"
            )
            logger.warning(msg)
            warnings.warn(msg, AllRewardsOverwrittenWarning, stacklevel=2)
        return result

    def _features(
        self,
        samples: Sequence[Sample],
        responses: Sequence[Response],
        applied: dict[str, torch.Tensor],
        errors: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor | None, str]:
        """(features [N, d] or None, the plugin's label) of the first plugin that has
        features, on the rows it scored without error (module docstring)."""
        n = len(samples)
        for spec in self.plugins:
            key = spec.label
            rows = [i for i in range(n) if applied[key][i] and not errors[key][i]]
            if type(spec.plugin).features is RewardPlugin.features or not rows:
                continue
            try:
                out = spec.plugin.features([samples[i] for i in rows], [responses[i] for i in rows])
                if out is None:
                    continue
                out = torch.as_tensor(out).detach().float().cpu()
                if out.dim() != 2 or out.shape[0] != len(rows):
                    raise ValueError(f"features of shape {list(out.shape)} for {len(rows)} rows")
            except Exception as err:  # a plugin may raise anything
                msg = f"reward plugin {key!r} failed to give features: {type(err).__name__}: {err}"
                if self.on_error == "raise":
                    raise RewardError(msg, key, [samples[i].id for i in rows]) from err
                logger.warning("%s; no diversity features (reward.on_error=zero)", msg)
                return None, ""
            full = torch.full((n, out.shape[1]), float("nan"))
            full[rows] = out
            return full, key
        return None, ""

    @staticmethod
    def _truncated(
        ids: Sequence[str], reasons: Sequence[str | None], semantics: Sequence[str | None]
    ) -> torch.Tensor:
        for sid, reason, sem in zip(ids, reasons, semantics):
            if sem == "exact" and reason == "cap":
                raise ValueError(
                    f"sample {sid!r}: an exact-count row (length_semantics 'exact') must end "
                    "'length_exact', not 'cap'"
                )
        return torch.tensor([r in TRUNCATED_REASONS for r in reasons], dtype=torch.bool)

    def _run(
        self,
        spec: PluginSpec,
        samples: Sequence[Sample],
        responses: Sequence[Response],
        rows: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores float64 [N], invalid [N], errors [N]) of one plugin on `rows`."""
        n = len(samples)
        scores = torch.zeros(n, dtype=torch.float64)
        invalid = torch.zeros(n, dtype=torch.bool)
        errors = torch.zeros(n, dtype=torch.bool)
        if not rows:
            return scores, invalid, errors
        values: dict[int, tuple[float, bool]] = {}
        failures: dict[int, str] = {}
        try:
            batch = self._call(spec, samples, responses, rows)
            values = dict(zip(rows, zip(*batch)))
        except _BadOutput as err:
            failures = {i: str(err) for i in rows}
        except Exception as err:  # a plugin may raise anything: find the failing rows
            values, failures = self._row_by_row(spec, samples, responses, rows)
            if not failures:
                values, failures = {}, {i: f"raised {type(err).__name__}: {err}" for i in rows}
        for i, (value, flag) in values.items():
            if not math.isfinite(value):
                failures[i] = f"returned a non-finite score {value}"
            else:
                scores[i], invalid[i] = value, flag
        if failures:
            bad = sorted(failures)
            bad_ids = [samples[i].id for i in bad]
            msg = (
                f"reward plugin {spec.label!r} failed on sample {bad_ids[0]!r}: "
                f"{failures[bad[0]]} ({len(bad)} of {len(rows)} samples failed: {_ids(bad_ids)})"
            )
            if self.on_error == "raise":
                raise RewardError(
                    msg + "; set reward.on_error=zero to score them 0", spec.label, bad_ids
                )
            logger.warning("%s; scored 0 (reward.on_error=zero)", msg)
            errors[bad] = True
        return scores, invalid, errors

    @staticmethod
    def _call(
        spec: PluginSpec,
        samples: Sequence[Sample],
        responses: Sequence[Response],
        rows: list[int],
    ) -> tuple[list[float], list[bool]]:
        sub_s = [samples[i] for i in rows]
        sub_r = [responses[i] for i in rows]
        values = _as_scores(spec.plugin.score(sub_s, sub_r), len(rows), "scores")
        flags = _as_scores(spec.plugin.invalid_format(sub_s, sub_r), len(rows), "format flags")
        return [float(v) for v in values], [bool(f) for f in flags]

    def _row_by_row(
        self,
        spec: PluginSpec,
        samples: Sequence[Sample],
        responses: Sequence[Response],
        rows: list[int],
    ) -> tuple[dict[int, tuple[float, bool]], dict[int, str]]:
        """Re-run a failed batch one row at a time: (values of the rows that work, failures)."""
        values, failures = {}, {}
        for i in rows:
            try:
                (value,), (flag,) = self._call(spec, samples, responses, [i])
                values[i] = (float(value), flag)
            except _BadOutput as err:
                failures[i] = str(err)
            except Exception as err:
                failures[i] = f"raised {type(err).__name__}: {err}"
        return values, failures


def build_reward_service(
    cfg: RewardConfig,
    *,
    decode_images: DecodeImages | None = None,
    resources: Mapping[str, Any] | None = None,
    features: bool = False,
) -> RewardService:
    """The `RewardService` of the `reward:` section.

    Plugin k is logged under its name (or `<name>_<k>` when a name repeats) and scores
    only its `tasks` (null = all). `decode_images` (the model's codec.decode) is required
    when a plugin reads images; `features`: results carry the scorer's features
    (`RewardService`, GRPO's diversity metrics).
    """
    names = [p.name for p in cfg.plugins]
    specs = []
    for k, plugin_cfg in enumerate(cfg.plugins):
        plugin = build_plugin(plugin_cfg, f"reward.plugins.{k}", resources)
        label = plugin_cfg.name if names.count(plugin_cfg.name) == 1 else f"{plugin_cfg.name}_{k}"
        tasks = None if plugin_cfg.tasks is None else frozenset(plugin_cfg.tasks)
        specs.append(PluginSpec(plugin, plugin_cfg.weight, tasks, label))
    if any(s.plugin.needs_images for s in specs) and decode_images is None:
        key = next(k for k, s in enumerate(specs) if s.plugin.needs_images)
        raise ConfigError(
            "reads images but no decode_images (codec) was given",
            key=f"reward.plugins.{key}.name",
        )
    return RewardService(specs, cfg.truncated_reward, cfg.on_error, decode_images, features)
