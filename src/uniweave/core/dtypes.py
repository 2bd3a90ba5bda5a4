"""The one up-cast of the numerics: "at least float32".

bf16/fp16 values are up-cast to float32 before a log-softmax, a divergence, a loss or a
norm; float32 stays float32 and float64 (`trainer.precision: fp64`) stays float64 end to
end.
"""

from __future__ import annotations

import torch


def at_least_fp32_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or `dtype` when it is wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` in `at_least_fp32_dtype(x.dtype)`; `x` itself (no copy) when already there."""
    return x.to(at_least_fp32_dtype(x.dtype))
