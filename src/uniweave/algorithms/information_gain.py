"""Information Gain (IG) in SFT: pure numerics (docs/numerics.md §3).

A trajectory is a sequence of maximal blocks of one modality. An *event* e = (s, t) is a
pair of adjacent blocks (so with a modality change) whose target block t holds supervised
(policy-owned, scored) positions; its direction is text→visual or visual→text.

Views. The full view is the ordinary causal forward. The blind view of e keeps the same
tokens, codes and positions and changes only the attention mask: every query from the
last position of s through the end of t loses the keys of s (`blind_attention_mask`).
Position s_end is included because, with targets shifted by one, the hidden state at
s_end predicts t's first token; it keeps its own key (its own token is in the residual
stream anyway: `<|vision_start|>` for text→visual, the last code before the unscored
`<|vision_end|>` for visual→text), nothing else of s. Queries between s and t are blinded
too, so no representation a blinded query reads carries s (exact at every layer: the
positions it reads precede s or are themselves blinded).

Score per unit, with ℓ_p the log-prob of target p (text: log softmax at the token; VQ:
log softmax at the code; BSQ: Σ_f log p(b_f), the sum over the L factors):
    S(e) = mean_{p ∈ t, p scored} ℓ_p

Gain and losses (sg = stop-gradient; the blind view is always detached):
    g_e = S_full(e) − sg(S_blind(e))
    absolute:           ℓ_e = −g_e
    relative_per_unit:  m_e = g_e / (|sg(S_blind(e))| + ε),  ℓ_e = τ·softplus(−m_e/τ)
                        gate_e = σ(−m_e/τ) = −∂ℓ_e/∂m_e ∈ (0, 1)
Trajectory-first reduction with direction weights w_dir:
    L_IG = mean_{i contributing} mean_{e ∈ E_i} w_dir(e)·ℓ_e
(a trajectory with more events does not weigh more). Saturation = share of events with
gate < 0.05 or > 0.95.

Event selection: `all` keeps every event; `cycle` keeps one event per trajectory and
direction, the (c mod n)-th of its n events of that direction for a cycle index c
(the update number in training; validation pins it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Direction = Literal["text_to_visual", "visual_to_text"]
DIRECTIONS: tuple[Direction, ...] = ("text_to_visual", "visual_to_text")
Formulation = Literal["absolute", "relative_per_unit"]
SATURATION_LOW, SATURATION_HIGH = 0.05, 0.95


@dataclass(frozen=True)
class Block:
    """Positions [start, end) of one maximal run of one modality (`visual` or not)."""

    start: int
    end: int
    visual: bool


@dataclass(frozen=True)
class Event:
    """Adjacent blocks source → target of row `row`; `targets` are the scored positions of
    the target block (the positions whose log-probs make its score)."""

    row: int
    source: Block
    target: Block
    targets: tuple[int, ...]

    @property
    def direction(self) -> Direction:
        return "visual_to_text" if self.source.visual else "text_to_visual"


def blocks(visual: Sequence[bool]) -> list[Block]:
    """Maximal runs of one modality of a row's real positions (`visual[p]` per position)."""
    out: list[Block] = []
    start = 0
    for p in range(1, len(visual) + 1):
        if p == len(visual) or visual[p] != visual[start]:
            out.append(Block(start, p, bool(visual[start])))
            start = p
    return out


def row_events(row: int, visual: Sequence[bool], scored: Sequence[bool]) -> list[Event]:
    """Events of one row: adjacent blocks whose target holds scored positions (position 0
    is never scored)."""
    bl = blocks(visual)
    out = []
    for s, t in zip(bl, bl[1:]):
        targets = tuple(p for p in range(t.start, t.end) if scored[p] and p > 0)
        if targets:
            out.append(Event(row, s, t, targets))
    return out


def batch_events(
    visual: torch.Tensor, scored: torch.Tensor, lengths: torch.Tensor
) -> list[list[Event]]:
    """Events of every row of a right-padded batch (bool [B, T] masks, lengths [B])."""
    vis, sc, n = visual.tolist(), scored.tolist(), lengths.tolist()
    return [row_events(r, vis[r][: n[r]], sc[r][: n[r]]) for r in range(len(n))]


def select_events(
    events: Sequence[Event], mode: Literal["cycle", "all"], cycle_index: int
) -> list[Event]:
    """`all`: every event; `cycle`: per direction, event (cycle_index mod n) of the row's
    n events of that direction (module docstring)."""
    if mode == "all":
        return list(events)
    out = []
    for d in DIRECTIONS:
        of_d = [e for e in events if e.direction == d]
        if of_d:
            out.append(of_d[cycle_index % len(of_d)])
    return sorted(out, key=lambda e: e.target.start)


def blind_attention_mask(
    length: int, n_columns: int, blinded: Sequence[Block], query_end: int
) -> torch.Tensor:
    """bool [n_columns, n_columns] query × key mask of one row of real length `length`
    (right padding to `n_columns`): causal over real keys, and for every blinded block
    b, queries b.end − 1 .. query_end − 1 lose b's keys except their own. Every query
    keeps its own key, so no row of the mask is empty (padding queries attend to
    themselves only)."""
    idx = torch.arange(n_columns)
    mask = (idx[None, :] <= idx[:, None]) & (idx[None, :] < length)
    for b in blinded:
        mask[b.end - 1 : query_end, b.start : b.end] = False
    mask[idx, idx] = True
    return mask


def unit_scores(logp: torch.Tensor, events: Sequence[Event]) -> torch.Tensor:
    """S(e) [E] = mean over e's target positions of `logp` [B, T] (per-position log-probs,
    BSQ already summed over factors)."""
    if not events:
        return logp.new_zeros(0)
    rows = torch.tensor([e.row for e in events for _ in e.targets], device=logp.device)
    cols = torch.tensor([p for e in events for p in e.targets], device=logp.device)
    which = torch.tensor([k for k, e in enumerate(events) for _ in e.targets], device=logp.device)
    sums = logp.new_zeros(len(events)).index_add(0, which, logp[rows, cols])
    counts = torch.tensor([len(e.targets) for e in events], device=logp.device)
    return sums / counts.to(logp.dtype)


@dataclass
class EventLosses:
    """Per-event gains, margins, gates and losses [E] (module docstring)."""

    gain: torch.Tensor
    margin: torch.Tensor
    gate: torch.Tensor
    loss: torch.Tensor


def event_losses(
    full: torch.Tensor,
    blind: torch.Tensor,
    formulation: Formulation,
    temperature: float,
    eps: float,
) -> EventLosses:
    """g = S_full − sg(S_blind); `absolute`: ℓ = −g; `relative_per_unit`: m = g / (|sg(S_blind)|
    + ε), ℓ = τ·softplus(−m/τ), gate = σ(−m/τ). Margins and gates are returned for both
    formulations (detached; the absolute loss has slope 1 in g)."""
    blind = blind.detach()
    gain = full - blind
    margin = gain / (blind.abs() + eps)
    gate = torch.sigmoid(-margin.detach() / temperature)
    if formulation == "absolute":
        loss = -gain
    elif formulation == "relative_per_unit":
        loss = temperature * F.softplus(-margin / temperature)
    else:
        raise ValueError(f"unknown information-gain formulation {formulation!r}")
    return EventLosses(gain=gain, margin=margin.detach(), gate=gate, loss=loss)


def direction_weights(events: Sequence[Event], weights: dict[str, float]) -> torch.Tensor:
    """w_dir(e) [E] from {direction: weight}."""
    return torch.tensor([weights[e.direction] for e in events], dtype=torch.float32)


def trajectory_sum(
    loss: torch.Tensor, events: Sequence[Event], weights: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(Σ_i mean_{e ∈ E_i} w_dir(e)·ℓ_e over the rows that have events, their number): the
    numerator of the trajectory-first mean and its local count of contributing rows."""
    if not events:
        return loss.new_zeros(()), 0
    rows = sorted({e.row for e in events})
    slot = {r: k for k, r in enumerate(rows)}
    which = torch.tensor([slot[e.row] for e in events], device=loss.device)
    weighted = weights.to(loss.device, loss.dtype) * loss
    sums = loss.new_zeros(len(rows)).index_add(0, which, weighted)
    counts = loss.new_zeros(len(rows)).index_add(0, which, torch.ones_like(loss))
    return (sums / counts).sum(), len(rows)


def saturated(gate: torch.Tensor) -> torch.Tensor:
    """bool [E]: gate < 0.05 or gate > 0.95."""
    return (gate < SATURATION_LOW) | (gate > SATURATION_HIGH)
