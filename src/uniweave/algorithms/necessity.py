"""Necessity self-scores in one fused no-grad virtual batch, carriers, and the EMA
Necessity distillation loss (docs/numerics.md §3 "Necessity").

Views. For an event e = (s, t) of `uniweave.algorithms.information_gain` (target block t, its
source block v = s, and q = the block just before s when there is one), a view blinds a
subset of {q, v} for the queries of t with the 2-D key mask of the IG blind view
(`blind_attention_mask`; same tokens, codes and positions, M-RoPE included, since
`model.prepare` derives positions from the key padding only):

    11: nothing blinded (causal)   10: v blinded   01: q blinded   00: q and v blinded

`fused_views` stacks the requested views of every event along the batch (the views of one
event are adjacent rows), runs them `chunk_size` rows per backbone call under
`torch.no_grad` in eval mode, and projects the heads only at the scored positions of t.
Per scored position p of t, ℓ_p(view) = log π(y_p | view) (text: log softmax at the token;
VQ: at the code; BSQ: Σ_f log p(b_f)); per unit S(view) = mean_{p ∈ t} ℓ_p(view).

Necessity of v: N = S_11 − S_10, per position n_p = ℓ_p(11) − ℓ_p(10).

Carriers of a row i (`carriers`): its scored positions with n_p ≥ `min_necessity`
(`selection: min_necessity`), or the ceil(f·n_i) positions of largest n_p among its n_i
(`selection: fraction`, ties to the earlier position).

EMA Necessity distillation (`nd_divergence`, reduced by `trajectory_sum`): per carrier p,
D_p = JSD_β(π_θ(·|s_p, clean) ‖ sg π_θ̄(·|s_p)) (generalised JSD, `core.distributions`;
BSQ: the Bernoulli D_β per factor, averaged over the position's factors), and
L_ND = λ · mean_{i with carriers} mean_{p ∈ C_i} D_p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from uniweave.algorithms.information_gain import (
    Block,
    Event,
    batch_events,
    blind_attention_mask,
    blocks,
)
from uniweave.algorithms.sft import text_ce, visual_ce
from uniweave.core.distributions import bernoulli_jsd, bit_pairs, generalized_jsd
from uniweave.core.dtypes import at_least_fp32_dtype
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.models.base import UnifiedModel

View = Literal["11", "10", "01", "00"]
ALL_VIEWS: tuple[View, ...] = ("11", "10", "01", "00")


def answer_events(batch: TrajectoryBatch, rows: Sequence[int] | None = None) -> list[Event]:
    """Every event (all directions) of `batch`'s rows (or of `rows` only), the scored
    targets being the policy-owned positions t ≥ 1."""
    scored = batch.policy_mask.clone()
    scored[:, 0] = False
    visual = batch.modality == Modality.VISUAL
    per_row = batch_events(visual.cpu(), scored.cpu(), batch.lengths.cpu())
    keep = set(range(len(per_row))) if rows is None else set(rows)
    return [e for r, row in enumerate(per_row) if r in keep for e in row]


def question_block(batch: TrajectoryBatch, e: Event) -> Block | None:
    """q of event e: the block just before its source block, if any."""
    n = int(batch.lengths[e.row])
    visual = (batch.modality[e.row, :n] == Modality.VISUAL).tolist()
    before = [b for b in blocks(visual) if b.end == e.source.start]
    return before[0] if before else None


def hidden_blocks(view: View, e: Event, q: Block | None) -> list[Block] | None:
    """The blocks `view` blinds for event e (None: the view needs a q the event lacks)."""
    if view == "11":
        return []
    if view == "10":
        return [e.source]
    if q is None:
        return None
    return [q] if view == "01" else [q, e.source]


@dataclass
class FusedViews:
    """Output of `fused_views`. Positions: the scored targets of the events in order,
    `pos_event` [P] (index into `events`), `pos_row`, `pos_col` [P]. `logp[view]` [P] the
    per-position log-probs (NaN where the view does not exist for the event: 01/00
    without q), `scores[view]` [E] the per-unit means; `hidden_11` [P, d] the 11-view's
    hidden states that predict each position (kept when asked); `calls` backbone calls."""

    events: list[Event]
    pos_event: torch.Tensor
    pos_row: torch.Tensor
    pos_col: torch.Tensor
    logp: dict[str, torch.Tensor]
    scores: dict[str, torch.Tensor]
    hidden_11: torch.Tensor | None
    calls: int

    def necessity(self) -> torch.Tensor:
        """n_p = ℓ_p(11) − ℓ_p(10) [P]."""
        return self.logp["11"] - self.logp["10"]


@torch.no_grad()
def fused_views(
    model: UnifiedModel,
    batch: TrajectoryBatch,
    events: Sequence[Event],
    views: Sequence[View] = ("11", "10"),
    chunk_size: int = 16,
    keep_hidden: bool = False,
) -> FusedViews:
    """The `views` of every event as one virtual batch (module docstring), `chunk_size`
    view rows per backbone call, in eval mode; the caller's mode is restored."""
    events = list(events)
    dev = model.device
    pos_event = [k for k, e in enumerate(events) for _ in e.targets]
    pos_row = [e.row for e in events for _ in e.targets]
    pos_col = [p for e in events for p in e.targets]
    P = len(pos_col)
    logp: dict[str, torch.Tensor] = {v: torch.full((P,), math.nan, device=dev) for v in views}
    offsets = [0]
    for e in events:
        offsets.append(offsets[-1] + len(e.targets))
    jobs: list[tuple[int, View, list[Block]]] = []
    for k, e in enumerate(events):
        q = question_block(batch, e) if any(v in ("01", "00") for v in views) else None
        for v in views:
            hid = hidden_blocks(v, e, q)
            if hid is not None:
                jobs.append((k, v, hid))
    hidden_11: torch.Tensor | None = None
    calls = 0
    was = model.training
    model.train(False)
    try:
        for start in range(0, len(jobs), chunk_size):
            part = jobs[start : start + chunk_size]
            sub = batch[[events[k].row for k, _, _ in part]]
            T = sub.max_length
            lengths = sub.lengths.tolist()
            masks = torch.stack(
                [
                    blind_attention_mask(lengths[j], T, hid, events[k].target.end)
                    for j, (k, _, hid) in enumerate(part)
                ]
            )
            inputs = model.prepare(sub)
            inputs = replace(inputs, attention_mask=masks.to(inputs.token_ids.device))
            h = model.hidden(inputs).hidden
            calls += 1
            r = torch.tensor([j for j, (k, _, _) in enumerate(part) for _ in events[k].targets])
            c = torch.tensor([p for k, _, _ in part for p in events[k].targets])
            r, c = r.to(h.device), c.to(h.device)
            hp = h[r, c - 1]
            vis = inputs.modality[r, c] == Modality.VISUAL
            values = torch.empty(len(c), device=h.device)
            if bool((~vis).any()):
                tsel = (~vis).nonzero(as_tuple=True)[0]
                tok = inputs.token_ids[r[tsel], c[tsel]]
                values[tsel] = -text_ce(model.text_logits(hp[tsel]), tok).float()
            if bool(vis.any()):
                vsel = vis.nonzero(as_tuple=True)[0]
                codes = inputs.visual_codes[r[vsel], c[vsel]]
                values[vsel] = -visual_ce(model.visual_logits(hp[vsel]), codes).float()
            at = 0
            for k, v, _ in part:
                n = len(events[k].targets)
                logp[v][offsets[k] : offsets[k] + n] = values[at : at + n]
                if v == "11" and keep_hidden:
                    if hidden_11 is None:
                        hidden_11 = hp.new_zeros(P, hp.shape[-1])
                    hidden_11[offsets[k] : offsets[k] + n] = hp[at : at + n]
                at += n
    finally:
        model.train(was)
    index = torch.tensor(pos_event, dtype=torch.long, device=dev)
    counts = torch.tensor([len(e.targets) for e in events], dtype=torch.float32, device=dev)
    scores: dict[str, torch.Tensor] = {
        v: torch.zeros(len(events), device=dev).index_add(0, index, x) / counts
        for v, x in logp.items()
    }
    return FusedViews(
        events=events,
        pos_event=index,
        pos_row=torch.tensor(pos_row, dtype=torch.long, device=dev),
        pos_col=torch.tensor(pos_col, dtype=torch.long, device=dev),
        logp=logp,
        scores=scores,
        hidden_11=hidden_11,
        calls=calls,
    )


def carriers(
    necessity: torch.Tensor,
    rows: torch.Tensor,
    selection: Literal["min_necessity", "fraction"],
    min_necessity: float,
    fraction: float,
) -> torch.Tensor:
    """bool [P]: the carriers among positions with per-position necessity `necessity` [P]
    of rows `rows` [P] (module docstring)."""
    if selection == "min_necessity":
        return necessity >= min_necessity
    if selection != "fraction":
        raise ValueError(f"unknown carrier selection {selection!r}")
    keep = torch.zeros_like(necessity, dtype=torch.bool)
    for r in rows.unique().tolist():
        idx = (rows == r).nonzero(as_tuple=True)[0]
        k = math.ceil(fraction * len(idx))
        order = torch.sort(necessity[idx], descending=True, stable=True).indices
        keep[idx[order[:k]]] = True
    return keep


def nd_text(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """D_p [n] = JSD_β(softmax(z_S) ‖ sg softmax(z_T)) of categorical logits [n, V]
    (float32 at least; float64 stays float64)."""
    dtype = at_least_fp32_dtype(student.dtype)
    logp = torch.log_softmax(student.to(dtype), -1)
    logq = torch.log_softmax(teacher.detach().to(dtype), -1)
    return generalized_jsd(logp, logq, beta)


def nd_bits(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """D_p [n]: the Bernoulli JSD_β per factor of bit logits [n, L], mean over L."""
    dtype = at_least_fp32_dtype(student.dtype)
    pairs_t = bit_pairs(teacher.detach().to(dtype))
    return bernoulli_jsd(bit_pairs(student.to(dtype)), pairs_t, beta)


def trajectory_sum(values: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(Σ_i mean_{p of row i} values_p, number of rows present): the numerator of the
    trajectory-first mean over rows with carriers and its local count."""
    if not len(values):
        return values.new_zeros(()), 0
    uniq, slot = rows.unique(return_inverse=True)
    sums = values.new_zeros(len(uniq)).index_add(0, slot, values)
    counts = values.new_zeros(len(uniq)).index_add(0, slot, torch.ones_like(values))
    return (sums / counts).sum(), len(uniq)


@torch.no_grad()
def rollout_necessity(
    model: UnifiedModel, batch: TrajectoryBatch, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(N_i [B], has_answer [B] bool, backbone calls) of rollout rows: N_i = S_11 − S_10 of row i's answer
    block — its last event's target (v = that event's source block) — from the fused
    11/10 views of the current (behaviour) policy; 0 where a row has no event."""
    per_row: dict[int, Event] = {}
    for e in answer_events(batch):
        per_row[e.row] = e  # events come in position order: the last one wins
    events = [per_row[r] for r in sorted(per_row)]
    views = fused_views(model, batch, events, ("11", "10"), chunk_size)
    n = torch.zeros(len(batch.sample_ids), dtype=torch.float64)
    has = torch.zeros(len(batch.sample_ids), dtype=torch.bool)
    if events:
        gain = (views.scores["11"] - views.scores["10"]).double().cpu()
        rows = torch.tensor([e.row for e in events])
        n[rows] = gain
        has[rows] = True
    return n, has, views.calls


def shaped_rewards(
    rewards: torch.Tensor, necessity: torch.Tensor, weight: float, clip: float
) -> torch.Tensor:
    """r'_i = r_i + λ_IG · clip(N_i, −c, c) (docs/numerics.md §3a, RL IG)."""
    return rewards + weight * necessity.to(rewards).clamp(-clip, clip)
