"""Reward plugins: the built-in plugins and their registry `PLUGINS` (config name ->
class, built by `build_plugin`), on the interface of `unirl.rewards.base` (`Response`,
`RewardPlugin`, `build_responses`; re-exported here).

A plugin scores a batch: `score(samples, responses) -> [n] floats`, and flags rows whose
response has the wrong format with `invalid_format` (they score 0 and are counted):

- `mc_exact` (alias `mc_exact_match`; i2t_mc, jigsaw_mc): 1 if the response text,
  stripped, is exactly sample.answer. Invalid: anything but one letter A-D (case
  sensitive), or a response with an image.
- `jigsaw` (jigsaw_mc): 1 if the chosen letter names the option whose permutation equals
  meta["solution"] (verified on meta, not on the answer field). Invalid: as mc_exact.
- `digit_classifier` (t2i, draw_then_answer): p(target digit | decoded image) under a
  `DigitClassifier`. Invalid: not exactly one decodable 8x8 image.
- `text_exact` (i2t_open): 1 if the text-only response, stripped, equals sample.answer.
  Invalid: an empty response or one with an image.
- `exact_answer` (draw_then_answer): 1 if the text after the only image, stripped, equals
  sample.answer; kwarg `require_image_class` also needs the classifier's argmax on the
  image to be the target digit. Invalid: not exactly one image followed by text.
- `clip_score` (alias `pickscore`; t2i on real images): CLIP / PickScore-style
  text-image score from a local `CLIPModel` directory (`unirl.rewards.clip_score`;
  kwargs device, mode, batch_size). Invalid: not exactly one decodable image.

A plugin class with a `from_config(cfg, key, resources)` classmethod and a
`config_kwargs` set builds itself from its config entry.

The target digit is meta["digit"] (else the answer). A sample a plugin cannot verify
(e.g. mc_exact on an answer that is not a letter) raises: restrict the plugin to its
tasks with `tasks:` in its config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from unirl.config.errors import ConfigError, suggest
from unirl.config.schema import RewardPluginConfig
from unirl.core.sample import Sample
from unirl.data.template import parse_response, response_parts
from unirl.rewards.base import DecodeImages, Response, RewardPlugin, build_responses
from unirl.rewards.clip_score import ClipScore
from unirl.rewards.digit_classifier import DigitClassifier

__all__ = [
    "PLUGINS",
    "DecodeImages",
    "DigitClassifierReward",
    "ExactAnswer",
    "JigsawVerifier",
    "MultipleChoiceExact",
    "Response",
    "RewardPlugin",
    "TextExact",
    "build_plugin",
    "build_responses",
    "parse_response",
    "response_parts",
]

LETTERS = "ABCD"
IMAGE_SHAPE = (8, 8)


def chosen_letter(response: Response, letters: str = LETTERS) -> str | None:
    """The letter a text-only response names: its whole text, stripped, must be one of
    `letters` (case-sensitive); anything else (or any image) gives None."""
    if not response.parsed or response.n_images:
        return None
    text = response.text.strip()
    return text if len(text) == 1 and text in letters else None


def answer_matches(
    samples: Sequence[Sample],
    responses: Sequence[Response],
    answer_text: Callable[[Response], str | None],
) -> list[float]:
    """1.0 where `answer_text(response)` equals the sample's stripped answer, else 0.0;
    ValueError naming a sample without an answer."""
    out = []
    for sample, response in zip(samples, responses):
        if sample.answer is None:
            raise ValueError(f"sample {sample.id!r} has no answer")
        out.append(float(answer_text(response) == sample.answer.strip()))
    return out


def target_digit(sample: Sample) -> int:
    """meta["digit"], else int(answer); ValueError naming the sample if neither is 0-9."""
    value = sample.meta.get("digit", sample.answer)
    try:
        digit = int(value)
    except (TypeError, ValueError):
        digit = -1
    if not 0 <= digit <= 9:
        raise ValueError(f"sample {sample.id!r} has no target digit 0-9 (meta/answer: {value!r})")
    return digit


def single_image(response: Response) -> torch.Tensor | None:
    """The response's only image as pixels [8, 8], or None (no/several/undecodable/other size)."""
    if not response.parsed or len(response.images) != 1 or response.images[0] is None:
        return None
    pixels = response.images[0]
    return pixels if tuple(pixels.shape) == IMAGE_SHAPE else None


class MultipleChoiceExact(RewardPlugin):
    """Strict A–D verifier: 1 if the response is exactly the answer letter, else 0."""

    name = "mc_exact"
    requires_answer = True

    @classmethod
    def answer_problem(cls, answer: str) -> str | None:
        return None if answer in tuple(LETTERS) else f"{answer!r} is not a letter A-D"

    def score(self, samples: Sequence[Sample], responses: Sequence[Response]) -> list[float]:
        out = []
        for sample, response in zip(samples, responses):
            if sample.answer not in tuple(LETTERS):
                raise ValueError(
                    f"sample {sample.id!r}: answer {sample.answer!r} is not a letter A-D"
                )
            out.append(float(chosen_letter(response) == sample.answer))
        return out

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        return [chosen_letter(r) is None for r in responses]


class TextExact(RewardPlugin):
    """Open text answer: 1 if the text-only response, stripped, equals the answer."""

    name = "text_exact"
    requires_answer = True

    def score(self, samples: Sequence[Sample], responses: Sequence[Response]) -> list[float]:
        return answer_matches(samples, responses, self._text)

    @staticmethod
    def _text(response: Response) -> str | None:
        if not response.parsed or response.n_images:
            return None
        return response.text.strip() or None

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        return [self._text(r) is None for r in responses]


class JigsawVerifier(RewardPlugin):
    """1 if the chosen letter names the option whose permutation is meta["solution"].

    Verifies the permutation itself (meta "options" and "solution"), not the answer field.
    """

    name = "jigsaw"

    def score(self, samples: Sequence[Sample], responses: Sequence[Response]) -> list[float]:
        out = []
        for sample, response in zip(samples, responses):
            options, solution = sample.meta.get("options"), sample.meta.get("solution")
            if not isinstance(options, list) or solution is None or len(options) > len(LETTERS):
                raise ValueError(f"sample {sample.id!r} has no jigsaw meta 'options'/'solution'")
            letter = chosen_letter(response, LETTERS[: len(options)])
            chosen = None if letter is None else options[LETTERS.index(letter)]
            out.append(float(chosen is not None and list(chosen) == list(solution)))
        return out

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        n_options = [len(s.meta.get("options") or LETTERS) for s in samples]
        return [chosen_letter(r, LETTERS[:k]) is None for r, k in zip(responses, n_options)]


class DigitClassifierReward(RewardPlugin):
    """p(target digit | decoded image) under a `DigitClassifier` (the learned scorer)."""

    name = "digit_classifier"
    needs_images = True

    def __init__(self, classifier: DigitClassifier) -> None:
        self.classifier = classifier

    def score(self, samples: Sequence[Sample], responses: Sequence[Response]) -> torch.Tensor:
        digits = [target_digit(s) for s in samples]
        images = [single_image(r) for r in responses]
        out = torch.zeros(len(samples), dtype=torch.float32)
        valid = [i for i, img in enumerate(images) if img is not None]
        if valid:
            pixels = torch.stack([images[i] for i in valid])
            out[valid] = self.classifier.score(pixels, torch.tensor([digits[i] for i in valid]))
        return out

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        return [single_image(r) is None for r in responses]


class ExactAnswer(RewardPlugin):
    """Draw-then-answer: 1 if the text after the (only) image, stripped, equals the answer.

    With `require_image_class`, the drawn image must also be classified (argmax) as the
    target digit by the classifier.
    """

    name = "exact_answer"
    requires_answer = True

    def __init__(
        self, require_image_class: bool = False, classifier: DigitClassifier | None = None
    ) -> None:
        if require_image_class and classifier is None:
            raise ValueError("exact_answer with require_image_class needs a classifier")
        self.require_image_class = bool(require_image_class)
        self.classifier = classifier
        self.needs_images = self.require_image_class

    @staticmethod
    def final_text(response: Response) -> str | None:
        """The stripped text after the only image, or None (no/several images, no text)."""
        if not response.parsed or response.n_images != 1:
            return None
        text = response.text_after_last_image()
        return text.strip() if text and text.strip() else None

    def score(self, samples: Sequence[Sample], responses: Sequence[Response]) -> list[float]:
        out = answer_matches(samples, responses, self.final_text)
        if self.require_image_class:
            for i, (sample, response) in enumerate(zip(samples, responses)):
                pixels = single_image(response)
                if out[i] and (pixels is None or self._predict(pixels) != target_digit(sample)):
                    out[i] = 0.0
        return out

    def _predict(self, pixels: torch.Tensor) -> int:
        return int(self.classifier.predict(pixels.unsqueeze(0))[0])

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        flags = [self.final_text(r) is None for r in responses]
        if self.require_image_class:
            flags = [f or single_image(r) is None for f, r in zip(flags, responses)]
        return flags


PLUGINS: dict[str, type[RewardPlugin]] = {
    "mc_exact": MultipleChoiceExact,
    "mc_exact_match": MultipleChoiceExact,
    "jigsaw": JigsawVerifier,
    "digit_classifier": DigitClassifierReward,
    "exact_answer": ExactAnswer,
    "text_exact": TextExact,
    "clip_score": ClipScore,
    "pickscore": ClipScore,
}
"""Plugin name (config `reward.plugins.N.name`) -> class."""

_KWARGS: dict[type[RewardPlugin], frozenset[str]] = {
    ExactAnswer: frozenset({"require_image_class"})
}


def _classifier(cfg: RewardPluginConfig, key: str, resources: Mapping[str, Any]) -> DigitClassifier:
    if cfg.path is not None:
        try:
            return DigitClassifier.from_pretrained(cfg.path)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(str(err), key=f"{key}.path") from err
    given = resources.get("digit_classifier")
    if given is None:
        raise ConfigError(
            f"plugin '{cfg.name}' needs a digit classifier",
            key=f"{key}.path",
            expected="a directory saved by DigitClassifier.save_pretrained",
        )
    return given


def build_plugin(
    cfg: RewardPluginConfig,
    key: str = "reward.plugins.0",
    resources: Mapping[str, Any] | None = None,
) -> RewardPlugin:
    """The plugin named by `cfg`; `key` is its dotted config key (for errors).

    `resources["digit_classifier"]` passes a `DigitClassifier` directly when `cfg.path`
    is null. Unknown names, kwargs, or a path a plugin does not use raise ConfigError.
    """
    resources = resources or {}
    cls = PLUGINS.get(cfg.name)
    if cls is None:
        raise ConfigError(
            f"unknown reward plugin '{cfg.name}'",
            key=f"{key}.name",
            expected=" | ".join(sorted(PLUGINS)),
            suggestion=suggest(cfg.name, PLUGINS),
        )
    allowed = getattr(cls, "config_kwargs", _KWARGS.get(cls, frozenset()))
    for name in cfg.kwargs:
        if name not in allowed:
            raise ConfigError(
                f"plugin '{cfg.name}' has no option '{name}'",
                key=f"{key}.kwargs.{name}",
                expected=" | ".join(sorted(allowed)) or "no kwargs",
                suggestion=suggest(name, allowed),
            )
    if hasattr(cls, "from_config"):
        return cls.from_config(cfg, key, resources)
    if cls is DigitClassifierReward:
        return cls(_classifier(cfg, key, resources))
    if cls is ExactAnswer:
        require = cfg.kwargs.get("require_image_class", False)
        if not isinstance(require, bool):
            raise ConfigError(
                f"must be a bool, got {require!r}", key=f"{key}.kwargs.require_image_class"
            )
        if not require and cfg.path is not None:
            raise ConfigError(
                "has no effect unless kwargs.require_image_class is true", key=f"{key}.path"
            )
        return cls(require, _classifier(cfg, key, resources) if require else None)
    if cfg.path is not None:
        raise ConfigError(f"plugin '{cfg.name}' does not load a model", key=f"{key}.path")
    return cls()
