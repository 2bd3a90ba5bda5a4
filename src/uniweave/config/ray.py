"""The `ray:` section and the worker checks (`rollout.workers`, `reward.workers`).

With `rollout.workers: N > 0` (GRPO and OPD) the rollout service runs as N Ray actors and
with `reward.workers: M > 0` the reward service as M actors (`uniweave.train.rollouts.workers`); 0
keeps either in the training process. The `ray:` fields say where the actors run and
what each may use; they act only when some workers are on, and a config that sets one
with both counts at 0 is refused.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from pydantic import Field, model_validator

from uniweave.config.base import StrictModel, incompatible
from uniweave.config.methods import method, names


class RayConfig(StrictModel):
    """Where the Ray worker actors run and what each one may use."""

    address: str | None = Field(
        None,
        description="Ray cluster to join (auto: the one running on this machine; "
        "host:6379; ray://head:10001); null = start a new local Ray instance.",
    )
    num_cpus: int | None = Field(
        None, gt=0, description="CPUs of the local Ray instance (null = all); not with address."
    )
    rollout_cpus: float = Field(
        1.0, gt=0.0, description="CPU share of each rollout actor (torch threads: max(1, floor))."
    )
    rollout_gpus: float = Field(
        0.0, ge=0.0, description="GPU share of each rollout actor (> 0: it rolls out on cuda)."
    )
    reward_cpus: float = Field(
        1.0, gt=0.0, description="CPU share of each reward actor (torch threads: max(1, floor))."
    )
    max_worker_restarts: int = Field(
        3, ge=0, description="Dead actors replaced per batch (rows re-sampled) before it fails."
    )

    @model_validator(mode="after")
    def _local_or_cluster(self) -> RayConfig:
        if self.address is not None and self.num_cpus is not None:
            raise incompatible(
                "num_cpus", "sizes a local Ray instance; a cluster (ray.address) has its own"
            )
        return self


RAY_DEFAULTS = RayConfig().model_dump()


def check_workers(cfg: Any) -> None:
    """Config-time refusals of the Ray workers (`cfg` is the whole `UniweaveConfig`): workers
    only for GRPO and OPD, reward workers only with reward plugins, only with
    `trainer.parallel: none`, only with Ray installed; `ray.*` fields only when some
    workers are on."""
    rollout, reward = cfg.rollout.workers, cfg.reward.workers
    if rollout == 0 and reward == 0:
        for key, default in RAY_DEFAULTS.items():
            if getattr(cfg.ray, key) != default:
                raise incompatible(
                    f"ray.{key}", "acts only with rollout.workers or reward.workers > 0"
                )
        return
    key = "rollout.workers" if rollout else "reward.workers"
    if not method(cfg.algorithm.name).ray_workers:
        built = " and ".join(names(ray_workers=True))
        raise incompatible(key, f"Ray workers are built for {built}, not {cfg.algorithm.name}")
    if reward and not cfg.reward.plugins:
        raise incompatible("reward.workers", "acts only with reward.plugins (nothing to score)")
    if cfg.trainer.parallel != "none":
        raise incompatible(
            key, f"Ray workers with trainer.parallel={cfg.trainer.parallel} are not built"
        )
    if importlib.util.find_spec("ray") is None:
        raise incompatible(key, "the ray package is not installed (pip install 'uniweave[ray]')")
    if cfg.ray.rollout_gpus > 0 and rollout == 0:
        raise incompatible("ray.rollout_gpus", "acts only with rollout.workers > 0")
    if cfg.ray.rollout_cpus != RAY_DEFAULTS["rollout_cpus"] and rollout == 0:
        raise incompatible("ray.rollout_cpus", "acts only with rollout.workers > 0")
    if cfg.ray.reward_cpus != RAY_DEFAULTS["reward_cpus"] and reward == 0:
        raise incompatible("ray.reward_cpus", "acts only with reward.workers > 0")
