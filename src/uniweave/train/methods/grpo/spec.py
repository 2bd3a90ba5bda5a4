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

from uniweave.config.acts import ActsWhen
from uniweave.config.algorithms import GRPOConfig, RLInformationGainConfig
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


IG_ON = ActsWhen(
    lambda cfg: cfg.algorithm.information_gain.weight > 0,
    "with information_gain.weight > 0",
    "acts only with information_gain.weight > 0 (it is off)",
)
STD = ActsWhen(
    lambda cfg: cfg.algorithm.normalize_by_std,
    "with normalize_by_std true",
    "acts only with normalize_by_std true (advantages are r - mean)",
)
ACTS_WHEN: dict[str, tuple[ActsWhen, ...]] = {
    "kl.coef": (
        ActsWhen(
            lambda cfg: cfg.algorithm.kl.type != "none",
            "with kl.type other than none",
            lambda cfg: f"coef={cfg.algorithm.kl.coef} has no effect with type='none'",
        ),
    ),
    "old_logp_source": (
        ActsWhen(
            lambda cfg: cfg.algorithm.surrogate != "aligned",
            "with surrogate 'standard'",
            "'rollout' acts only with surrogate 'standard': the aligned surrogate reads "
            "both, its value from the sampler's log-probs and its trust region (clip) from "
            "the replay",
        ),
    ),
    "horizon": (
        ActsWhen(
            lambda cfg: cfg.algorithm.aggregation == "seq_mean_token_sum_norm",
            "with aggregation 'seq_mean_token_sum_norm'",
            lambda cfg: (
                "acts only with aggregation 'seq_mean_token_sum_norm' (got "
                f"'{cfg.algorithm.aggregation}', which normalises by the token or sequence count)"
            ),
        ),
    ),
    "std_ddof": (STD,),
    "eps": (STD,),
    "share_prompt_prefix": (
        ActsWhen(
            lambda cfg: (
                cfg.model.kind == "tiny"
                and not (cfg.model.path is None and cfg.model.tiny.mixer_kernel)
            ),
            "for the tiny model without the conv prior (model.kind tiny, "
            "model.tiny.mixer_kernel 0)",
            "built for the tiny model without the conv prior (model.kind tiny, "
            "model.tiny.mixer_kernel 0)",
        ),
        ActsWhen(
            lambda cfg: not cfg.trainer.gradient_checkpointing,
            "without trainer.gradient_checkpointing",
            "continues from a KV cache, which gradient checkpointing drops: turn "
            "trainer.gradient_checkpointing off",
        ),
    ),
    "information_gain.weight": (
        ActsWhen(
            lambda cfg: cfg.trainer.parallel == "none",
            "in one process (trainer.parallel none)",
            lambda cfg: (
                "is built for one process (trainer.parallel none): the behaviour "
                f"policy's views are not sharded under {cfg.trainer.parallel}"
            ),
        ),
    ),
    **{
        f"information_gain.{n}": (IG_ON,)
        for n in RLInformationGainConfig.model_fields
        if n != "weight"
    },
}
"""When GRPO's own settings act (`uniweave.config.acts`)."""


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
    acts_when=ACTS_WHEN,
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
