"""Sampling parameters: one typed, immutable object per rollout request (docs/architecture.md §4).

The *policy* a trajectory was sampled from is defined by `POLICY_FIELDS` (temperature,
top-k, top-p, guidance weight, guidance log-prob convention, bit temperature): replay
applies exactly these, or refuses (`check_same_policy`). The other fields steer the
sampler (greedy decoding, lengths, stops, header bounds) without changing the
distribution whose log-probs are recorded.

Every field that the `rollout:` config section also has takes its default from that
section's schema (`RolloutConfig`): one source of truth per setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from uniweave.config.schema import RolloutConfig
from uniweave.core.types import LengthSemantics

GuidanceLogprob = Literal["guided", "conditional"]
InvalidHeader = Literal["invalid", "text"]

POLICY_FIELDS: tuple[str, ...] = (
    "temperature",
    "top_k",
    "top_p",
    "guidance",
    "guidance_logprob",
    "bit_temperature",
)


def _default(name: str):
    """The `rollout.<name>` default of the config schema."""
    return RolloutConfig.model_fields[name].default


def _positive_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"SamplingParams.{name} must be an int >= {minimum}, got {value!r}")


def _positive_float(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"SamplingParams.{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled.

    - `temperature`, `top_k` (0 = off), `top_p` (1.0 = off): text and VQ positions, in the
      order of `uniweave.core.distributions.process_logits`.
    - `guidance` w: classifier-free guidance z = u + w (c - u) on visual logits (VQ and
      BSQ), with one unconditional row per conditional row when w != 1.
    - `guidance_logprob`: the distribution whose log-prob is recorded at visual positions:
      "guided" (softmax(z / tau), the one sampled: on-policy) or "conditional"
      (softmax(c / tau), T2I-R1 / AR-GRPO: off-policy when w != 1). With top-k / top-p a
      code sampled from the guided distribution can lie outside the truncated
      conditional support: its "conditional" log-prob is then -inf (in rollout and replay).
    - `bit_temperature`: divides BSQ bit logits (after guidance).
    - `greedy`: take the mode instead of sampling (log-probs are still those of the
      processed distribution above).
    - `max_new_tokens`: bound on sampled (POLICY) positions; controller insertions are
      free. None: no bound of its own, the model's context length ends the row
      ("context"); it needs the cycle detector on (`cycle_max_period` > 0) and "cap". `length_semantics` "cap": reaching it truncates (finish_reason "cap");
      "exact": the request is a forced image of exactly `max_new_tokens` = H*W visual
      positions, which ends "length_exact".
    - `stop_token_ids`: extra text ids that end a row like EOS (`<|im_end|>`).
    - `cycle_max_period` p_max (0 = off) and `cycle_repeats` r: a row whose last r*p
      text tokens are one block of p <= p_max tokens repeated r times ends "cycle".
    - `min_grid_side` / `max_grid_side`: allowed H and W of a sampled
      `generate image H W` header; `on_invalid_header`: a malformed or out-of-bounds
      header ends the row "invalid", or ("text") `<|vision_start|>` stays a text token.
    """

    temperature: float = _default("temperature")
    top_k: int = _default("top_k")
    top_p: float = _default("top_p")
    guidance: float = _default("guidance")
    guidance_logprob: GuidanceLogprob = _default("guidance_logprob")
    bit_temperature: float = _default("bit_temperature")
    greedy: bool = False
    max_new_tokens: int | None = _default("max_new_tokens")
    length_semantics: LengthSemantics = _default("length_semantics")
    stop_token_ids: tuple[int, ...] = ()
    cycle_max_period: int = _default("cycle_max_period")
    cycle_repeats: int = _default("cycle_repeats")
    min_grid_side: int = _default("min_grid_side")
    max_grid_side: int = _default("max_grid_side")
    on_invalid_header: InvalidHeader = _default("on_invalid_header")

    def __post_init__(self) -> None:
        _positive_float("temperature", self.temperature)
        _positive_float("bit_temperature", self.bit_temperature)
        _positive_int("top_k", self.top_k, minimum=0)
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p!r}")
        w = self.guidance
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"SamplingParams.guidance must be a finite number, got {w!r}")
        if self.guidance_logprob not in ("guided", "conditional"):
            raise ValueError(
                "SamplingParams.guidance_logprob must be 'guided' or 'conditional', "
                f"got {self.guidance_logprob!r}"
            )
        if not isinstance(self.greedy, bool):
            raise ValueError(f"SamplingParams.greedy must be a bool, got {self.greedy!r}")
        if self.max_new_tokens is not None:
            _positive_int("max_new_tokens", self.max_new_tokens)
        if self.length_semantics not in ("cap", "exact"):
            raise ValueError(
                f"SamplingParams.length_semantics must be 'cap' or 'exact', "
                f"got {self.length_semantics!r}"
            )
        stops = self.stop_token_ids
        if not isinstance(stops, tuple) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stops
        ):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be a tuple of token ids, got {stops!r}"
            )
        _positive_int("cycle_max_period", self.cycle_max_period, minimum=0)
        _positive_int("cycle_repeats", self.cycle_repeats, minimum=2)
        _positive_int("min_grid_side", self.min_grid_side)
        _positive_int("max_grid_side", self.max_grid_side, minimum=self.min_grid_side)
        if self.on_invalid_header not in ("invalid", "text"):
            raise ValueError(
                f"SamplingParams.on_invalid_header must be 'invalid' or 'text', "
                f"got {self.on_invalid_header!r}"
            )
        if self.max_new_tokens is None and self.cycle_max_period == 0:
            raise ValueError(
                "SamplingParams.max_new_tokens None (the context length as the horizon) "
                "needs the cycle detector on (cycle_max_period > 0)"
            )
        if self.max_new_tokens is None and self.length_semantics == "exact":
            raise ValueError("SamplingParams.max_new_tokens None cannot be 'exact' (H*W)")

    def at_cap(self, n_policy: int) -> bool:
        """Whether `n_policy` sampled positions reach `max_new_tokens` (never when None)."""
        return self.max_new_tokens is not None and n_policy >= self.max_new_tokens

    @property
    def guided(self) -> bool:
        """True when visual positions need an unconditional row (w != 1)."""
        return self.guidance != 1.0

    @property
    def needs_uncond_for_scoring(self) -> bool:
        """True when the recorded visual log-prob depends on the unconditional row."""
        return self.guided and self.guidance_logprob == "guided"

    def text_key(self) -> tuple[float, int, float]:
        """What defines the text distribution (rows with equal keys batch together)."""
        return (self.temperature, self.top_k, self.top_p)

    def visual_key(self) -> tuple:
        """What defines the visual distribution (rows with equal keys batch together)."""
        return (
            self.temperature,
            self.top_k,
            self.top_p,
            self.guidance,
            self.guidance_logprob,
            self.bit_temperature,
        )

    def grid_allowed(self, height: int, width: int) -> bool:
        """Whether H and W both lie in [min_grid_side, max_grid_side]."""
        lo, hi = self.min_grid_side, self.max_grid_side
        return lo <= height <= hi and lo <= width <= hi

    def to_dict(self) -> dict:
        """Plain values (for logs and manifests)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def policy_mismatch(sampled: SamplingParams, replayed: SamplingParams) -> dict[str, tuple]:
    """{field: (sampled value, replay value)} for the POLICY_FIELDS that differ."""
    out = {}
    for name in POLICY_FIELDS:
        a, b = getattr(sampled, name), getattr(replayed, name)
        if a != b:
            out[name] = (a, b)
    return out


def check_same_policy(sampled: SamplingParams, replayed: SamplingParams, where: str) -> None:
    """Raise ValueError naming every policy field on which replay differs from rollout."""
    diff = policy_mismatch(sampled, replayed)
    if diff:
        what = ", ".join(f"{k}: sampled {a!r}, replay {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"{where}: replay must use the policy the trajectory was sampled with ({what}); "
            "log-probs under another temperature/truncation/guidance are a different policy"
        )
