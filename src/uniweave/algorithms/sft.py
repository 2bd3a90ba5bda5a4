"""Supervised fine-tuning objective on interleaved trajectories (pure functions).

Per scored position t (policy-owned targets):
- text:        ℓ_t = −log softmax(z_t)[y_t]
- visual, VQ:  ℓ_t = −log softmax(z_t)[c_t]
- visual, BSQ: ℓ_t = −Σ_f [b_f log σ(z_f) + (1 − b_f) log σ(−z_f)]   (sum over the L bits)

    L = (Σ_text ℓ_t + λ_visual · Σ_visual ℓ_t) / N

where N is the number of scored positions (text + visual) in the *global* batch — all
micro-batches and ranks — so every position weighs the same however the batch is split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from uniweave.core.dtypes import at_least_fp32


def text_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy [N] of categorical `logits` [N, V] at `targets` [N]."""
    return F.cross_entropy(at_least_fp32(logits), targets, reduction="none")


def bit_ce(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Per-position bit cross-entropy [N], summed over the L Bernoulli factors."""
    z = at_least_fp32(logits)
    return F.binary_cross_entropy_with_logits(z, bits.to(z.dtype), reduction="none").sum(-1)


def visual_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """VQ categorical CE when `targets` are indices [N], BSQ bit CE when they are bits [N, L]."""
    return bit_ce(logits, targets) if targets.dim() == 2 else text_ce(logits, targets)


@dataclass
class SFTTerms:
    """Summed (not averaged) loss terms of one micro-batch and their position counts."""

    text_sum: torch.Tensor
    visual_sum: torch.Tensor
    n_text: int
    n_visual: int


def sft_loss(terms: SFTTerms, lambda_visual: float, n_global: int) -> torch.Tensor:
    """(Σ text CE + λ_visual · Σ visual CE) / N_global (see module docstring)."""
    if n_global <= 0:
        raise ValueError("sft_loss: the global batch has no scored positions")
    return (terms.text_sum + lambda_visual * terms.visual_sum) / n_global


def bitflip(
    codes: torch.Tensor,
    visual_mask: torch.Tensor,
    rates: torch.Tensor,
    n_codes: int,
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """BitFlip input noise: corrupt visual *input* codes, row b at rate `rates[b]`.

    BSQ codes [B, T, L]: each bit of a visual position flips with probability rates[b].
    VQ codes [B, T]: each visual position is replaced by a uniformly drawn code index with
    probability rates[b] (the categorical analogue). Non-visual positions never change.
    Row b draws only from `generators[b]` (a stateless per-trajectory seed), so the noise
    of a trajectory does not depend on how the batch is split across micro-batches/ranks.
    """
    if len(generators) != codes.shape[0]:
        raise ValueError(f"bitflip: {len(generators)} generators for {codes.shape[0]} rows")
    row_shape = codes.shape[1:]
    draw = torch.stack([torch.rand(row_shape, generator=g) for g in generators])
    draw = draw.to(codes.device)
    rate = rates.to(codes.device).view(-1, *([1] * (codes.dim() - 1)))
    mask = visual_mask if codes.dim() == 2 else visual_mask.unsqueeze(-1)
    flip = (draw < rate) & mask
    if codes.dim() == 3:
        return torch.where(flip, 1.0 - codes, codes)
    replacement = torch.stack(
        [torch.randint(0, n_codes, row_shape, generator=g) for g in generators]
    ).to(codes.device)
    return torch.where(flip, replacement, codes)


def bitflip_rates(
    probability: float,
    mode: Literal["fixed", "uniform"],
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Per-trajectory flip rates: `probability` (fixed) or `u · probability`, u ~ U[0, 1]
    drawn per trajectory from its stateless seed (uniform)."""
    if mode == "fixed":
        return torch.full_like(uniforms, probability)
    return uniforms * probability


def half_partition(seeds: Sequence[int]) -> frozenset[int]:
    """The row seeds BitFlip `partition: half` noises, out of the seeds of one update's
    *global* batch: its distinct seeds in ascending order, those at even positions
    (0, 2, 4, …), so ceil(D/2) of D distinct rows. Row seeds are blake2b hashes of (run
    seed, update, sample id), so the order is a fresh pseudo-random one each update; the
    choice depends only on the set of seeds, not on the order, the micro-batches or the
    ranks. A row drawn twice in one update has one seed and one input, so its copies are
    noised together or not at all."""
    return frozenset(sorted(set(seeds))[0::2])


def soft_codes(logits: torch.Tensor, latent_dim: int) -> torch.Tensor:
    """ĉ = (2σ(z) − 1)/√L [N, k²L]: the expected code under the predicted Bernoulli bits
    (E[2b − 1] = 2σ(z) − 1 per bit), differentiable in the bit logits z."""
    z = at_least_fp32(logits)
    return (2.0 * torch.sigmoid(z) - 1.0) / math.sqrt(latent_dim)


def code_features(
    codes: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, latent_dim: int
) -> torch.Tensor:
    """F(codes) [N, k²·h]: each of a composite position's k² cells ([N, k²L] in (dy, dx,
    bit) order) through the cell projection x ↦ W x + b (W [h, L], b [h]), concatenated in
    cell order — the codecs have no cross-cell merger, so F is block diagonal."""
    n = codes.shape[0]
    cells = codes.reshape(n, -1, latent_dim)
    return (cells @ weight.T.to(cells) + bias.to(cells)).reshape(n, -1)


def soft_bsq_distances(
    logits: torch.Tensor,
    bits: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    latent_dim: int,
) -> torch.Tensor:
    """Per visual position ‖F(ĉ) − sg F(c)‖² [N]: ĉ the soft code of the bit logits
    [N, k²L], c = (2b − 1)/√L the hard code of the target bits, F = `code_features`.
    The Soft-BSQ loss is λ · Σ_p d_p / N_visual (docs/numerics.md §2)."""
    soft = code_features(soft_codes(logits, latent_dim), weight, bias, latent_dim)
    hard = (2.0 * bits.to(soft.dtype) - 1.0) / math.sqrt(latent_dim)
    target = code_features(hard, weight, bias, latent_dim).detach()
    return (soft - target).pow(2).sum(-1)
