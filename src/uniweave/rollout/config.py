"""The `rollout:` config section as engine `SamplingParams` (one field to one field)."""

from __future__ import annotations

from uniweave.config.schema import RolloutConfig
from uniweave.core.types import LengthSemantics
from uniweave.rollout.params import SamplingParams


def sampling_params(
    cfg: RolloutConfig,
    *,
    max_new_tokens: int | None = None,
    length_semantics: LengthSemantics | None = None,
    greedy: bool = False,
) -> SamplingParams:
    """`SamplingParams` with every field taken from `cfg` (`rollout.<field>` is
    `SamplingParams.<field>`); `max_new_tokens` / `length_semantics` override the
    section's values for one kind of request (e.g. an exact-count image of H*W), and
    `greedy` takes the mode (evaluation; rollouts for training sample)."""
    return SamplingParams(
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        guidance=cfg.guidance,
        guidance_logprob=cfg.guidance_logprob,
        bit_temperature=cfg.bit_temperature,
        greedy=greedy,
        max_new_tokens=cfg.max_new_tokens if max_new_tokens is None else max_new_tokens,
        length_semantics=cfg.length_semantics if length_semantics is None else length_semantics,
        cycle_max_period=cfg.cycle_max_period,
        cycle_repeats=cfg.cycle_repeats,
        min_grid_side=cfg.min_grid_side,
        max_grid_side=cfg.max_grid_side,
        on_invalid_header=cfg.on_invalid_header,
    )
