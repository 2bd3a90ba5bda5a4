"""Work queues over ranks (`rollout.assignment`): which rank samples which row.

A batch is a list of n items (prompt x group member; each carries its own stateless
seed, so an item's result does not depend on the rank or the engine batch that runs
it). Two assignments:

- `static`: rank r takes items r, r + W, r + 2W, ... (round-robin), fixed in advance.
- `dynamic`: the items are ordered longest-first by prepared length (prompt positions
  plus the row's sampling budget; ties by index), and each rank, whenever it is free,
  claims the next `chunk` items of that order with one atomic `add` on a counter in
  torch.distributed's own key-value store (the job's TCPStore that the process group
  was rendezvoused on; no server of uniweave's). A rank that drew short rows simply claims
  more, so stragglers no longer set the batch's wall time.

Either way every rank ends with (indices, results) for the items it ran, and
`gather_indexed` all-gathers them and puts every result back at its item's index: the
batch is the same list, in the same order, on every rank, whatever the assignment, so
the objective and the trajectories do not change (tests/test_queues.py checks this
bitwise for GRPO and OPD at 1, 2 and 3 ranks).

Counter keys are `uniweave/queue/<name>-<k>/<round>`, k counting the queues this process
made: every rank makes its queues and opens their rounds in the same order (they run
the same program), so the n-th round of a queue has the same key on every rank. Every round ends in a gather (a collective), so when rank 0 opens round
k every rank has stopped claiming in round k - 1, and rank 0 deletes that key then.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Literal, TypeVar

import torch.distributed as dist

T = TypeVar("T")
_QUEUES = itertools.count()
Assignment = Literal["static", "dynamic"]


def longest_first(lengths: Sequence[int]) -> list[int]:
    """Item indices by decreasing length, ties by increasing index."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def job_store() -> Any:
    """The key-value store the default process group rendezvoused on (torchrun's /
    `init_process_group`'s TCPStore), or None outside a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


class WorkQueue:
    """Dynamic claims of a batch's items (module docstring). `store`: a torch.distributed
    Store shared by the `world_size` ranks (None with one rank: a local counter)."""

    def __init__(self, name: str, rank: int, world_size: int, store: Any = None) -> None:
        if world_size > 1 and store is None:
            raise ValueError(f"queue {name!r}: {world_size} ranks need a shared store")
        self.name = f"{name}-{next(_QUEUES)}"
        self.rank, self.world_size, self.store = rank, world_size, store
        self.round = 0
        self.claims_made = 0
        """Claims this rank made over every round (`add` calls that returned items)."""

    def _key(self, round_: int) -> str:
        return f"uniweave/queue/{self.name}/{round_}"

    def close(self) -> None:
        """Rank 0, after the last round's collective: delete that round's counter."""
        if self.store is not None and self.rank == 0 and self.round > 0:
            self.store.delete_key(self._key(self.round - 1))

    def claims(self, lengths: Sequence[int], chunk: int) -> Iterator[list[int]]:
        """This rank's claims of one round over items of `lengths`: lists of at most
        `chunk` item indices, longest first, until the queue is drained."""
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        order = longest_first(lengths)
        if self.store is not None and self.rank == 0 and self.round > 0:
            self.store.delete_key(self._key(self.round - 1))
        key = self._key(self.round)
        self.round += 1
        taken = 0
        while True:
            if self.store is None:
                taken += chunk
                end = taken
            else:
                end = int(self.store.add(key, chunk))
            start = end - chunk
            if start >= len(order):
                return
            self.claims_made += 1
            yield order[start : min(end, len(order))]


def round_robin(n: int, rank: int, world_size: int) -> list[int]:
    """The item indices the static assignment gives `rank`."""
    return list(range(rank, n, world_size))


def place(parts: Sequence[tuple[Sequence[int], Sequence[T]]], n: int) -> list[T]:
    """The n items from the ranks' (indices, results), each result at its index; every
    index must be covered exactly once."""
    out: list[Any] = [None] * n
    seen = [False] * n
    for indices, results in parts:
        if len(indices) != len(results):
            raise ValueError(f"{len(indices)} indices for {len(results)} results")
        for i, value in zip(indices, results):
            if not 0 <= i < n or seen[i]:
                raise ValueError(f"item {i} is out of range or claimed twice (n={n})")
            seen[i] = True
            out[i] = value
    missing = [i for i, s in enumerate(seen) if not s]
    if missing:
        raise ValueError(f"items {missing[:8]} were claimed by no rank (n={n})")
    return out


def gather_indexed(
    indices: Sequence[int], local: Sequence[T], n: int, world_size: int, group: Any = None
) -> list[T]:
    """Every rank's (indices, results), all-gathered (a collective) and placed."""
    if world_size == 1:
        return place([(indices, local)], n)
    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, (list(indices), list(local)), group=group)
    return place(parts, n)
