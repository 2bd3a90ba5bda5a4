"""The rollout round GRPO and OPD share: sample the current policy, score, cache.

`RolloutSource` is the base of the batch sources that roll out the policy being trained.
It holds the rollout service and the optional Ray workers, and gives its subclass:

- `roll_out(update, requests)`: the trajectories of `requests` under the current policy.
  With Ray rollout workers (`rollout.workers` > 0, one training process) the driver first
  pushes the policy's trainable weights as version `update`, then the actors decode every
  request, returned in request order (indices 0..n-1). Otherwise the in-process
  `RolloutService` decodes this rank's assigned rows (`rollout.assignment`). The fault
  point `UNIWEAVE_FAULT=rollout:<update + 1>` fires after each decode batch.
- `score(update, samples, local, indices)`: every row of the batch and its rewards,
  scored by the rank (or reward workers) that sampled it and gathered
  (`uniweave.train.onpolicy.scoring.score_sharded`). A failing reward plugin stops the
  update with a `RewardError` that names the update and the dataset row of the failing
  row's prompt (`meta["source_id"]`).
- `cached(key, make)`: one batch per update (or per round) built once, whichever of the
  trainer's calls asks first; a failing `make` leaves nothing cached.
- `close()`: stop the Ray workers, if any.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from uniweave.config import UniweaveConfig
from uniweave.core.sample import Sample
from uniweave.models.base import UnifiedModel
from uniweave.rewards import RewardError, RewardResult, RewardService
from uniweave.rollout import RolloutRequest, RolloutService, RolloutTrajectory
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.faults import inject_fault
from uniweave.train.engine.protocols import BatchSource
from uniweave.train.onpolicy.scoring import score_sharded
from uniweave.train.onpolicy.workers import RewardWorkers, Workers

T = TypeVar("T")


class RolloutSource(BatchSource):
    """Base of the GRPO and OPD batch sources (module docstring)."""

    def __init__(
        self,
        model: UnifiedModel,
        rewards: RewardService | RewardWorkers | None,
        cfg: UniweaveConfig,
        info: DistInfo,
        workers: Workers | None = None,
    ) -> None:
        """`rewards`: the in-process reward service, or the Ray reward pool of `workers`;
        None for a source that scores nothing."""
        r = cfg.rollout
        self.model = model
        self.grid = tuple(model.codec.grid)
        self.service = RolloutService(
            model,
            r.batch_size,
            info.rank,
            info.world_size,
            info.cpu_group,
            precision=r.precision,
            continuous=r.continuous_batching,
            assignment=r.assignment,
        )
        self.rewards = rewards
        self.workers = workers
        self._cache: tuple[int, Any] | None = None

    def close(self) -> None:
        """Stop the Ray workers (if any)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def cached(self, key: int, make: Callable[[], T]) -> T:
        """The value cached under `key`, or `make()` (then cached in its place)."""
        if self._cache is None or self._cache[0] != key:
            self._cache = None
            self._cache = (key, make())
        return self._cache[1]

    def roll_out(
        self, update: int, requests: Sequence[RolloutRequest]
    ) -> tuple[list[int], list[RolloutTrajectory]]:
        """(batch rows, their trajectories) this process decoded (module docstring)."""
        fault = lambda: inject_fault("rollout", update + 1)  # noqa: E731
        remote = self.workers.rollout if self.workers is not None else None
        if remote is not None:  # one training process: every row, in request order
            remote.sync(update, self.model)
            local = remote.generate(update, requests, self.model.device, fault)
            return list(range(len(requests))), local
        return self.service.generate_assigned(requests, fault)

    def score(
        self,
        update: int,
        samples: Sequence[Sample],
        local: list[RolloutTrajectory],
        indices: Sequence[int],
    ) -> tuple[list[RolloutTrajectory], RewardResult]:
        """Every trajectory of the batch and its rewards (module docstring)."""
        assert self.rewards is not None, "score() needs a reward service"
        try:
            return score_sharded(
                self.service, self.rewards, self.model.parse_response, samples, local, indices
            )
        except RewardError as err:
            source = {s.group_id: s.meta.get("source_id") for s in samples}
            group = err.sample_ids[0].split("/")[0] if err.sample_ids else ""
            raise RewardError(
                f"update {update + 1}: {err} ({group} is dataset row {source.get(group)!r})",
                err.plugin,
                err.sample_ids,
            ) from err

    def gather(
        self, samples: Sequence[Sample], local: list[RolloutTrajectory], indices: Sequence[int]
    ) -> list[RolloutTrajectory]:
        """Every trajectory of the batch, in request order, unscored (a collective)."""
        return self.service.gather_assigned(indices, local, len(samples))
