"""The policy's action distributions as `SamplingParams` define them (docs/numerics.md §1).

Rollout and replay both build their distributions here, so a log-prob recorded while
sampling and one recomputed by replay are the same function of the same logits.
"""

from __future__ import annotations

import torch

from uniweave.core.distributions import TextCategorical, VisualBits, VisualCategorical
from uniweave.models.base import VisualHead
from uniweave.rollout.params import SamplingParams

VisualDistribution = VisualCategorical | VisualBits


def text_distribution(logits: torch.Tensor, params: SamplingParams) -> TextCategorical:
    """softmax(logits / tau) truncated by top-k then top-p."""
    return TextCategorical(logits, params.temperature, params.top_k, params.top_p)


def visual_distribution(
    kind: VisualHead,
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    params: SamplingParams,
) -> VisualDistribution:
    """The visual action distribution: VQ categorical or BSQ bits, with guidance.

    Guided logits z = u + w (c - u). VQ: softmax(z / tau) with top-k / top-p (tau =
    `temperature`); BSQ: Bernoulli(sigmoid(z / tau_bits)) per factor. Log-probs follow
    `params.guidance_logprob`. With w != 1 and `uncond` None the distribution is built
    for *scoring* under "conditional" only (it then depends on c alone); sampling needs
    the unconditional logits.
    """
    guidance = params.guidance
    if uncond is None and params.guided:
        if params.guidance_logprob != "conditional":
            raise ValueError(
                f"guidance {params.guidance} with guidance_logprob 'guided' needs the "
                "unconditional logits"
            )
        guidance = 1.0
    if kind == "vq":
        return VisualCategorical(
            cond,
            uncond,
            guidance,
            params.temperature,
            params.top_k,
            params.top_p,
            params.guidance_logprob,
        )
    return VisualBits(cond, params.bit_temperature, uncond, guidance, params.guidance_logprob)
