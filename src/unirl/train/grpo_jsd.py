"""Full-vocabulary reductions of one replay chunk with block-sized temporaries.

A chunk's categorical log-probs are [n, V] (V up to ~10^5). The penalty and statistic
GRPO reduces over the vocabulary are computed a block of rows at a time, so no
temporary larger than a block (about `BLOCK_ELEMENTS` values) exists beside the chunk's
own log-probs, forward or backward:

- `symmetric_jsd(logp, logq)`: JSD(p ‖ q) = ½·KL(p ‖ m) + ½·KL(q ‖ m), m = ½(p + q), per
  row (NUMERICS "KL / divergence to the reference"; `jsd_from_logp` with β = ½), with
  log m = logaddexp(log p, log q) − log 2 and 0·log 0 = 0. Its gradient is analytic,
  ∂JSD/∂log p_k = p_k · ½·log(p_k / m_k), and recomputed blockwise in backward from the
  two saved log-prob tensors (`logq` holds no gradient: it is the frozen reference).
- `entropy(logp)`: H(p) = −Σ p log p per row, without gradient (a logged statistic).
"""

from __future__ import annotations

import math

import torch

from unirl.core.distributions import entropy_from_logp

BLOCK_ELEMENTS = 1 << 20
LOG2 = math.log(2.0)


def _row_blocks(logp: torch.Tensor) -> list[slice]:
    rows = max(1, BLOCK_ELEMENTS // max(int(logp.shape[-1]), 1))
    return [slice(s, s + rows) for s in range(0, int(logp.shape[0]), rows)]


def _p_log_ratio(logp: torch.Tensor, logm: torch.Tensor) -> torch.Tensor:
    """p · (log p − log m) elementwise, 0 where p = 0."""
    dead = torch.isneginf(logp)
    return torch.where(dead, 0.0, logp.exp() * (logp - logm.masked_fill(dead, 0.0)))


def _log_mid(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    return torch.logaddexp(logp, logq) - LOG2


class _SymmetricJSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
        out = logp.new_empty(logp.shape[:-1])
        for b in _row_blocks(logp):
            logm = _log_mid(logp[b], logq[b])
            half = _p_log_ratio(logp[b], logm).sum(-1)
            half += _p_log_ratio(logq[b], logm).sum(-1)
            out[b] = 0.5 * half
        ctx.save_for_backward(logp, logq)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logp, logq = ctx.saved_tensors
        out = torch.empty_like(logp)
        for b in _row_blocks(logp):
            logm = _log_mid(logp[b], logq[b])
            out[b] = _p_log_ratio(logp[b], logm).mul_(0.5 * grad[b, None])
        return out, None


def symmetric_jsd(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """JSD(p ‖ q) per row [n] of log-probs [n, V] (module docstring); differentiable in
    `logp` only."""
    if logp.shape != logq.shape or logp.dim() != 2:
        raise ValueError(f"expected two [n, V] tensors, got {logp.shape} and {logq.shape}")
    return _SymmetricJSD.apply(logp, logq.detach())


@torch.no_grad()
def entropy(logp: torch.Tensor) -> torch.Tensor:
    """H(p) per row [n] of log-probs [n, V], without gradient."""
    out = logp.new_empty(logp.shape[:-1])
    for b in _row_blocks(logp):
        out[b] = entropy_from_logp(logp[b])
    return out
