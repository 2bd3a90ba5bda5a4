"""The Ray actors of `uniweave.train.onpolicy.workers`: plain classes, made remote by the pools.

`RolloutWorker` holds a policy copy (version v: the policy after v updates) and a
`RolloutService`; `generate(version, requests)` refuses any version but its own
(`StaleWeightsError`), so a push that did not land can never roll out old weights.
`RewardWorker` holds a `RewardService` built from the `reward:` section and returns
failures as values (the driver names the first failing row of the whole batch).
Each actor runs torch with `threads_for(cpus)` threads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from uniweave.config.schema import RewardConfig
from uniweave.core.determinism import set_determinism
from uniweave.core.host_memory import apply_mmap_threshold
from uniweave.models.base import UnifiedModel
from uniweave.rewards import RewardError, RewardResult, build_reward_service
from uniweave.rollout import RolloutRequest, RolloutService

FAULT = "rollout_worker"
"""`UNIWEAVE_FAULT=rollout_worker:<n>`: the first rollout actor exits when asked for update n."""


class StaleWeightsError(RuntimeError):
    """A rollout actor was asked for a policy version it does not hold."""


def threads_for(cpus: float) -> int:
    """Torch threads of an actor with `cpus` CPUs: max(1, floor(cpus))."""
    return max(1, int(cpus))


class RolloutWorker:
    """A policy copy and a `RolloutService` in an actor process."""

    def __init__(
        self,
        model: UnifiedModel,
        version: int,
        batch_size: int,
        device: str,
        threads: int,
        deterministic: bool,
        mmap_threshold: int | None,
        die_at: int | None,
    ) -> None:
        torch.set_num_threads(threads)
        set_determinism(deterministic, torch.device(device))
        apply_mmap_threshold(mmap_threshold)  # run.host_mmap_threshold
        self.model = model.to(device)
        self.service = RolloutService(self.model, batch_size)
        self.version = version
        self.die_at = die_at

    def ready(self) -> int:
        return os.getpid()

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> int:
        """Copy the pushed parameters in and hold `version`."""
        params = dict(self.model.named_parameters())
        missing = sorted(set(tensors) - set(params))
        if missing:
            raise KeyError(f"pushed weights name unknown parameters {missing[:3]}")
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value)
        self.version = version
        return version

    def generate(self, version: int, requests: Sequence[RolloutRequest]) -> list:
        """The trajectories of `requests` (one engine batch) under policy `version`, on CPU."""
        if version != self.version:
            raise StaleWeightsError(
                f"rollout worker holds policy version {self.version}, asked for {version}"
            )
        if self.die_at is not None and version + 1 == self.die_at:
            os._exit(1)
        return [t.to("cpu") for t in self.service.generate(requests)]


class RewardWorker:
    """A `RewardService` built from the `reward:` section in an actor process."""

    def __init__(
        self,
        cfg: RewardConfig,
        decode_images: Any,
        resources: dict[str, Any],
        threads: int,
        mmap_threshold: int | None,
        features: bool = True,
    ) -> None:
        torch.set_num_threads(threads)
        apply_mmap_threshold(mmap_threshold)  # run.host_mmap_threshold
        # `features`: results carry the scorer's features (GRPO's diversity metrics)
        self.service = build_reward_service(
            cfg, decode_images=decode_images, resources=resources, features=features
        )

    def ready(self) -> int:
        return os.getpid()

    def score(self, samples, trajectories, responses) -> tuple[RewardResult | None, Any]:
        """(result, None), or (None, (message, plugin, sample ids)) on a RewardError."""
        try:
            return self.service.score(samples, trajectories, responses), None
        except RewardError as err:
            return None, (str(err), err.plugin, list(err.sample_ids))
