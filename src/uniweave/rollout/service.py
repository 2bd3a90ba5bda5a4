"""The rollout service (docs/architecture.md §4): prompts -> sampled trajectories, shared by GRPO,
evaluation and OPD.

`RolloutService.generate(requests)` samples every request in fixed-size engine batches
(`batch_size` rows decoded together, in request order) and returns one
`RolloutTrajectory` per request, in request order, carrying its rollout log-probs, its
finish reason, its `SamplingRecord` and its per-row stateless `seed` (the request's).
Because the seeds are stateless and rows do not interact, the result does not depend on
how the requests are split into batches or across ranks.

Across ranks (torch.distributed initialised, `world_size` > 1): `shard(items)` gives
this rank's round-robin share (`items[rank::world_size]`), and `gather(local, n)` returns
the n items of every rank in the original order (`all_gather_object`), so
`generate_sharded(requests) == generate(requests)` on every rank. Anything computed per
row on the shard (e.g. rewards) can be gathered the same way instead of being
recomputed on every rank.

`assignment` (`rollout.assignment`, `uniweave.rollout.queue`): `static` is the round-robin
split above; `dynamic` lets each rank claim engine batches of the longest remaining
rows from a counter in the job's store. `generate_assigned` returns this rank's
(indices, trajectories) under either, and `gather_assigned` puts every rank's back in
request order, so the gathered batch is the same under both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from uniweave.models.base import UnifiedModel
from uniweave.rollout.engine import Precision, RolloutEngine
from uniweave.rollout.queue import Assignment, WorkQueue, gather_indexed, job_store, round_robin
from uniweave.rollout.request import RolloutRequest, RolloutTrajectory

T = TypeVar("T")


def interleave(parts: Sequence[Sequence[T]]) -> list[T]:
    """Undo a round-robin split: item j of the whole is parts[j % W][j // W]."""
    world = len(parts)
    n = sum(len(p) for p in parts)
    for r, part in enumerate(parts):
        expected = len(range(r, n, world))
        if len(part) != expected:
            raise ValueError(f"rank {r} holds {len(part)} items, round-robin gives {expected}")
    return [parts[j % world][j // world] for j in range(n)]


class RolloutService:
    """Prompts -> trajectories in fixed-size engine batches, optionally sharded across
    ranks (module docstring)."""

    def __init__(
        self,
        model: UnifiedModel,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        group: Any = None,
        precision: Precision = "fp32",
        continuous: bool = False,
        assignment: Assignment = "static",
        queue_name: str = "rollout",
    ) -> None:
        """`group`: the process group `gather` uses (a CPU/gloo group when the default
        one is NCCL; None: the default group); `precision`: the engine's
        (`rollout.precision`); `continuous`: one engine call over all requests with
        `batch_size` decode slots (`rollout.continuous_batching`); `assignment`: static |
        dynamic (module docstring), the dynamic queue's counters named after `queue_name`."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        slots = batch_size if continuous else None
        if continuous and batch_size < 2:
            raise ValueError("continuous batching needs batch_size >= 2 slots (a guided pair)")
        self.engine = RolloutEngine(model, model.tokenizer, precision=precision, slots=slots)
        self.continuous = continuous
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.group = group
        if assignment not in ("static", "dynamic"):
            raise ValueError(f"assignment must be static or dynamic, got {assignment!r}")
        self.assignment = assignment
        self.last_indices: list[int] = []
        """The request indices this rank sampled in the last `generate_assigned`."""
        self.queue = (
            WorkQueue(queue_name, rank, world_size, job_store() if world_size > 1 else None)
            if assignment == "dynamic"
            else None
        )

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        after_batch: Callable[[], None] | None = None,
    ) -> list[RolloutTrajectory]:
        """Sample every request on this process, `batch_size` rows at a time (continuous:
        all in one engine call over `batch_size` slots); each
        trajectory carries its request's seed. `after_batch` runs after each engine batch
        (progress, test hooks)."""
        out: list[RolloutTrajectory] = []
        step = len(requests) if self.continuous else self.batch_size
        for start in range(0, len(requests), max(step, 1)):
            chunk = requests[start : start + max(step, 1)]
            for request, traj in zip(chunk, self.engine.generate(chunk)):
                traj.seed = request.seed
                out.append(traj)
            if after_batch is not None:
                after_batch()
        return out

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's round-robin share of `items`."""
        return list(items[self.rank :: self.world_size])

    def gather(self, local: Sequence[T], n: int) -> list[T]:
        """The n items whose round-robin shards the ranks hold, in the original order (a
        collective: every rank calls it)."""
        if self.world_size == 1:
            if len(local) != n:
                raise ValueError(f"gather: {len(local)} local items, expected {n}")
            return list(local)
        parts: list[list[T] | None] = [None] * self.world_size
        dist.all_gather_object(parts, list(local), group=self.group)
        filled = [p for p in parts if p is not None]
        assert len(filled) == self.world_size, "all_gather_object fills every rank's part"
        out = interleave(filled)
        if len(out) != n:
            raise ValueError(f"gather: the ranks hold {len(out)} items, expected {n}")
        return out

    def generate_sharded(
        self,
        requests: Sequence[RolloutRequest],
        after_batch: Callable[[], None] | None = None,
    ) -> list[RolloutTrajectory]:
        """`generate(requests)` with the rows split round-robin across ranks and gathered
        (every rank gets every trajectory)."""
        local = self.generate(self.shard(requests), after_batch)
        return self.gather(local, len(requests))

    def prepared_length(self, request: RolloutRequest) -> int:
        """Positions the row can reach: its prompt's plus its sampling budget
        (max_new_tokens, or what the context length leaves)."""
        prompt, _grid = self.engine.prompt_trajectory(request)
        budget = request.params.max_new_tokens
        if budget is None:
            budget = (self.engine.max_positions or len(prompt)) - len(prompt)
        return len(prompt) + budget

    def generate_assigned(
        self,
        requests: Sequence[RolloutRequest],
        after_batch: Callable[[], None] | None = None,
    ) -> tuple[list[int], list[RolloutTrajectory]]:
        """This rank's (request indices, trajectories) under the assignment: static, its
        round-robin share; dynamic, the engine batches it claimed (each claim is one
        engine batch of up to `batch_size` rows, longest first)."""
        if self.queue is None:
            indices = round_robin(len(requests), self.rank, self.world_size)
            self.last_indices = indices
            return indices, self.generate([requests[i] for i in indices], after_batch)
        lengths = [self.prepared_length(r) for r in requests]
        indices = []
        out: list[RolloutTrajectory] = []
        for claim in self.queue.claims(lengths, self.batch_size):
            out += self.generate([requests[i] for i in claim])
            indices += claim
            if after_batch is not None:
                after_batch()
        self.last_indices = indices
        return indices, out

    def gather_assigned(self, indices: Sequence[int], local: Sequence[T], n: int) -> list[T]:
        """Every rank's results of `generate_assigned`, in request order (a collective)."""
        return gather_indexed(indices, local, n, self.world_size, self.group)
