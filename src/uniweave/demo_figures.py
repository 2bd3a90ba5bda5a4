"""Run reports: a reward curve with its noise band, before/after image grids, markdown.

The curve (`uniweave.eval.curves`) plots the per-update metric, its least-squares line
(docs/numerics.md §12) and a band of ± one residual std around the line: the noise a
learning claim is measured against. The image grid shows, for each digit 0-9, images
drawn by a model before and after training from the same stateless seeds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from uniweave.core.sample import GenerationRequest, Sample, TextPart
from uniweave.core.seeding import seed_for
from uniweave.data.digits import T2I_PROMPT
from uniweave.eval import curves
from uniweave.eval.drift import DriftNoise, drift_to_noise
from uniweave.models.base import UnifiedModel
from uniweave.rewards.plugins import build_responses
from uniweave.rollout import RolloutEngine, RolloutRequest, SamplingParams
from uniweave.train.engine.metrics import read_metrics


def reward_curve_png(metrics_path: Path, key: str, out_png: Path) -> DriftNoise:
    """Plot `key` per update with its fitted line ± residual std (a one-panel
    `uniweave.eval.curves` figure); return the fit."""
    values = [r[key] for r in read_metrics(metrics_path) if isinstance(r.get(key), (int, float))]
    if len(values) < 3:
        raise ValueError(f"{metrics_path}: fewer than 3 updates log {key!r}")
    fit = drift_to_noise(values)
    # a constant reward is not drawn: the figure says so
    curves.draw(curves.select(read_metrics(metrics_path), signals=((key, (key,)),)), out_png)
    return fit


@torch.no_grad()
def draw_digits(model: UnifiedModel, per_digit: int, seed: int) -> list[np.ndarray]:
    """`per_digit` images of each digit 0-9 (row-major by digit), sampled at temperature 1
    with seeds seed_for(seed, 0, digit, k)."""
    grid = tuple(model.codec.grid)
    params = SamplingParams(max_new_tokens=grid[0] * grid[1], length_semantics="exact")
    requests = [
        RolloutRequest(
            Sample(
                id=f"digit-{d}/{k}",
                parts=[TextPart(T2I_PROMPT.format(digit=d)), GenerationRequest(*grid)],
            ),
            seed_for(seed, 0, d, k),
            params,
        )
        for d in range(10)
        for k in range(per_digit)
    ]
    trajs = RolloutEngine(model).generate(requests)
    responses, _ = build_responses([model.parse_response(t) for t in trajs], model.codec.decode)
    return [_first_image(r.images) for r in responses]


def _first_image(images: tuple[torch.Tensor | None, ...]) -> np.ndarray:
    """A response's first image (a blank 8x8 where it drew none); ValueError when the
    image it drew could not be decoded."""
    if not images:
        return np.zeros((8, 8))
    if images[0] is None:
        raise ValueError("a generated image could not be decoded")
    return images[0].numpy()


def before_after_png(
    before: list[np.ndarray], after: list[np.ndarray], per_digit: int, out_png: Path
) -> Path:
    """Rows: digits 0-9; left block the `before` images, right block the `after` ones."""
    from uniweave.generate import image_grid_png

    rows = []
    for d in range(10):
        chunk = slice(d * per_digit, (d + 1) * per_digit)
        rows.extend(before[chunk] + [np.zeros_like(before[0])] + after[chunk])
    return image_grid_png(rows, out_png, cols=2 * per_digit + 1)


COUNTS = ("/n", "/n_samples", "/n_rollouts")
"""Metric-name endings of row counts (an evaluation's size, not a result)."""


def markdown_table(before: dict[str, float], after: dict[str, float]) -> str:
    """A markdown table of the held-out metrics before and after, without the row counts
    ("-": not measured before)."""
    lines = ["| metric | before | after |", "|---|---|---|"]
    for key in sorted(after):
        if key.endswith(COUNTS):
            continue
        was = f"{before[key]:.3f}" if key in before else "-"
        lines.append(f"| {key} | {was} | {after[key]:.3f} |")
    return "\n".join(lines)
