"""On-policy distillation numerics (docs/numerics.md §9, §7).

Per scored position t, student distribution p = π_S(·|s_t) (differentiable) and teacher
distribution q = π_T(·|s'_t) (a constant), both at the sampling temperature τ (the
distribution objects of the replay apply it: log softmax(z / τ), Bernoulli σ(z / τ_bits)):

- Generalised JSD (TRL GKD), `generalized_jsd`:
      m = (1 − β)·p + β·q,   D_β = β·KL(q ‖ m) + (1 − β)·KL(p ‖ m),
  with the endpoints the plain KLs: β = 0 → KL(q ‖ p) (forward, teacher-weighted),
  β = 1 → KL(p ‖ q) (reverse, mode-seeking). Computed a block of rows at a time with an
  analytic gradient in log p (entries treated as independent, the chain rule through
  log_softmax / the top-K gather does the rest):
      0 < β < 1:  ∂D/∂log p_k = (1 − β)·p_k·log(p_k / m_k)
      β = 0:      ∂D/∂log p_k = −q_k
      β = 1:      ∂D/∂log p_k = p_k·(log p_k − log q_k + 1)
- BSQ (`uniweave.core.distributions.bernoulli_jsd` of `bit_pairs`): D_β per factor f on
  the pair (σ(z_f), 1 − σ(z_f)), then the mean over the L factors of the position (a
  visual position weighs like one token).
- Top-K union (`union_with_tail`): U_t = topK(q) ∪ topK(p); D_β over the |U_t| ids plus one
  tail category holding each distribution's remaining mass (exact when U_t covers the
  vocabulary). Merging categories never increases an f-divergence, and for 0 < β < 1
      0 ≤ D_full − D_union ≤ β·Q_tail·log(1/β) + (1 − β)·P_tail·log(1/(1 − β))
  (`union_bound`; Q_tail, P_tail = the teacher's and student's mass outside U_t). Where the
  teacher keeps less than `retained_mass_min` inside U_t the position falls back to the
  full vocabulary (`categorical_divergence`, counted in `fallback`).
- Events and the trajectory-first reduction (`event_index`, `trajectory_first`): per
  trajectory i with events E_i, D_i = mean_{e ∈ E_i} mean_{t ∈ e} w_{mod(t)}·D_t; the loss
  is the mean of D_i over contributing trajectories (those with at least one event), so a
  trajectory with more events does not weigh more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from uniweave.core.distributions import generalized_jsd
from uniweave.core.dtypes import at_least_fp32
from uniweave.core.types import Modality

COMPLETE_REASONS = frozenset({"eos", "length_exact"})
EVENT_MODES = ("first_complete_window", "all_complete_transitions")


def tempered_logp(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(z / τ) over the last dim (float32 at least)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = at_least_fp32(logits)
    return torch.log_softmax(z / temperature, -1)


# -- top-K union with a tail category ----------------------------------------------------


def _tail(logp_full: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """log of the mass outside the kept ids: logsumexp of the full log-probs with the kept
    ids masked out (exact, and its gradient reaches every tail id)."""
    return torch.logsumexp(logp_full.masked_fill(keep, -math.inf), -1)


def union_with_tail(
    logp: torch.Tensor, logq: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(student [n, 2k + 1], teacher [n, 2k + 1], teacher retained mass [n]) on
    U = topK(q) ∪ topK(p) plus a tail category (last column). Ids in both top-Ks appear
    once (the duplicate column carries zero mass in both)."""
    V = logp.shape[-1]
    k = min(k, V)
    ids = torch.cat([logq.topk(k, -1).indices, logp.topk(k, -1).indices], -1)
    ids, _ = ids.sort(-1)
    dup = torch.zeros_like(ids, dtype=torch.bool)
    dup[:, 1:] = ids[:, 1:] == ids[:, :-1]
    keep = torch.zeros_like(logp, dtype=torch.bool).scatter_(-1, ids, True)
    ps = logp.gather(-1, ids).masked_fill(dup, -math.inf)
    qs = logq.gather(-1, ids).masked_fill(dup, -math.inf)
    ps = torch.cat([ps, _tail(logp, keep)[:, None]], -1)
    qs = torch.cat([qs, _tail(logq, keep)[:, None]], -1)
    retained = torch.logsumexp(qs[:, :-1], -1).exp()
    return ps, qs, retained


def union_bound(p_tail: torch.Tensor, q_tail: torch.Tensor, beta: float) -> torch.Tensor:
    """Upper bound of D_full − D_union (module docstring), 0 < β < 1."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"the top-K bound holds for 0 < beta < 1, got {beta}")
    return beta * q_tail * math.log(1.0 / beta) + (1.0 - beta) * p_tail * math.log(
        1.0 / (1.0 - beta)
    )


@dataclass
class PositionDivergence:
    """Per position [n]: D_β, teacher mass retained by the scoring support (1 on the full
    vocabulary), whether the retained-mass guard fell back to the full vocabulary, and
    whether student and teacher agree on the top-1 id."""

    jsd: torch.Tensor
    retained: torch.Tensor
    fallback: torch.Tensor
    agree: torch.Tensor


def categorical_divergence(
    logp: torch.Tensor,
    logq: torch.Tensor,
    beta: float,
    top_k: int = 0,
    retained_mass_min: float = 0.0,
) -> PositionDivergence:
    """D_β per position of categorical log-probs [n, V]: on the full vocabulary
    (`top_k` = 0) or on the top-K union with a tail, falling back to the full vocabulary
    where the teacher's retained mass is below `retained_mass_min`."""
    with torch.no_grad():
        agree = (logp.argmax(-1) == logq.argmax(-1)).to(logp.dtype)
    if top_k <= 0 or top_k >= logp.shape[-1]:
        ones = torch.ones_like(agree)
        return PositionDivergence(
            generalized_jsd(logp, logq, beta), ones, torch.zeros_like(agree), agree
        )
    ps, qs, retained = union_with_tail(logp, logq, top_k)
    fallback = retained < retained_mass_min
    jsd = generalized_jsd(ps, qs, beta)
    if bool(fallback.any()):
        rows = fallback.nonzero(as_tuple=True)[0]
        full = generalized_jsd(logp[rows], logq[rows], beta)
        jsd = jsd.index_put((rows,), full)
    return PositionDivergence(jsd, retained.detach(), fallback.to(logp.dtype), agree)


# -- events and the trajectory-first reduction -------------------------------------------


@dataclass
class Events:
    """Per position [B, T]: the event number within its row (−1 = not in an event); per
    row: the event kinds ("text" | "visual" | "window") in order."""

    index: torch.Tensor
    kinds: list[list[str]]

    @property
    def n_events(self) -> torch.Tensor:
        return torch.tensor([len(k) for k in self.kinds], dtype=torch.long)


def _segments(scored: list[int], visual: list[bool]) -> list[tuple[str, list[int]]]:
    """Maximal runs of scored positions of one modality, in order: (kind, positions)."""
    out: list[tuple[str, list[int]]] = []
    for t in scored:
        kind = "visual" if visual[t] else "text"
        if out and out[-1][0] == kind:
            out[-1][1].append(t)
        else:
            out.append((kind, [t]))
    return out


def row_events(
    scored: list[int], visual: list[bool], finish_reason: str | None, mode: str
) -> list[tuple[str, list[int]]]:
    """The events of one row. Its scored positions split into segments (maximal runs of
    one modality: each starts at a prompt→response, text→visual or visual→text
    transition); a segment is complete unless it is the row's last and the row did not
    end by eos or an exact length (a capped, cycling, context-limited or invalid row:
    its last segment is cut). `all_complete_transitions`: every complete segment is one
    event. `first_complete_window`: one event, the first complete generated image and the
    complete text segment right after it ("window"); a row that draws no complete image
    has as its window its first complete segment."""
    if mode not in EVENT_MODES:
        raise ValueError(f"events must be one of {EVENT_MODES}, got {mode!r}")
    segs = _segments(scored, visual)
    if segs and finish_reason is not None and finish_reason not in COMPLETE_REASONS:
        segs = segs[:-1]
    if mode == "all_complete_transitions":
        return segs
    for j, (kind, pos) in enumerate(segs):
        if kind == "visual":
            after = segs[j + 1][1] if j + 1 < len(segs) else []
            return [("window", pos + after)]
    return [("window", segs[0][1])] if segs else []


def event_index(
    scored: torch.Tensor, modality: torch.Tensor, finish_reasons: list, mode: str
) -> Events:
    """`Events` of a batch from its scored mask [B, T], modality [B, T] and finish reasons."""
    index = torch.full(scored.shape, -1, dtype=torch.long)
    kinds: list[list[str]] = []
    vis = (modality == Modality.VISUAL).cpu()
    for b in range(scored.shape[0]):
        pos = scored[b].nonzero(as_tuple=True)[0].tolist()
        events = row_events(pos, vis[b].tolist(), finish_reasons[b], mode)
        for e, (_, ts) in enumerate(events):
            index[b, ts] = e
        kinds.append([k for k, _ in events])
    return Events(index.to(scored.device), kinds)


def restrict_events(events: Events, keep: torch.Tensor) -> Events:
    """`events` with only the positions of `keep` [B, T] (bool): positions outside it
    leave their event, events left empty are dropped and the rest renumbered in order
    (OPD `carriers: necessity`)."""
    index = events.index.clone()
    index[~keep.to(index.device)] = -1
    kinds: list[list[str]] = []
    for b, row_kinds in enumerate(events.kinds):
        present = sorted(set(index[b][index[b] >= 0].tolist()))
        new = torch.full((len(row_kinds) + 1,), -1, dtype=torch.long, device=index.device)
        for j, e in enumerate(present):
            new[e] = j
        index[b] = torch.where(index[b] >= 0, new[index[b].clamp_min(0)], index[b])
        kinds.append([row_kinds[e] for e in present])
    return Events(index, kinds)


def trajectory_first(values: torch.Tensor, events: Events) -> tuple[torch.Tensor, torch.Tensor]:
    """(D_i per row [B], event means [B, E_max]) of per-position values [B, T] (already
    weighted): D_i = mean over the row's events of the event's position mean (0 for a
    row without events)."""
    B = values.shape[0]
    n_ev = events.n_events.to(values.device)
    E = max(int(n_ev.max()) if B else 0, 1)
    inside = events.index >= 0
    rows = torch.arange(B, device=values.device)[:, None].expand_as(values)[inside]
    flat = rows * E + events.index[inside]
    sums = values.new_zeros(B * E).index_add(0, flat, values[inside])
    counts = values.new_zeros(B * E).index_add(0, flat, torch.ones_like(values[inside]))
    means = (sums / counts.clamp_min(1.0)).view(B, E)
    per_row = means.sum(-1) / n_ev.clamp_min(1).to(values.dtype)
    return per_row, means


def clip_text_contribution(
    values: torch.Tensor, visual: torch.Tensor, events: Events, bound: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Text contribution clipping (docs/numerics.md §9) of per-position values [B, T]
    (already weighted). `trajectory_first` is linear in the values, so a row's
    D_i = V_i + T_i, with V_i / T_i the reduction of its visual / text positions alone
    (each event still divided by all of its positions). The text part becomes
    T_i·s_i, s_i = min(1, c / sg(T_i)): at most c, its gradient scaled by s_i, the
    visual part untouched. Returns (clipped D_i [B], T_i [B], s_i [B], detached)."""
    v_part, _ = trajectory_first(values * visual.to(values), events)
    t_part, _ = trajectory_first(values * (~visual).to(values), events)
    tiny = torch.finfo(t_part.dtype).tiny
    scale = (bound / t_part.detach().clamp_min(tiny)).clamp(max=1.0)
    return v_part + t_part * scale, t_part, scale
