"""GRPO's `MethodSpec` (`uniweave.config.methods`): groups of rollouts per prompt.

What GRPO adds to the generic rules: the global batch holds whole groups, at least one
reward plugin scores them, prompt-prefix sharing is built for the tiny model without the
conv prior and without gradient checkpointing (and, for a `model.path` checkpoint, for a
kind whose files say it supports it), RL Information Gain runs in one process, and a
round of `updates_per_batch` updates shares one batch of rollouts (a child run starts
at a round boundary). The job imports torch only when it runs.
"""

from __future__ import annotations

from typing import Any

from uniweave.config.algorithms import GRPOConfig
from uniweave.config.base import incompatible
from uniweave.config.methods import MethodSpec


def _build_job(cfg, model, run_dir, info):
    from uniweave.train.methods.grpo.job import build_grpo_job

    return build_grpo_job(cfg, model, run_dir, info)


def _check(cfg: Any, tasks: set[str] | None) -> None:
    algo: GRPOConfig = cfg.algorithm
    if cfg.trainer.global_batch_size % algo.group_size:
        raise incompatible(
            "trainer.global_batch_size",
            f"{cfg.trainer.global_batch_size} is not a multiple of "
            f"algorithm.group_size={algo.group_size}",
        )
    if not cfg.reward.plugins:
        raise incompatible("reward.plugins", "grpo needs at least one reward plugin")
    if algo.share_prompt_prefix and (
        cfg.model.kind != "tiny" or (cfg.model.path is None and cfg.model.tiny.mixer_kernel)
    ):
        raise incompatible(
            "algorithm.share_prompt_prefix",
            "built for the tiny model without the conv prior (model.kind tiny, "
            "model.tiny.mixer_kernel 0)",
        )
    if algo.share_prompt_prefix and cfg.trainer.gradient_checkpointing:
        raise incompatible(
            "algorithm.share_prompt_prefix",
            "continues from a KV cache, which gradient checkpointing drops: turn "
            "trainer.gradient_checkpointing off",
        )


def _check_late(cfg: Any, tasks: set[str] | None) -> None:
    if cfg.algorithm.information_gain.weight > 0 and cfg.trainer.parallel != "none":
        raise incompatible(
            "algorithm.information_gain.weight",
            "is built for one process (trainer.parallel none): the behaviour "
            f"policy's views are not sharded under {cfg.trainer.parallel}",
        )


def _preflight_model(cfg: Any, facts: Any, where: str) -> None:
    from uniweave.train.methods.grpo.job import check_prefix_sharing

    check_prefix_sharing(cfg.algorithm, facts.supports_prefix_sharing, where)


def _plan_setup(algo: GRPOConfig) -> dict[str, Any]:
    return {"chunk": algo.chunk_size, "kl_copy": algo.kl.type != "none"}


def _updates_per_round(algo: GRPOConfig) -> int:
    return algo.updates_per_batch


SPEC = MethodSpec(
    name="grpo",
    config=GRPOConfig,
    build_job=_build_job,
    rollouts=True,
    ray_workers=True,
    check=_check,
    check_late=_check_late,
    preflight_model=_preflight_model,
    plan_setup=_plan_setup,
    updates_per_round=_updates_per_round,
    # the reward service's mean reward, the KL to the reference, the share of groups
    # whose rewards are all equal (no learning signal)
    progress=(
        ("reward", "reward/total_mean", ".4f"),
        ("kl", "policy/kl_ref_mean", ".3g"),
        ("zero-var", "adv/frac_zero_std_groups", ".2f"),
    ),
)
