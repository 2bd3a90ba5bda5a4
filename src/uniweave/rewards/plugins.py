"""Reward plugins: the built-in plugins and their registry `PLUGINS` (config name ->
class, built by `build_plugin`), on the interface of `uniweave.rewards.base` (`Response`,
`RewardPlugin`, `build_responses`; re-exported here).

A plugin scores a batch: `score(samples, responses) -> [n] floats`, and flags rows whose
response has the wrong format with `invalid_format` (they score 0 and are counted):

- `mc_exact` (alias `mc_exact_match`; i2t_mc, jigsaw_mc): 1 if the response text,
  stripped, is exactly sample.answer. Invalid: anything but one letter A-D (case
  sensitive), or a response with an image.
- `jigsaw` (jigsaw_mc): 1 if the chosen letter names the option whose permutation equals
  meta["solution"] (verified on meta, not on the answer field). Invalid: as mc_exact.
- `visual_jigsaw` (visual_jigsaw, `uniweave data jigsaw`): 1 if the response orders the
  pieces as meta["solution"]; another valid order scores gamma (kwarg, default 0.2) x
  the fraction of positions it gets right. Invalid (0): anything but the n = len(solution)
  numbers 0..n-1, each once, separated by spaces or commas (optionally in one pair of
  brackets), or a response with an image.
- `digit_classifier` (t2i, draw_then_answer): p(target digit | decoded image) under a
  `DigitClassifier`. Invalid: not exactly one decodable 8x8 image.
- `text_exact` (i2t_open): 1 if the text-only response, stripped, equals sample.answer.
  Invalid: an empty response or one with an image.
- `exact_answer` (draw_then_answer): 1 if the text after the only image, stripped, equals
  sample.answer; kwarg `require_image_class` also needs the classifier's argmax on the
  image to be the target digit. Invalid: not exactly one image followed by text.
- `clip_score` (alias `pickscore`; t2i on real images): CLIP / PickScore-style
  text-image score from a local `CLIPModel` directory (`uniweave.rewards.clip_score`;
  kwargs device, mode, batch_size). Invalid: not exactly one decodable image.
- `geneval` (t2i on real images): GenEval's verdict on the image against the sample's
  meta["geneval"] metadata row, 1/0 or (kwarg partial) the share of include clauses met,
  from a transformers detector (`path`; kwargs detector, clip_path, device, batch_size,
  threshold, partial; `uniweave.rewards.geneval.reward`). Invalid: not exactly one
  decodable image.
- `answer_judge` (open answers): a deterministic parser (letters, numbers, normalised
  text), then a judge — a local causal LM (`path`) or an OpenAI-compatible endpoint
  (kwargs base_url, model, timeout, retries, concurrency, api_key_env) — for the rows it
  leaves unresolved (`uniweave.rewards.judge`). Invalid: an empty or unparsable response.

A plugin class with a `from_config(cfg, key, resources)` classmethod and a
`config_kwargs` set builds itself from its config entry.

Plugins from other packages: a distribution that declares an entry point in the group
`uniweave.rewards` (`ENTRY_POINT_GROUP`; name = the config name, value = a `RewardPlugin`
subclass, `module:Class`) is found by `plugin_class` after the built-ins (a built-in
name always means the built-in). Such a class builds with `from_config` when it has
one, else as `cls(**kwargs)` with kwargs checked against its `config_kwargs` (and no
`path`). docs/rewards.md and examples/reward_plugin/ show a complete package.

The target digit is meta["digit"] (else the answer). A sample a plugin cannot verify
(e.g. mc_exact on an answer that is not a letter) raises: restrict the plugin to its
tasks with `tasks:` in its config.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import torch

from uniweave.config.errors import ConfigError, suggest
from uniweave.config.schema import RewardPluginConfig
from uniweave.core.sample import Sample
from uniweave.data.template import parse_response, response_parts
from uniweave.rewards.base import DecodeImages, Response, RewardPlugin, build_responses
from uniweave.rewards.clip_score import ClipScore
from uniweave.rewards.digit_classifier import DigitClassifier
from uniweave.rewards.geneval.reward import GenEvalReward
from uniweave.rewards.judge import AnswerJudge

__all__ = [
    "PLUGINS",
    "DecodeImages",
    "DigitClassifierReward",
    "ExactAnswer",
    "JigsawVerifier",
    "MultipleChoiceExact",
    "VisualJigsaw",
    "Response",
    "RewardPlugin",
    "TextExact",
    "build_plugin",
    "installed_plugins",
    "plugin_class",
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
        digit = -1 if value is None else int(value)
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


def jigsaw_order(response: Response, n: int) -> list[int] | None:
    """The order a text-only response gives: n integers, a permutation of 0..n-1,
    separated by spaces or commas, optionally inside one pair of brackets; else None."""
    if not response.parsed or response.n_images:
        return None
    text = response.text.strip()
    if text[:1] + text[-1:] in ("[]", "()"):
        text = text[1:-1].strip()
    tokens = [t for t in re.split(r"[\s,]+", text) if t]
    if len(tokens) != n or not all(t.isascii() and t.isdigit() for t in tokens):
        return None
    order = [int(t) for t in tokens]
    return order if sorted(order) == list(range(n)) else None


class VisualJigsaw(RewardPlugin):
    """Visual Jigsaw verifier: 1 exact, gamma x fraction of positions right, 0 invalid."""

    name = "visual_jigsaw"
    config_kwargs = frozenset({"gamma"})

    def __init__(self, gamma: float = 0.2) -> None:
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma < 1:
            raise ValueError(f"gamma must be a number in [0, 1), got {gamma!r}")
        self.gamma = float(gamma)

    @classmethod
    def from_config(
        cls, cfg: RewardPluginConfig, key: str, resources: Mapping[str, Any]
    ) -> VisualJigsaw:
        if cfg.path is not None:
            raise ConfigError(f"plugin '{cfg.name}' does not load a model", key=f"{key}.path")
        try:
            kwargs: dict[str, Any] = dict(cfg.kwargs)  # user values: the constructor checks them
            return cls(**kwargs)
        except ValueError as err:
            raise ConfigError(str(err), key=f"{key}.kwargs.gamma") from err

    @staticmethod
    def solution(sample: Sample) -> list[int]:
        solution = sample.meta.get("solution")
        if not isinstance(solution, list) or sorted(solution) != list(range(len(solution))):
            raise ValueError(f"sample {sample.id!r} has no jigsaw meta 'solution' (a permutation)")
        return [int(q) for q in solution]

    def score(self, samples: Sequence[Sample], responses: Sequence[Response]) -> list[float]:
        out = []
        for sample, response in zip(samples, responses):
            solution = self.solution(sample)
            order = jigsaw_order(response, len(solution))
            if order is None:
                out.append(0.0)
            elif order == solution:
                out.append(1.0)
            else:
                right = sum(a == b for a, b in zip(order, solution))
                out.append(self.gamma * right / len(solution))
        return out

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        return [jigsaw_order(r, len(self.solution(s))) is None for s, r in zip(samples, responses)]


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
            pixels = torch.stack([img for img in images if img is not None])
            out[valid] = self.classifier.score(pixels, torch.tensor([digits[i] for i in valid]))
        return out

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        return [single_image(r) is None for r in responses]

    def features(self, samples: Sequence[Sample], responses: Sequence[Response]) -> torch.Tensor:
        """The classifier's penultimate activations (`DigitClassifier.features`) of each
        row's image, float32 [n, hidden]; NaN rows where `single_image` is None."""
        images = [single_image(r) for r in responses]
        out = torch.full((len(samples), self.classifier.hidden), float("nan"))
        valid = [i for i, img in enumerate(images) if img is not None]
        if valid:
            out[valid] = self.classifier.features(
                torch.stack([img for img in images if img is not None])
            )
        return out


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
        assert self.classifier is not None, "require_image_class loads the classifier"
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
    "visual_jigsaw": VisualJigsaw,
    "digit_classifier": DigitClassifierReward,
    "exact_answer": ExactAnswer,
    "text_exact": TextExact,
    "clip_score": ClipScore,
    "pickscore": ClipScore,
    "answer_judge": AnswerJudge,
    "geneval": GenEvalReward,
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


ENTRY_POINT_GROUP = "uniweave.rewards"
"""The entry-point group other packages declare reward plugins in (module docstring)."""


def installed_plugins() -> dict[str, list[EntryPoint]]:
    """Entry-point name -> the entry points of that name in `ENTRY_POINT_GROUP`, from every
    installed distribution (read now: a package installed after import is seen)."""
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if all(ep.value != other.value for other in found.get(ep.name, [])):
            found.setdefault(ep.name, []).append(ep)
    return found


def known_plugin_names() -> str:
    """The names `plugin_class` resolves, for error messages: built-ins, then installed."""
    installed = sorted(set(installed_plugins()) - set(PLUGINS))
    text = "built-in " + ", ".join(sorted(PLUGINS))
    return text + ("; installed " + ", ".join(installed) if installed else "; none installed")


def _entry_point_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{ep.value} (from {dist.name})" if dist is not None else ep.value


def plugin_class(name: str, key: str = "reward.plugins.0.name") -> type[RewardPlugin]:
    """The plugin class of config name `name`: a built-in (`PLUGINS`), else the class an
    installed `uniweave.rewards` entry point of that name loads. ConfigError at `key` for an
    unknown name (listing the known ones), two packages claiming the name, an entry point
    that fails to import, or one that is not a `RewardPlugin` subclass."""
    cls = PLUGINS.get(name)
    if cls is not None:
        return cls
    installed = installed_plugins()
    eps = installed.get(name, [])
    if not eps:
        names = sorted(set(PLUGINS) | set(installed))
        raise ConfigError(
            f"unknown reward plugin '{name}'",
            key=key,
            expected=f"a registered name ({known_plugin_names()}; packages add names "
            f"with '{ENTRY_POINT_GROUP}' entry points)",
            suggestion=suggest(name, names),
        )
    if len(eps) > 1:
        claims = ", ".join(_entry_point_name(ep) for ep in eps)
        raise ConfigError(
            f"reward plugin '{name}' is declared by several '{ENTRY_POINT_GROUP}' entry "
            f"points: {claims}",
            key=key,
            expected="one installed package per plugin name",
        )
    try:
        loaded = eps[0].load()
    except Exception as err:  # an installed package may fail in any way on import
        raise ConfigError(
            f"reward plugin '{name}' (entry point {_entry_point_name(eps[0])}) failed to "
            f"load: {type(err).__name__}: {err}",
            key=key,
        ) from err
    if not (isinstance(loaded, type) and issubclass(loaded, RewardPlugin)):
        raise ConfigError(
            f"reward plugin '{name}' (entry point {_entry_point_name(eps[0])}) is "
            f"{loaded!r}, not a RewardPlugin subclass",
            key=key,
            expected="an entry point value 'module:Class' naming a uniweave RewardPlugin subclass",
        )
    return loaded


def find_plugin_class(name: str) -> type[RewardPlugin] | None:
    """`plugin_class(name)`, or None where it would raise (callers that only ask what a
    plugin needs; building the plugin reports the problem)."""
    try:
        return plugin_class(name)
    except ConfigError:
        return None


def build_plugin(
    cfg: RewardPluginConfig,
    key: str = "reward.plugins.0",
    resources: Mapping[str, Any] | None = None,
) -> RewardPlugin:
    """The plugin named by `cfg`; `key` is its dotted config key (for errors).

    `resources["digit_classifier"]` passes a `DigitClassifier` directly when `cfg.path`
    is null. Unknown names (`plugin_class`), kwargs, or a path a plugin does not use
    raise ConfigError.
    """
    resources = resources or {}
    cls = plugin_class(cfg.name, f"{key}.name")
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
    if cls in PLUGINS.values():
        return cls()
    try:  # an installed plugin: its config_kwargs are its constructor's keyword arguments
        return cls(**cfg.kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"plugin '{cfg.name}': {err}", key=f"{key}.kwargs") from err
