"""Ray workers for GRPO and OPD (`rollout.workers`, `reward.workers`, the `ray:` section).

Rollout workers: N actors, each holding a copy of the policy and a `RolloutService`.
The driver splits an update's requests into engine batches of `rollout.batch_size`
rows, exactly as the in-process service does, and gives batch c to actor c mod N; every
engine batch is decoded as it would be in-process, so the trajectories are the same
bits (same thread count and device). Weights go by version: version u is the policy
after u updates. Before rolling out update u the driver pushes version u once (`sync`)
— the parameters that train (`requires_grad`: the LoRA adapter tensors alone under
LoRA), one object in Ray's store fetched by every actor — and every `generate` call
names the version it expects; an actor holding another one refuses
(`StaleWeightsError`).

Reward workers: M actors, each a `RewardService` built from the `reward:` section; the
rows of a batch are split round-robin and merged back (`merge_round_robin`), plugins
score rows independently, so the result is the in-process one (bitwise with one actor;
with several, a plugin that batches GEMMs over rows may round differently).

Failures: an actor that dies (process exit, node loss, `ray.kill`) is replaced — a new
actor from the same initial policy object plus the current weights — and its
unfinished calls are re-run; the seeds are per row, so its rows are re-sampled to the
same trajectories. `ray.max_worker_restarts` replacements per call, then `WorkerError`.
An actor that fails to start is not retried (`WorkerError` with Ray's cause).

Session: `ray.address` joins a running cluster (`auto`: the one on this machine);
otherwise a new local Ray instance is started (`ray.init(address="local")`, never a
cluster that happens to run here; `ray.num_cpus`, no dashboard) and shut down at
`close`. A process that already
called `ray.init` keeps its session (then `ray.address` / `ray.num_cpus` must be unset).

Test hook: `UNIWEAVE_FAULT=rollout_worker:<n>` makes the first rollout actor `os._exit`
when asked to roll out update n (1-based); its replacement does not.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from uniweave.config import ConfigError, UniweaveConfig
from uniweave.config.schema import RewardConfig
from uniweave.core.sample import Part, Sample
from uniweave.models.base import UnifiedModel
from uniweave.rewards import RewardError, RewardResult
from uniweave.rollout import RolloutRequest, RolloutTrajectory
from uniweave.train.onpolicy.ray_actors import (
    FAULT,
    RewardWorker,
    RolloutWorker,
    StaleWeightsError,
    threads_for,
)
from uniweave.train.onpolicy.scoring import first_failure, merge_round_robin


class WorkerError(RuntimeError):
    """A Ray worker could not start, or kept dying past `ray.max_worker_restarts`."""


@dataclass(frozen=True)
class RayPlan:
    """What the `ray:` section, `rollout.workers` and `reward.workers` ask for."""

    init: dict[str, Any]
    rollout_workers: int
    reward_workers: int
    rollout_options: dict[str, float]
    reward_options: dict[str, float]
    rollout_device: str
    max_restarts: int

    @classmethod
    def from_config(cls, cfg: UniweaveConfig) -> RayPlan:
        r = cfg.ray
        if r.address is not None:
            init: dict[str, Any] = {"address": r.address}
        else:
            # "local": always a new instance, never a cluster found on this machine
            init = {"address": "local", "include_dashboard": False}
            if r.num_cpus is not None:
                init["num_cpus"] = r.num_cpus
        return cls(
            init=init,
            rollout_workers=cfg.rollout.workers,
            reward_workers=cfg.reward.workers,
            rollout_options={"num_cpus": r.rollout_cpus, "num_gpus": r.rollout_gpus},
            reward_options={"num_cpus": r.reward_cpus, "num_gpus": 0.0},
            rollout_device="cuda" if r.rollout_gpus > 0 else "cpu",
            max_restarts=r.max_worker_restarts,
        )


def check_capacity(plan: RayPlan, have: dict[str, float]) -> None:
    """ConfigError unless a local Ray instance with resources `have` ({"CPU": n, "GPU":
    m}; a missing one is not checked) holds every actor at once (else it would wait
    forever). `uniweave train`'s preflight checks the CPUs of `ray.num_cpus` before anything
    is written; the session checks what the started instance has."""
    for what, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        if what not in have:
            continue
        need = plan.rollout_workers * plan.rollout_options[key]
        need += plan.reward_workers * plan.reward_options[key]
        if need > have[what] + 1e-9:
            raise ConfigError(
                f"the workers ask for {need:g} {what}s, the local Ray instance has "
                f"{have[what]:g} (set ray.num_cpus or smaller shares)",
                key="ray.rollout_cpus" if what == "CPU" else "ray.rollout_gpus",
            )


class RaySession:
    """Ray for this run: joined or started (module docstring), shut down if started."""

    def __init__(self, plan: RayPlan) -> None:
        import ray

        self.owned = not ray.is_initialized()
        if self.owned:
            ray.init(**plan.init)
        elif plan.init.get("address", "local") != "local" or "num_cpus" in plan.init:
            raise ConfigError(
                "this process already joined a Ray session: leave ray.address and "
                "ray.num_cpus unset",
                key="ray.num_cpus" if "num_cpus" in plan.init else "ray.address",
            )
        if plan.init.get("address") == "local":
            import ray

            have = ray.cluster_resources()
            check_capacity(plan, {k: have.get(k, 0.0) for k in ("CPU", "GPU")})

    def close(self) -> None:
        import ray

        if self.owned and ray.is_initialized():
            ray.shutdown()


class ActorPool:
    """n actors from `make(index, first)`; `map` runs call j on actor j mod n, replacing
    dead actors and re-running their unfinished calls."""

    def __init__(
        self, make: Callable[[int, bool], Any], n: int, max_restarts: int, what: str
    ) -> None:
        self.make = make
        self.max_restarts = max_restarts
        self.what = what
        self.replaced = 0
        self.actors = [make(i, True) for i in range(n)]
        self._wait_ready(range(n))

    def _wait_ready(self, indices) -> None:
        import ray

        try:
            ray.get([self.actors[i].ready.remote() for i in indices])
        except ray.exceptions.RayActorError as err:
            raise WorkerError(f"a {self.what} worker failed to start: {err}") from err

    def _replace(self, index: int) -> None:
        import ray

        ray.kill(self.actors[index], no_restart=True)
        self.replaced += 1
        self.actors[index] = self.make(index, False)
        self._wait_ready([index])

    def map(self, calls: Sequence[tuple[str, tuple]]) -> list:
        """The results of `getattr(actor_j, method)(*args)` for call j, in call order."""
        import ray

        n = len(self.actors)

        def submit(j: int):
            method, args = calls[j]
            return getattr(self.actors[j % n], method).remote(*args)

        refs = [submit(j) for j in range(len(calls))]
        out: list = [None] * len(calls)
        restarts = 0
        for j in range(len(calls)):
            while True:
                try:
                    out[j] = ray.get(refs[j])
                    break
                except ray.exceptions.RayActorError as err:
                    restarts += 1
                    if restarts > self.max_restarts:
                        raise WorkerError(
                            f"{self.what} worker {j % n} died and "
                            f"ray.max_worker_restarts={self.max_restarts} replacements are "
                            f"spent: {err}"
                        ) from err
                    self._replace(j % n)
                    for k in range(j, len(calls)):
                        if k % n == j % n:
                            refs[k] = submit(k)
        return out

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the parameters that train (the LoRA adapters alone under LoRA)."""
    return {
        n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad
    }


class RolloutWorkers:
    """The driver's handle on the rollout actors (module docstring)."""

    def __init__(
        self, plan: RayPlan, model: torch.nn.Module, version: int, cfg: UniweaveConfig
    ) -> None:
        import ray

        cpu_copy = model if next(model.parameters()).device.type == "cpu" else None
        self.model_ref = ray.put(cpu_copy or copy.deepcopy(model).to("cpu"))
        self.version = version
        self.weights_ref: Any = None  # a ray.ObjectRef of the pushed weights
        self.batch_size = cfg.rollout.batch_size
        spec = os.environ.get("UNIWEAVE_FAULT", "")
        die_at = int(spec.split(":")[1]) if spec.startswith(f"{FAULT}:") else None
        remote = ray.remote(RolloutWorker).options(**plan.rollout_options)
        args = (plan.rollout_device, threads_for(plan.rollout_options["num_cpus"]))
        run = cfg.run

        def make(index: int, first: bool):
            die = die_at if index == 0 and first else None
            actor: Any = remote.remote(
                self.model_ref,
                self.version,
                self.batch_size,
                *args,
                run.deterministic,
                run.host_mmap_threshold,
                die,
            )
            if self.weights_ref is not None:
                actor.load_weights.remote(self.version, self.weights_ref)
            return actor

        self.pool = ActorPool(make, plan.rollout_workers, plan.max_restarts, "rollout")

    def sync(self, version: int, model: torch.nn.Module) -> None:
        """Push the policy's trainable weights as `version` (nothing if already held)."""
        import ray

        if version == self.version:
            return
        self.weights_ref = ray.put(trainable_weights(model))
        self.version = version
        n = len(self.pool.actors)
        self.pool.map([("load_weights", (version, self.weights_ref))] * n)

    def generate(
        self,
        version: int,
        requests: Sequence[RolloutRequest],
        device: torch.device,
        after_batch: Callable[[], None] | None = None,
    ) -> list[RolloutTrajectory]:
        """Every request's trajectory under policy `version`, in request order, on
        `device`; `after_batch` runs once per engine batch as results arrive."""
        if version != self.version:
            raise StaleWeightsError(
                f"the rollout workers hold version {self.version}, not {version}"
            )
        B = self.batch_size
        chunks = [list(requests[s : s + B]) for s in range(0, len(requests), B)]
        out: list[RolloutTrajectory] = []
        for trajs in self.pool.map([("generate", (version, c)) for c in chunks]):
            out.extend(t.to(device) for t in trajs)
            if after_batch is not None:
                after_batch()
        return out

    def close(self) -> None:
        self.pool.close()


class RewardWorkers:
    """The reward service as actors, with `RewardService.score`'s interface."""

    def __init__(
        self,
        plan: RayPlan,
        cfg: RewardConfig,
        decode_images: Any,
        resources: dict[str, Any],
        features: bool = True,
        mmap_threshold: int | None = None,
    ) -> None:
        """`features`: the actors' results carry the scorer's features (GRPO's diversity
        metrics; OPD's verification needs none). `mmap_threshold`: `run.host_mmap_threshold`
        in each actor process."""
        import ray

        remote = ray.remote(RewardWorker).options(**plan.reward_options)
        threads = threads_for(plan.reward_options["num_cpus"])

        def make(index: int, first: bool):
            return remote.remote(cfg, decode_images, resources, threads, mmap_threshold, features)

        self.pool = ActorPool(make, plan.reward_workers, plan.max_restarts, "reward")

    def score(
        self,
        samples: Sequence[Sample],
        trajectories: Sequence[RolloutTrajectory],
        responses: Sequence[Sequence[Part] | None],
    ) -> RewardResult:
        """`RewardService.score` of the rows, split round-robin over the actors."""
        W = max(1, min(len(self.pool.actors), len(samples)))
        cpu = [t.to("cpu") for t in trajectories]
        calls = [
            ("score", (list(samples[r::W]), cpu[r::W], list(responses[r::W]))) for r in range(W)
        ]
        parts = self.pool.map(calls)
        failure = first_failure([f for _, f in parts], samples)
        if failure is not None:
            raise RewardError(*failure)
        return merge_round_robin([res for res, _ in parts])

    def close(self) -> None:
        self.pool.close()


@dataclass
class Workers:
    """A run's Ray session and worker pools (None where that service is in-process)."""

    session: RaySession
    rollout: RolloutWorkers | None
    rewards: RewardWorkers | None

    def close(self) -> None:
        for pool in (self.rollout, self.rewards):
            if pool is not None:
                pool.close()
        self.session.close()


def start_workers(
    cfg: UniweaveConfig,
    model: UnifiedModel,
    resources: dict[str, Any],
    version: int = 0,
    features: bool = True,
) -> Workers:
    """Join or start Ray and start the pools `cfg` asks for; the rollout actors hold
    `model`'s weights as `version`; `features`: whether the reward actors' results carry
    scorer features (`RewardWorkers`)."""
    plan = RayPlan.from_config(cfg)
    session = RaySession(plan)
    rollout = rewards = None
    try:
        if plan.rollout_workers:
            rollout = RolloutWorkers(plan, model, version, cfg)
        if plan.reward_workers:
            decode = model.codec.decode
            rewards = RewardWorkers(
                plan, cfg.reward, decode, resources, features, cfg.run.host_mmap_threshold
            )
    except BaseException:
        Workers(session, rollout, rewards).close()
        raise
    return Workers(session, rollout, rewards)
