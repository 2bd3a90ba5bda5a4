"""The demo report's pieces: the reward curve fit and the before/after digit grid."""

import json

import numpy as np
from PIL import Image

from uniweave.demo_figures import before_after_png, markdown_table, reward_curve_png


def test_reward_curve_fit_matches_a_known_line(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.01, 40)
    rows = [{"update": k + 1, "reward/total_mean": 0.2 + 0.005 * k + noise[k]} for k in range(40)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fit = reward_curve_png(metrics, "reward/total_mean", tmp_path / "curve.png")
    k = np.arange(40)
    slope, intercept = np.polyfit(k, [r["reward/total_mean"] for r in rows], 1)
    residuals = np.array([r["reward/total_mean"] for r in rows]) - (intercept + slope * k)
    # float64, two least-squares fits of 40 points (k in [0, 39]: conditioning ~ 40^2) and
    # the residuals' std: ~3 x 40 roundings of values <= 1, 120 x 2^-53 x 1600 ~ 2e-11
    # bound: the float64 worst case above, 1e-9 leaves 50x
    assert abs(fit.drift - slope * 39) < 1e-9 and abs(fit.noise - residuals.std()) < 1e-9
    assert fit.ratio > 3
    with Image.open(tmp_path / "curve.png") as img:
        assert img.format == "PNG"


def test_before_after_grid_and_table(tmp_path):
    before = [np.full((8, 8), d / 10, dtype=np.float32) for d in range(10) for _ in range(2)]
    after = [np.eye(8, dtype=np.float32) for _ in range(20)]
    path = before_after_png(before, after, 2, tmp_path / "grid.png")
    with Image.open(path) as img:
        pixels = np.asarray(img)
    assert pixels.shape[0] > 10 * 8 * 16 and pixels.shape[1] > 5 * 8 * 16
    table = markdown_table({"t2i/score": 0.1, "t2i/n": 5}, {"t2i/score": 0.4, "t2i/n": 5})
    assert "| t2i/score | 0.100 | 0.400 |" in table and "t2i/n" not in table
    table = markdown_table({"t2i/score": 0.1}, {"t2i/score": 0.4, "dta/masked_drop": 0.5})
    assert "| dta/masked_drop | - | 0.500 |" in table
