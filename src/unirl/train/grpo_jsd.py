"""Full-vocabulary reductions of one replay chunk with block-sized temporaries.

A chunk's categorical log-probs are [n, V] (V up to ~10^5). The penalty and statistic
GRPO reduces over the vocabulary are computed a block of rows at a time, so no
temporary larger than a block exists beside the chunk's own log-probs, forward or
backward:

- `symmetric_jsd(logp, logq)`: JSD(p ‖ q) = ½·KL(p ‖ m) + ½·KL(q ‖ m), m = ½(p + q), per
  row (docs/numerics.md §7): OPD's blockwise generalised JSD
  (`unirl.algorithms.opd.generalized_jsd`) at β = ½, whose analytic gradient
  ∂JSD/∂log p_k = ½·p_k·log(p_k / m_k) is recomputed blockwise in backward (`logq` holds
  no gradient: it is the frozen reference).
- `entropy(logp)`: H(p) = −Σ p log p per row, without gradient (a logged statistic).
"""

from __future__ import annotations

import torch

from unirl.algorithms.opd import BLOCK_ELEMENTS, generalized_jsd
from unirl.core.distributions import entropy_from_logp


def symmetric_jsd(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """JSD(p ‖ q) per row [n] of log-probs [n, V] (module docstring); differentiable in
    `logp` only."""
    return generalized_jsd(logp, logq, 0.5)


@torch.no_grad()
def entropy(logp: torch.Tensor) -> torch.Tensor:
    """H(p) per row [n] of log-probs [n, V], without gradient."""
    out = logp.new_empty(logp.shape[:-1])
    rows = max(1, BLOCK_ELEMENTS // max(int(logp.shape[-1]), 1))
    for s in range(0, int(logp.shape[0]), rows):
        out[s : s + rows] = entropy_from_logp(logp[s : s + rows])
    return out
