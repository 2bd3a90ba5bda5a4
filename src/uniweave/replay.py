"""Replay: teacher-forced scoring of sampled rows at training geometry (docs/architecture.md §4).

One forward of the batch through the body (`uniweave.forward.body_hidden`); heads
are applied only at the policy positions (`scored_indices`: position t is scored from
the hidden state at t - 1), in chunks of at most `chunk_size` positions, so no
[positions x vocabulary] tensor larger than one chunk exists. Each row's distribution is
the one it was sampled from (`SamplingRecord.params`: temperature, top-k, top-p,
guidance weight and `guidance_logprob`, bit temperature; `uniweave.rollout.policy`). Rows
whose visual log-prob is the guided one (w != 1, "guided") get their unconditional twin
(`uniweave.rollout.guidance.unconditional_twin`) appended to the same forward. The batch is
self-describing (`Trajectory.images` carries understanding-image inputs), so any model
built from the same checkpoint replays it with no other state.

Under autograd each chunk's heads and log-probs run inside `torch.utils.checkpoint`, so
backward recomputes them chunk by chunk and memory stays flat in the vocabulary.

A reduction against a second model's full distributions (JSD to a reference, OPD's
teacher) keeps that model's replay as a `ReplayPlan`: its body's hidden states, from
which chunk i's distributions are rebuilt inside the chunk function of `replay_map` (and
rebuilt again when backward recomputes the chunk), so at most one chunk's distributions
of either model are alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch.utils.checkpoint import checkpoint

from uniweave.core.distributions import TextCategorical, VisualBits
from uniweave.core.dtypes import at_least_fp32_dtype
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.forward import body_hidden, prompt_lengths, scored_indices, shared_prefix_hidden
from uniweave.models.base import UnifiedModel
from uniweave.rollout.guidance import unconditional_twin
from uniweave.rollout.params import SamplingParams, check_same_policy
from uniweave.rollout.policy import VisualDistribution, text_distribution, visual_distribution
from uniweave.rollout.request import SamplingRecord, prompt_length_of

DEFAULT_CHUNK = 128


@dataclass
class DistributionChunk:
    """The policy's distributions at up to `chunk_size` scored positions of one modality.

    `rows`, `cols`: batch row and position of each target (long [n]); `targets`: the
    tokens (text, VQ: long [n]) or bits (BSQ: float [n, L]); `index`: chunk number in the
    deterministic order (text then visual, groups of equal parameters, row-major).
    """

    modality: Modality
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    dist: TextCategorical | VisualDistribution
    index: int

    def __len__(self) -> int:
        return int(self.rows.numel())


@dataclass
class ReplayOutput:
    """Replayed log-probs, 0 off the policy positions: `logp` [B, T]; for BSQ batches
    also the per-factor `logp_factors` [B, T, L] (visual positions; `logp` is their sum)."""

    logp: torch.Tensor
    logp_factors: torch.Tensor | None = None


@dataclass
class _Group:
    modality: Modality
    params: SamplingParams
    rows: torch.Tensor
    cols: torch.Tensor


class _Plan:
    """The forward and the scored positions of a batch, grouped by sampling parameters."""

    def __init__(
        self,
        model: UnifiedModel,
        batch: TrajectoryBatch,
        records: Sequence[SamplingRecord],
        params: SamplingParams | None,
        share_prefix: bool = False,
    ) -> None:
        if len(records) != len(batch):
            raise ValueError(f"got {len(records)} sampling records for {len(batch)} rows")
        self.model, self.batch = model, batch
        self.share_prefix = share_prefix
        self.row_params = []
        for i, rec in enumerate(records):
            if not isinstance(rec, SamplingRecord):
                raise TypeError(f"records[{i}] must be a SamplingRecord, got {type(rec).__name__}")
            if params is not None:
                check_same_policy(rec.params, params, f"row {i} ({batch.sample_ids[i]!r})")
            self.row_params.append(rec.params)
        text_index, visual_index = scored_indices(batch)
        self.groups = self._group(Modality.TEXT, text_index.rows, text_index.cols)
        self.groups += self._group(Modality.VISUAL, visual_index.rows, visual_index.cols)
        self._forward(records, set(visual_index.rows.tolist()))

    def _group(self, modality: Modality, rows: torch.Tensor, cols: torch.Tensor) -> list[_Group]:
        key = (lambda p: p.text_key()) if modality == Modality.TEXT else (lambda p: p.visual_key())
        by_key: dict[tuple, list[int]] = {}
        for i, p in enumerate(self.row_params):
            by_key.setdefault(key(p), []).append(i)
        groups = []
        for members in by_key.values():
            keep = torch.isin(rows, torch.tensor(members, device=rows.device))
            if keep.any():
                p = self.row_params[members[0]]
                groups.append(_Group(modality, p, rows[keep], cols[keep]))
        return groups

    def _forward(self, records: Sequence[SamplingRecord], visual_rows: set[int]) -> None:
        batch, B = self.batch, len(self.batch)
        guided = [i for i in sorted(visual_rows) if self.row_params[i].needs_uncond_for_scoring]
        self.twin_row = torch.full((B,), -1, dtype=torch.long, device=batch.token_ids.device)
        self.twin_shift = torch.zeros(B, dtype=torch.long, device=batch.token_ids.device)
        lengths = prompt_lengths(batch, [rec.prompt_length for rec in records])
        if not guided:
            self.hidden = self._body(batch, lengths)
            return
        # the twins carry no training data: neither may the rows they are collated with
        rows = batch.without_training_data().unbatch()
        trajs = [replace(t, rollout_logp=None, rollout_logp_factors=None) for t in rows]
        twins = []
        for j, i in enumerate(guided):
            n = prompt_length_of(trajs[i], records[i])
            twin = unconditional_twin(self.model, trajs[i], n)
            twins.append(twin)
            self.twin_row[i] = B + j
            self.twin_shift[i] = len(twin) - len(trajs[i])
            lengths.append(n + len(twin) - len(trajs[i]))
        combined = TrajectoryBatch.collate(trajs + twins, batch.pad_id, validate=False)
        self.hidden = self._body(combined, lengths)

    def _body(self, batch: TrajectoryBatch, lengths: list[int]) -> torch.Tensor:
        """The body's hidden states; with `share_prefix` each distinct prompt runs once
        (`shared_prefix_hidden`, rows' prompts are their first lengths[r] positions)."""
        if self.share_prefix:
            return shared_prefix_hidden(self.model, batch, lengths)
        return body_hidden(self.model, batch)

    def chunks(self, chunk_size: int) -> Iterator[tuple[_Group, torch.Tensor, torch.Tensor]]:
        """(group, rows, cols) of every chunk, in the deterministic order."""
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        for g in self.groups:
            for s in range(0, len(g.rows), chunk_size):
                yield g, g.rows[s : s + chunk_size], g.cols[s : s + chunk_size]

    def inputs(self, g: _Group, rows: torch.Tensor, cols: torch.Tensor):
        """Hidden states feeding the chunk's targets (cond [n, d], uncond [n, d] | None)."""
        h = self.hidden[rows, cols - 1]
        if g.modality == Modality.TEXT or not g.params.needs_uncond_for_scoring:
            return h, None
        return h, self.hidden[self.twin_row[rows], cols - 1 + self.twin_shift[rows]]

    def distribution(self, g: _Group, h: torch.Tensor, hu: torch.Tensor | None):
        """The group's distribution at hidden states h (and unconditional hu)."""
        if g.modality == Modality.TEXT:
            return text_distribution(self.model.text_logits(h), g.params)
        if hu is None:
            return visual_distribution(
                self.model.visual_head, self.model.visual_logits(h), None, g.params
            )
        logits = self.model.visual_logits(torch.cat([h, hu]))
        n = h.shape[0]
        return visual_distribution(self.model.visual_head, logits[:n], logits[n:], g.params)


def _runner(
    plan: _Plan,
    g: _Group,
    chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    fn: Callable[[DistributionChunk], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    rows, cols, targets, index = chunk

    def run(h: torch.Tensor, hu: torch.Tensor | None) -> torch.Tensor:
        dist = plan.distribution(g, h, hu)
        return fn(DistributionChunk(g.modality, rows, cols, targets, dist, index))

    return run


def _apply(
    plan: _Plan, chunk_size: int, fn: Callable[[DistributionChunk], torch.Tensor]
) -> Iterator[tuple[Modality, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(modality, rows, cols, fn(chunk)) per chunk, checkpointed when autograd records."""
    batch = plan.batch
    for index, (g, rows, cols) in enumerate(plan.chunks(chunk_size)):
        source = batch.token_ids if g.modality == Modality.TEXT else batch.visual_codes
        run = _runner(plan, g, (rows, cols, source[rows, cols], index), fn)
        h, hu = plan.inputs(g, rows, cols)
        if torch.is_grad_enabled() and h.requires_grad:
            value = checkpoint(run, h, hu, use_reentrant=False)
        else:
            value = run(h, hu)
        yield g.modality, rows, cols, value


def replay_map(
    model: UnifiedModel,
    batch: TrajectoryBatch,
    records: Sequence[SamplingRecord],
    fn: Callable[[DistributionChunk], torch.Tensor],
    params: SamplingParams | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    share_prefix: bool = False,
) -> torch.Tensor:
    """out[B, T, ...] with out[r, t] = fn(chunk)[k] at the k-th position (r, t) of a chunk,
    0 off the policy positions. `fn` maps a `DistributionChunk` to a tensor [n, ...] (the
    same trailing shape for every chunk), e.g. a per-position JSD to a teacher; under
    autograd it is recomputed chunk by chunk in backward. `params`, when given, must be
    the policy every row was sampled with (else ValueError, `check_same_policy`).
    `share_prefix` runs each distinct prompt through the body once
    (`uniweave.forward.shared_prefix_hidden`; the same function of the weights)."""
    plan = _Plan(model, batch, records, params, share_prefix)
    out: torch.Tensor | None = None
    for _, rows, cols, value in _apply(plan, chunk_size, fn):
        if out is None:
            shape = (len(batch), batch.max_length, *value.shape[1:])
            out = torch.zeros(shape, dtype=value.dtype, device=value.device)
        out = out.index_put((rows, cols), value)
    if out is None:
        device, dtype = batch.token_ids.device, at_least_fp32_dtype(plan.hidden.dtype)
        return torch.zeros(len(batch), batch.max_length, device=device, dtype=dtype)
    return out


def replay_logprobs(
    model: UnifiedModel,
    batch: TrajectoryBatch,
    records: Sequence[SamplingRecord],
    params: SamplingParams | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    share_prefix: bool = False,
) -> ReplayOutput:
    """log pi(token t | tokens < t) at every policy position, under each row's sampling
    policy (module docstring); BSQ positions also per factor. Refuses (ValueError) a
    `params` whose policy fields differ from a row's record; `share_prefix` as in
    `replay_map`."""
    plan = _Plan(model, batch, records, params, share_prefix)
    B, T = len(batch), batch.max_length
    device, dtype = batch.token_ids.device, at_least_fp32_dtype(plan.hidden.dtype)
    factors = (
        torch.zeros(B, T, batch.n_factors, device=device, dtype=dtype) if batch.is_bits else None
    )
    logp = torch.zeros(B, T, device=device, dtype=dtype)

    def score(chunk: DistributionChunk) -> torch.Tensor:
        if batch.is_bits and chunk.modality == Modality.VISUAL:
            assert isinstance(chunk.dist, VisualBits), "BSQ visual positions are bits"
            return chunk.dist.log_prob_factors(chunk.targets)
        return chunk.dist.log_prob(chunk.targets)

    for _, rows, cols, value in _apply(plan, chunk_size, score):
        if value.dim() == 2:
            assert factors is not None, "per-factor values come only from BSQ rows"
            factors = factors.index_put((rows, cols), value)
            value = value.sum(-1)
        logp = logp.index_put((rows, cols), value)
    return ReplayOutput(logp=logp, logp_factors=factors)


def replay_distributions(
    model: UnifiedModel,
    batch: TrajectoryBatch,
    records: Sequence[SamplingRecord],
    params: SamplingParams | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> Iterator[DistributionChunk]:
    """The full distributions at the policy positions, `chunk_size` positions at a time
    (for JSD / KL against a teacher). Chunks come in a deterministic order, so two models
    replaying the same batch and records yield aligned chunks. Reduce each chunk before
    asking for the next; for gradients through full distributions use `replay_map`."""
    plan = _Plan(model, batch, records, params)
    for index, (g, rows, cols) in enumerate(plan.chunks(chunk_size)):
        source = batch.token_ids if g.modality == Modality.TEXT else batch.visual_codes
        dist = plan.distribution(g, *plan.inputs(g, rows, cols))
        yield DistributionChunk(g.modality, rows, cols, source[rows, cols], dist, index)


class ReplayPlan:
    """A model's replay of a batch held as its body's hidden states (module docstring).

    Chunk i (the order of `replay_map` / `replay_distributions` with the same records,
    params and chunk size) has its distributions rebuilt by `distribution(i)`; nothing
    of size [positions x vocabulary] is kept between calls. Build it (and call
    `distribution`) under the grad mode and adapter state the model should be scored in.
    """

    def __init__(
        self,
        model: UnifiedModel,
        batch: TrajectoryBatch,
        records: Sequence[SamplingRecord],
        params: SamplingParams | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        share_prefix: bool = False,
    ) -> None:
        self._plan = _Plan(model, batch, records, params, share_prefix)
        self._chunks = list(self._plan.chunks(chunk_size))

    def __len__(self) -> int:
        return len(self._chunks)

    def distribution(
        self, index: int, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None
    ) -> TextCategorical | VisualDistribution:
        """The distributions of chunk `index`; with `rows`/`cols` (another replay's
        chunk) refuses a chunk at other positions (RuntimeError)."""
        g, r, c = self._chunks[index]
        if rows is not None and not (
            cols is not None and torch.equal(r, rows) and torch.equal(c, cols)
        ):
            raise RuntimeError(f"chunk {index}: the two replays score different positions")
        return self._plan.distribution(g, *self._plan.inputs(g, r, c))
