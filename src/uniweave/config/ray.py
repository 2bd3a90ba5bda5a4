"""The `ray:` section and the worker checks (`rollout.workers`, `reward.workers`).

With `rollout.workers: N > 0` (GRPO and OPD) the rollout service runs as N Ray actors and
with `reward.workers: M > 0` the reward service as M actors (`uniweave.train.onpolicy.workers`); 0
keeps either in the training process. The `ray:` fields say where the actors run and
what each may use; they act only when some workers are on, and a config that sets one
with both counts at 0 is refused. When the worker counts and the `ray:` fields act is
declared here (`ActsWhen`, `uniweave.config.acts`) and on the fields.
"""

from __future__ import annotations

import importlib.util
from typing import Annotated

from pydantic import Field, model_validator

from uniweave.config.acts import ActsWhen, method_of
from uniweave.config.base import StrictModel, incompatible
from uniweave.config.methods import names

ROLLOUT_ACTORS = ActsWhen(lambda cfg: cfg.rollout.workers > 0, "with rollout.workers > 0")
REWARD_ACTORS = ActsWhen(lambda cfg: cfg.reward.workers > 0, "with reward.workers > 0")


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
    rollout_cpus: Annotated[float, ROLLOUT_ACTORS] = Field(
        1.0, gt=0.0, description="CPU share of each rollout actor (torch threads: max(1, floor))."
    )
    rollout_gpus: Annotated[float, ROLLOUT_ACTORS] = Field(
        0.0, ge=0.0, description="GPU share of each rollout actor (> 0: it rolls out on cuda)."
    )
    reward_cpus: Annotated[float, REWARD_ACTORS] = Field(
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


def _workers_built() -> tuple[ActsWhen, ...]:
    """The rules of `rollout.workers` / `reward.workers` > 0: Ray workers are
    built for the methods whose spec has `ray_workers`, in one training process, with
    the ray package installed."""
    return (
        ActsWhen(
            lambda cfg: method_of(cfg).ray_workers,
            lambda: f"with {' or '.join(names(ray_workers=True))}",
            lambda cfg: (
                f"Ray workers are built for {' and '.join(names(ray_workers=True))}, "
                f"not {cfg.algorithm.name}"
            ),
        ),
        ActsWhen(
            lambda cfg: cfg.trainer.parallel == "none",
            "with trainer.parallel none",
            lambda cfg: f"Ray workers with trainer.parallel={cfg.trainer.parallel} are not built",
        ),
        ActsWhen(
            lambda cfg: importlib.util.find_spec("ray") is not None,
            "with the ray package installed",
            "the ray package is not installed (pip install 'uniweave[ray]')",
        ),
    )


ROLLOUT_WORKERS = _workers_built()
REWARD_WORKERS = (
    *_workers_built(),
    ActsWhen(
        lambda cfg: bool(cfg.reward.plugins),
        "with reward.plugins",
        "acts only with reward.plugins (nothing to score)",
    ),
)
SOME_WORKERS = ActsWhen(
    lambda cfg: cfg.rollout.workers > 0 or cfg.reward.workers > 0,
    "with rollout.workers or reward.workers > 0",
)
