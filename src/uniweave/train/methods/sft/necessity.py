"""EMA Necessity distillation in SFT (docs/numerics.md §3 "Necessity"): the EMA teacher's
fused 11/10 views, its carriers and teacher logits at them (`teacher_carriers`, no grad),
and the clean student's divergence at the carriers (`nd_terms`, with gradient).

Per micro-batch, every event of every row (`uniweave.algorithms.necessity.answer_events`)
is scored by the EMA shadow θ̄ (swapped into the model, eval mode): n_p = ℓ_p(11) −
ℓ_p(10). The carriers' teacher logits are the heads of θ̄ at the 11 view's hidden states
(projected at the carriers only). The student logits at the carriers come from the SFT
forward when it is clean (no BitFlip noise on any row, no active dropout: its heads are
already projected at every scored position), else from a separate clean eval-mode forward
of the rows that have carriers whose heads are projected at the carriers only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from uniweave.algorithms.necessity import (
    answer_events,
    carriers,
    fused_views,
    nd_bits,
    nd_text,
    trajectory_sum,
)
from uniweave.config.algorithms import NecessityDistillationConfig
from uniweave.core.dtypes import at_least_fp32_dtype
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.forward import ForwardOutput
from uniweave.models.base import UnifiedModel
from uniweave.train.engine.ema import EMA


@dataclass
class Carriers:
    """The EMA teacher's verdict on one micro-batch: carrier rows / cols / visual [C],
    teacher logits at the text and visual carriers, and metric sums."""

    sample_ids: list[str]
    rows: torch.Tensor
    cols: torch.Tensor
    visual: torch.Tensor
    teacher_text: torch.Tensor
    teacher_visual: torch.Tensor
    sums: dict[str, float]

    @property
    def n_rows(self) -> int:
        return len(set(self.rows.tolist()))


@torch.no_grad()
def teacher_carriers(
    model: UnifiedModel, ema: EMA, batch: TrajectoryBatch, cfg: NecessityDistillationConfig
) -> Carriers:
    """Score `batch` with θ̄ (fused 11/10 views) and keep its carriers and teacher logits."""
    events = answer_events(batch)
    with ema.swapped():
        views = fused_views(model, batch, events, ("11", "10"), cfg.chunk_size, keep_hidden=True)
        nec = views.necessity()
        keep = carriers(nec, views.pos_row, cfg.selection, cfg.min_necessity, cfg.carrier_fraction)
        rows, cols = views.pos_row[keep], views.pos_col[keep]
        visual = batch.modality[rows, cols] == Modality.VISUAL
        h = views.hidden_11[keep] if views.hidden_11 is not None else None
        empty = torch.zeros(0, device=model.device)
        was = model.training
        model.train(False)
        try:
            t_logits = (
                model.text_logits(h[~visual]) if h is not None and bool((~visual).any()) else empty
            )
            v_logits = (
                model.visual_logits(h[visual]) if h is not None and bool(visual.any()) else empty
            )
        finally:
            model.train(was)
    sums = {
        "nd/positions": float(len(nec)),
        "nd/carriers": float(keep.sum()),
        "nd/necessity_sum": float(nec.sum()),
        "nd/carrier_necessity_sum": float(nec[keep].sum()),
        "nd/teacher_calls": float(views.calls),
    }
    return Carriers(
        list(batch.sample_ids), rows, cols, visual, t_logits.detach(), v_logits.detach(), sums
    )


def _lookup(index_rows: torch.Tensor, index_cols: torch.Tensor, rows, cols, width: int):
    """Positions of (rows, cols) in a row-major sorted scored index (`scored_indices`)."""
    keys = index_rows * width + index_cols
    want = rows * width + cols
    at = torch.searchsorted(keys, want)
    if len(want) and not bool((keys[at.clamp(max=len(keys) - 1)] == want).all()):
        raise RuntimeError("necessity distillation: a carrier is not a scored position")
    return at


def nd_terms(
    model: UnifiedModel,
    batch: TrajectoryBatch,
    car: Carriers,
    cfg: NecessityDistillationConfig,
    out: ForwardOutput | None,
) -> tuple[torch.Tensor, int, dict[str, float]]:
    """(Σ over rows with carriers of mean_{p ∈ C_i} D_p, their number, metric sums) of one
    micro-batch; `out` is the SFT forward when it is clean (its logits are reused), else
    None (a clean eval-mode forward of the carrier rows is taken)."""
    if list(batch.sample_ids) != car.sample_ids:
        raise RuntimeError("necessity distillation: begin_update scored other micro-batches")
    sums = dict(car.sums)
    sums["nd/student_calls"] = 0.0
    if not len(car.rows):
        zero = torch.zeros((), device=model.device)
        sums["nd/loss_sum"], sums["nd/rows"], sums["nd/divergence_sum"] = 0.0, 0.0, 0.0
        return zero, 0, sums
    tv, vv = ~car.visual, car.visual
    if out is not None:
        width = batch.max_length
        ti = out.text_index
        vi = out.visual_index
        s_text = out.text_logits[_lookup(ti.rows, ti.cols, car.rows[tv], car.cols[tv], width)]
        s_vis = out.visual_logits[_lookup(vi.rows, vi.cols, car.rows[vv], car.cols[vv], width)]
    else:
        used = sorted(set(car.rows.tolist()))
        slot = torch.full((batch.token_ids.shape[0],), -1, dtype=torch.long)
        slot[used] = torch.arange(len(used))
        sub = batch[used]
        was = model.training
        model.train(False)
        try:
            h = model.hidden(model.prepare(sub)).hidden
            r = slot.to(car.rows.device)[car.rows]
            hp = h[r, car.cols - 1]
            s_text = model.text_logits(hp[tv])
            s_vis = model.visual_logits(hp[vv])
        finally:
            model.train(was)
        sums["nd/student_calls"] = 1.0
    dtype = at_least_fp32_dtype(s_text.dtype)
    d = torch.zeros(len(car.rows), device=s_text.device, dtype=dtype)
    if bool(tv.any()):
        d = d.index_put(
            (tv.nonzero(as_tuple=True)[0],), nd_text(s_text, car.teacher_text, cfg.beta)
        )
    if bool(vv.any()):
        bsq = model.visual_head == "bsq"
        fn = nd_bits if bsq else nd_text
        d = d.index_put((vv.nonzero(as_tuple=True)[0],), fn(s_vis, car.teacher_visual, cfg.beta))
    loss_sum, n_rows = trajectory_sum(d, car.rows)
    sums["nd/loss_sum"] = float(loss_sum.detach())
    sums["nd/rows"] = float(n_rows)
    sums["nd/divergence_sum"] = float(d.detach().sum())
    return loss_sum, n_rows, sums


def finalize_nd(sums: dict[str, float]) -> dict[str, float]:
    """`nd/loss` (trajectory-first mean), `nd/rows`, `nd/carrier_share` (carriers over
    scored event positions), `nd/necessity` (mean n_p over positions),
    `nd/carrier_necessity`, `nd/divergence` (mean D_p over carriers), and the backbone
    calls (`nd/teacher_calls`, `nd/student_calls`)."""
    pos, car = sums.get("nd/positions", 0.0), sums.get("nd/carriers", 0.0)
    return {
        "nd/loss": sums.get("nd/loss_sum", 0.0) / max(sums.get("nd/rows", 0.0), 1.0),
        "nd/rows": sums.get("nd/rows", 0.0),
        "nd/carriers": car,
        "nd/carrier_share": car / max(pos, 1.0),
        "nd/necessity": sums.get("nd/necessity_sum", 0.0) / max(pos, 1.0),
        "nd/carrier_necessity": sums.get("nd/carrier_necessity_sum", 0.0) / max(car, 1.0),
        "nd/divergence": sums.get("nd/divergence_sum", 0.0) / max(car, 1.0),
        "nd/teacher_calls": sums.get("nd/teacher_calls", 0.0),
        "nd/student_calls": sums.get("nd/student_calls", 0.0),
    }
