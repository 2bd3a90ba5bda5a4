"""`uniweave probe`: Information Gain scores of a model on validation rows, printed.

For every event (docs/numerics.md §3 "Information Gain"; all events, no cycle) of the first N
validation rows per task: the full score, the blind score (source block hidden) and the
gain, per unit (mean log-prob per target position; BSQ summed over bits). Where the
target block has two sources — v, the source block, and q, the block before it (the
interleaved task's answer: v the drawn image, q the text before it) — also the four
self-scores S_qv with 1 = visible, 0 = blinded: S_11 (full), S_10 (v hidden), S_01 (q
hidden), S_00 (both), and the necessity of v, S_11 − S_10. CPU only; nothing is written.
"""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

import torch

from uniweave.algorithms.information_gain import DIRECTIONS
from uniweave.algorithms.necessity import ALL_VIEWS, answer_events, fused_views
from uniweave.config import UniweaveConfig
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.models.base import UnifiedModel
from uniweave.models.build import build_model
from uniweave.train.methods.sft.source import sft_trajectories


@torch.no_grad()
def probe_rows(
    model: UnifiedModel, batch: TrajectoryBatch, chunk: int = 16
) -> list[dict[str, object]]:
    """One record per event of `batch`: ids, direction, blocks, full / blind / gain, and
    for two-source targets s11 / s10 / s01 / s00 — all four views of every event from one
    fused no-grad virtual batch (`uniweave.algorithms.necessity.fused_views`)."""
    events = answer_events(batch)
    views = fused_views(model, batch, events, ALL_VIEWS, chunk)
    s = {v: views.scores[v].tolist() for v in ALL_VIEWS}
    records = []
    for k, e in enumerate(events):
        r: dict[str, object] = {
            "id": batch.sample_ids[e.row],
            "direction": e.direction,
            "source": (e.source.start, e.source.end),
            "target": (e.target.start, e.target.end),
            "full": s["11"][k],
            "blind": s["10"][k],
            "gain": s["11"][k] - s["10"][k],
        }
        if not math.isnan(s["01"][k]):
            r.update(s11=s["11"][k], s10=s["10"][k], s01=s["01"][k], s00=s["00"][k])
        records.append(r)
    return records


def run_probe(cfg: UniweaveConfig, n: int, out: TextIO = sys.stdout) -> list[dict[str, object]]:
    """Build `cfg`'s model on the CPU (`model.path` to probe a trained one), score the
    first `n` val rows per task, print the table and the per-direction means."""
    model = build_model(cfg).to("cpu").eval()
    trajs = sft_trajectories(cfg, model, "val", n)
    records: list[dict[str, Any]] = []
    for start in range(0, len(trajs), 16):
        batch = TrajectoryBatch.collate(trajs[start : start + 16], model.special_ids.pad)
        records += probe_rows(model, batch)
    out.write(f"{'sample':28s} {'direction':15s} {'source':>10s} {'target':>10s} "
              f"{'full':>8s} {'blind':>8s} {'gain':>8s}\n")  # fmt: skip
    for r in records:
        src, tgt = "{}:{}".format(*r["source"]), "{}:{}".format(*r["target"])
        out.write(f"{r['id']:28s} {r['direction']:15s} {src:>10s} {tgt:>10s} "
                  f"{r['full']:8.3f} {r['blind']:8.3f} {r['gain']:8.3f}\n")  # fmt: skip
        if "s11" in r:
            out.write(f"{'':28s} two sources (q = block before v): S11 {r['s11']:.3f}  "
                      f"S10 {r['s10']:.3f}  S01 {r['s01']:.3f}  S00 {r['s00']:.3f}  "
                      f"necessity of v S11-S10 {r['s11'] - r['s10']:.3f}\n")  # fmt: skip
    for d in DIRECTIONS:
        sel = [r for r in records if r["direction"] == d]
        if sel:
            mean = {k: sum(float(r[k]) for r in sel) / len(sel) for k in ("full", "blind", "gain")}
            out.write(f"mean {d:15s} events {len(sel):4d}  full {mean['full']:.3f}  "
                      f"blind {mean['blind']:.3f}  gain {mean['gain']:.3f}\n")  # fmt: skip
    return records
