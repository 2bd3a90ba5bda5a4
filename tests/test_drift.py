"""Drift-to-noise (docs/numerics.md §12): against an independent closed-form least-squares fit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from uniweave.eval.drift import drift_to_noise


def _closed_form(y: np.ndarray) -> tuple[float, float]:
    k = np.arange(len(y), dtype=np.float64)
    kc, yc = k - k.mean(), y - y.mean()
    b = (kc * yc).sum() / (kc * kc).sum()
    a = y.mean() - b * k.mean()
    resid = y - a - b * k
    return b * (len(y) - 1), math.sqrt((resid**2).mean())


def test_matches_closed_form_least_squares():
    rng = np.random.default_rng(0)
    y = 0.3 + 0.01 * np.arange(50) + rng.normal(0, 0.05, 50)
    out = drift_to_noise(y.tolist(), window=10)
    drift, noise = _closed_form(y)
    assert out.drift == pytest.approx(drift, rel=1e-10)
    assert out.noise == pytest.approx(noise, rel=1e-10)
    assert out.ratio == pytest.approx(drift / noise, rel=1e-10)
    assert out.first_mean == pytest.approx(y[:10].mean())
    assert out.last_mean == pytest.approx(y[-10:].mean())
    assert out.n == 50 and out.ratio > 3


def test_noise_only_has_a_small_ratio_and_edge_cases():
    rng = np.random.default_rng(1)
    assert abs(drift_to_noise(rng.normal(0, 1, 200)).ratio) < 1.0
    assert drift_to_noise([1.0, 2.0, 3.0]).ratio == math.inf
    assert drift_to_noise([3.0, 2.0, 1.0]).ratio == -math.inf
    assert drift_to_noise([2.0, 2.0, 2.0]).ratio == 0.0
    with pytest.raises(ValueError, match="at least 3"):
        drift_to_noise([1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        drift_to_noise([1.0, float("nan"), 2.0])
