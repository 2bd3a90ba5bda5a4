"""Information Gain views on a model: full scores from the SFT forward, detached blind
views in chunks, the per-micro-batch IG loss numerator and its metric sums.

Model-agnostic: the blind view is `model.prepare(batch)` (positions from the key-padding
mask, so every view reuses the full positions, M-RoPE included) with its attention mask
replaced by a bool query × key mask [B, T, T] (`UnifiedModel.hidden`, `run_decoder`); the
tiny model's conv mixers obey the same mask (`models.tiny.mixer.mixer_taps`). Heads are
applied only at the events' target positions. Blind views run in eval mode (no dropout)
under `torch.no_grad`, on clean input codes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from uniweave.algorithms.information_gain import (
    DIRECTIONS,
    SATURATION_HIGH,
    SATURATION_LOW,
    Block,
    Event,
    batch_events,
    blind_attention_mask,
    direction_weights,
    event_losses,
    select_events,
    trajectory_sum,
    unit_scores,
)
from uniweave.algorithms.sft import text_ce, visual_ce
from uniweave.config.algorithms import InformationGainConfig
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.forward import ForwardOutput, forward_interleaved
from uniweave.models.base import UnifiedModel

STAT_KEYS = ("full", "blind", "gain", "margin", "gate", "gate_low", "gate_high", "events")


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) inside the block, its previous mode after."""
    was = model.training
    model.train(False)
    try:
        yield
    finally:
        model.train(was)


def weights_of(cfg: InformationGainConfig) -> dict[str, float]:
    """{direction: w_dir}."""
    return {
        "text_to_visual": cfg.text_to_visual_weight,
        "visual_to_text": cfg.visual_to_text_weight,
    }


def scored_events(
    batch: TrajectoryBatch,
    cfg: InformationGainConfig,
    cycle: int,
    rows: Sequence[int] | None = None,
) -> list[Event]:
    """The selected events of every row of `batch` (or of `rows` only: BitFlip
    `partition: half` scores the clean rows) (`event_selection`, cycle index) in the
    directions whose weight is not 0 (a direction weighted 0 is not scored at all: no
    blind views, no metrics, its rows do not count as contributing)."""
    scored = batch.policy_mask.clone()
    scored[:, 0] = False
    visual = batch.modality == Modality.VISUAL
    per_row = batch_events(visual.cpu(), scored.cpu(), batch.lengths.cpu())
    if rows is not None:
        keep = set(rows)
        per_row = [row if r in keep else [] for r, row in enumerate(per_row)]
    weights = weights_of(cfg)
    kept = [[e for e in row if weights[e.direction] > 0] for row in per_row]
    return [e for row in kept for e in select_events(row, cfg.event_selection, cycle)]


def full_logp(out: ForwardOutput, text_ce_pos: torch.Tensor, visual_ce_pos: torch.Tensor):
    """[B, T] per-position log-probs of the scored targets of a forward (−CE; 0 elsewhere)."""
    B, T = out.visual_mask.shape
    dtype = text_ce_pos.dtype
    logp = torch.zeros(B, T, dtype=dtype, device=text_ce_pos.device)
    logp = logp.index_put((out.text_index.rows, out.text_index.cols), -text_ce_pos)
    return logp.index_put((out.visual_index.rows, out.visual_index.cols), -visual_ce_pos.to(dtype))


def source_blocks(event: Event) -> list[Block]:
    """The blind view of an event hides its source block."""
    return [event.source]


@torch.no_grad()
def blind_scores(
    model: UnifiedModel,
    batch: TrajectoryBatch,
    events: Sequence[Event],
    chunk_size: int,
    hidden_blocks: Callable[[Event], list[Block]] = source_blocks,
) -> tuple[torch.Tensor, int]:
    """(S_blind [E] detached, number of forwards): the events' views with
    `hidden_blocks(e)` blinded, `chunk_size` views per forward (a virtual batch of the
    events' rows, each with its own query × key mask)."""
    if not events:
        return torch.zeros(0, device=model.device), 0
    scores, calls = [], 0
    with eval_mode(model):
        for start in range(0, len(events), chunk_size):
            part = list(events[start : start + chunk_size])
            scores.append(_view_scores(model, batch, part, hidden_blocks))
            calls += 1
    return torch.cat(scores), calls


def _view_scores(
    model: UnifiedModel,
    batch: TrajectoryBatch,
    events: list[Event],
    hidden_blocks: Callable[[Event], list[Block]],
) -> torch.Tensor:
    rows = [e.row for e in events]
    sub = batch[rows]
    T = sub.max_length
    lengths = sub.lengths.tolist()
    masks = torch.stack(
        [
            blind_attention_mask(lengths[j], T, hidden_blocks(e), e.target.end)
            for j, e in enumerate(events)
        ]
    )
    inputs = model.prepare(sub)
    inputs = replace(inputs, attention_mask=masks.to(inputs.token_ids.device))
    hidden = model.hidden(inputs).hidden
    local = [replace(e, row=j) for j, e in enumerate(events)]
    logp = torch.zeros(len(events), T, device=hidden.device)
    for visual in (False, True):
        chosen = [e for e in local if e.target.visual == visual]
        if not chosen:
            continue
        r = torch.tensor([e.row for e in chosen for _ in e.targets], device=hidden.device)
        c = torch.tensor([p for e in chosen for p in e.targets], device=hidden.device)
        h = hidden[r, c - 1]
        if visual:
            codes = inputs.visual_codes[r, c]
            values = -visual_ce(model.visual_logits(h), codes)
        else:
            values = -text_ce(model.text_logits(h), inputs.token_ids[r, c])
        logp = logp.index_put((r, c), values.float())
    return unit_scores(logp, local)


@dataclass
class IGTerms:
    """One micro-batch's IG: Σ over contributing rows of mean_e w·ℓ_e (with gradient),
    their number, additive metric sums, and the scored events with their detached
    per-event values (`full`, `blind`, `gain`, `margin`, `gate` [E])."""

    loss_sum: torch.Tensor
    n_rows: int
    sums: dict[str, float]
    events: list[Event] = field(default_factory=list)
    per_event: dict[str, torch.Tensor] = field(default_factory=dict)


def ig_terms(
    model: UnifiedModel,
    batch: TrajectoryBatch,
    logp: torch.Tensor,
    cfg: InformationGainConfig,
    cycle: int,
    rows: Sequence[int] | None = None,
) -> IGTerms:
    """The IG terms of `batch` (or of its `rows` only) whose full-view per-position
    log-probs are `logp` [B, T] (clean inputs, no dropout; with gradient; only the
    scored rows' values are read), at cycle index `cycle`."""
    events = scored_events(batch, cfg, cycle, rows)
    full = unit_scores(logp, events)
    blind, calls = blind_scores(model, batch, events, cfg.blind_view_chunk_size)
    el = event_losses(full, blind.to(full.dtype), cfg.formulation, cfg.temperature, cfg.eps)
    weights = direction_weights(events, weights_of(cfg))
    loss_sum, n_rows = trajectory_sum(el.loss, events, weights)
    sums = event_sums(events, full.detach(), blind, el.margin, el.gate)
    sums.update({"ig/loss_sum": float(loss_sum.detach()), "ig/rows": float(n_rows)})
    sums["ig/blind_calls"] = float(calls)
    f, b = full.detach(), blind.to(full.dtype)
    per_event = {"full": f, "blind": b, "gain": f - b, "margin": el.margin, "gate": el.gate}
    return IGTerms(loss_sum, n_rows, sums, events, per_event)


def event_sums(
    events: Sequence[Event],
    full: torch.Tensor,
    blind: torch.Tensor,
    margin: torch.Tensor,
    gate: torch.Tensor,
) -> dict[str, float]:
    """Per direction d, sums over its events: `ig/d/{full,blind,gain,margin,gate}_sum`,
    `ig/d/gate_low` (gate < 0.05), `ig/d/gate_high` (> 0.95), `ig/d/events`."""
    out: dict[str, float] = {}
    for d in DIRECTIONS:
        sel = torch.tensor([e.direction == d for e in events], dtype=torch.bool)
        sel = sel.to(full.device)
        f, b, m, g = (x[sel].float() for x in (full, blind, margin, gate))
        out[f"ig/{d}/full_sum"] = float(f.sum())
        out[f"ig/{d}/blind_sum"] = float(b.sum())
        out[f"ig/{d}/gain_sum"] = float((f - b).sum())
        out[f"ig/{d}/margin_sum"] = float(m.sum())
        out[f"ig/{d}/gate_sum"] = float(g.sum())
        out[f"ig/{d}/gate_low"] = float((g < SATURATION_LOW).sum())
        out[f"ig/{d}/gate_high"] = float((g > SATURATION_HIGH).sum())
        out[f"ig/{d}/events"] = float(sel.sum())
    return out


def finalize_sums(sums: dict[str, float]) -> dict[str, float]:
    """Means of the summed IG statistics: per direction `full`, `blind`, `gain`,
    `margin`, `gate` (means over events), `saturation` (share of events with gate < 0.05
    or > 0.95), `gate_low`/`gate_high` shares, `events`; and `ig/loss` (trajectory-first),
    `ig/rows`, `ig/blind_calls` and, in training, `ig/full_calls` (backbone forwards
    taken for the full view apart from the SFT forward: 0 when it is shared)."""
    out: dict[str, float] = {}
    for d in DIRECTIONS:
        n = sums.get(f"ig/{d}/events", 0.0)
        per = max(n, 1.0)
        for k in ("full", "blind", "gain", "margin", "gate"):
            out[f"ig/{d}/{k}"] = sums.get(f"ig/{d}/{k}_sum", 0.0) / per
        low, high = sums.get(f"ig/{d}/gate_low", 0.0), sums.get(f"ig/{d}/gate_high", 0.0)
        out[f"ig/{d}/gate_low"] = low / per
        out[f"ig/{d}/gate_high"] = high / per
        out[f"ig/{d}/saturation"] = (low + high) / per
        out[f"ig/{d}/events"] = n
    out["ig/loss"] = sums.get("ig/loss_sum", 0.0) / max(sums.get("ig/rows", 0.0), 1.0)
    out["ig/rows"] = sums.get("ig/rows", 0.0)
    out["ig/blind_calls"] = sums.get("ig/blind_calls", 0.0)
    if "ig/full_calls" in sums:
        out["ig/full_calls"] = sums["ig/full_calls"]
    return out


def contributing_rows(
    batch: TrajectoryBatch,
    cfg: InformationGainConfig,
    cycle: int,
    rows: Sequence[int] | None = None,
) -> int:
    """Rows of `batch` (of `rows`) with at least one selected event (the
    trajectory-first count)."""
    return len({e.row for e in scored_events(batch, cfg, cycle, rows)})


QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
"""The quantiles of every IG validation distribution (linear interpolation between order
statistics, numpy's default), named p00, p05, ..., p100."""
EVENT_VALUES = ("full", "blind", "gain", "margin", "gate")


@torch.no_grad()
def ig_evaluation(
    model: UnifiedModel,
    trajs: Sequence[Trajectory],
    cfg: InformationGainConfig,
    pad_id: int,
    batch_size: int = 32,
    cycle: int = 0,
) -> tuple[dict[str, float], dict]:
    """IG validation of fixed rows in eval mode, the cycle index pinned: (metrics, report).
    metrics: the means of `finalize_sums` and the scalars of the distributions
    (`distribution_scalars`); report: `ig_distributions` of the per-event values, which
    it also lists (one record per event: val row, sample id, direction, full, blind,
    gain, margin, gate)."""
    sums: dict[str, float] = {}
    records: list[dict] = []
    with eval_mode(model):
        for start in range(0, len(trajs), batch_size):
            batch = TrajectoryBatch.collate(trajs[start : start + batch_size], pad_id)
            batch = batch.to(model.device)
            out = forward_interleaved(model, batch)
            text = text_ce(out.text_logits, out.text_targets)
            logp = full_logp(out, text, visual_ce(out.visual_logits, out.visual_targets))
            terms = ig_terms(model, batch, logp, cfg, cycle)
            for k, v in terms.sums.items():
                sums[k] = sums.get(k, 0.0) + v
            values = {k: terms.per_event[k].double().cpu().tolist() for k in EVENT_VALUES}
            for j, e in enumerate(terms.events):
                records.append(
                    {
                        "row": start + e.row,
                        "sample_id": batch.sample_ids[e.row],
                        "direction": e.direction,
                        **{k: values[k][j] for k in EVENT_VALUES},
                    }
                )
    report = ig_distributions(records, cycle)
    return {**finalize_sums(sums), **distribution_scalars(report)}, report


def _summary(values: Sequence[float]) -> dict:
    """{n, mean, p00 .. p100} of `values` (float64; None for an empty set)."""
    if not values:
        return {"n": 0, "mean": None, **{_qname(q): None for q in QUANTILES}}
    t = torch.tensor(values, dtype=torch.float64)
    qs = torch.quantile(t, torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    return {"n": len(values), "mean": float(t.mean()), **dict(zip(map(_qname, QUANTILES), qs))}


def _qname(q: float) -> str:
    return f"p{round(q * 100):02d}"


def ig_distributions(records: Sequence[dict], cycle: int) -> dict:
    """The IG validation report of per-event records (`ig_evaluation`), per direction and
    over both ("all"):
    - `gain`: the absolute gain g_e = S_full − S_blind of every event;
    - `trajectory_gain`: per val row, the mean g_e over its events (of the direction), one
      value per row — its `mean` is the trajectory-balanced gain (each row weighs the same
      however many events it has);
    - `margin`: the relative margin g_e / (|S_blind| + ε); `gate`: σ(−m_e/τ);
    - `saturation`: shares of events with gate < 0.05 (`low`), > 0.95 (`high`), either
      (`total`);
    each distribution as {n, mean, p00, p05, p25, p50, p75, p95, p100} (`QUANTILES`);
    and `cycle_index`, the pinned event cycle index."""
    groups: dict[str, dict] = {}
    for name in (*DIRECTIONS, "all"):
        chosen = [r for r in records if name in ("all", r["direction"])]
        per_row: dict[int, list[float]] = {}
        for r in chosen:
            per_row.setdefault(r["row"], []).append(r["gain"])
        gates = [r["gate"] for r in chosen]
        n = len(gates)
        low = sum(g < SATURATION_LOW for g in gates)
        high = sum(g > SATURATION_HIGH for g in gates)
        groups[name] = {
            "events": n,
            "rows": len(per_row),
            "gain": _summary([r["gain"] for r in chosen]),
            "trajectory_gain": _summary([sum(v) / len(v) for _, v in sorted(per_row.items())]),
            "margin": _summary([r["margin"] for r in chosen]),
            "gate": _summary(gates),
            "saturation": {
                "low": low / n if n else None,
                "high": high / n if n else None,
                "total": (low + high) / n if n else None,
            },
        }
    return {"cycle_index": int(cycle), "groups": groups, "events": list(records)}


def distribution_scalars(report: dict) -> dict[str, float]:
    """`ig/<group>/<dist>_<stat>` for every non-empty distribution of an `ig_distributions`
    report (stat: mean, p00 .. p100), `ig/<group>/saturation_{low,high,total}` and
    `ig/cycle_index`: the report's figures as TensorBoard scalars."""
    out = {"ig/cycle_index": float(report["cycle_index"])}
    for name, group in report["groups"].items():
        for dist in ("gain", "trajectory_gain", "margin", "gate"):
            for stat, v in group[dist].items():
                if stat != "n" and v is not None:
                    out[f"ig/{name}/{dist}_{stat}"] = float(v)
        for stat, v in group["saturation"].items():
            if v is not None:
                out[f"ig/{name}/saturation_{stat}"] = float(v)
    return out
