"""Drift-to-noise of a per-update metric (docs/numerics.md §12): learning claims.

Fit y_k = a + b·k by least squares over the K updates k = 0..K-1;
drift = b·(K − 1) (the fitted change over the run), noise = std of the residuals
(population, ddof 0), ratio = drift / noise. A claim needs ratio >= 3 and a held-out
evaluation before and after.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class DriftNoise:
    """Least-squares drift and residual noise of a curve, with its first/last-n means."""

    n: int
    slope: float
    drift: float
    noise: float
    ratio: float
    first_mean: float
    last_mean: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def drift_to_noise(values: Sequence[float], window: int = 10) -> DriftNoise:
    """`DriftNoise` of `values` (one per update, in order); `window` sets how many
    updates the first/last means average. ratio is +inf for a noiseless rising line,
    -inf for a falling one and 0 for a constant. ValueError for < 3 or non-finite values."""
    y = np.asarray(values, dtype=np.float64)
    if y.ndim != 1 or y.size < 3:
        raise ValueError(f"drift_to_noise needs at least 3 values, got {y.size}")
    if not np.isfinite(y).all():
        raise ValueError("drift_to_noise: values must be finite")
    k = np.arange(y.size, dtype=np.float64)
    kc, yc = k - k.mean(), y - y.mean()
    slope = float((kc * yc).sum() / (kc * kc).sum())
    residuals = yc - slope * kc
    drift = slope * (y.size - 1)
    noise = float(residuals.std())
    tol = 1e-12 * max(1.0, float(np.abs(y).max()))
    if noise > tol:
        ratio = drift / noise
    else:
        ratio = 0.0 if abs(drift) <= tol else math.copysign(math.inf, drift)
    w = min(window, y.size)
    return DriftNoise(
        n=int(y.size),
        slope=float(slope),
        drift=drift,
        noise=noise,
        ratio=float(ratio),
        first_mean=float(y[:w].mean()),
        last_mean=float(y[-w:].mean()),
    )
