"""The GRPO job: rollouts + rewards + advantages as the batch source, the clipped
surrogate (+ reference penalty) as the objective, optional Ray workers."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from uniweave.config import ConfigError, UniweaveConfig
from uniweave.config.algorithms import GRPOConfig
from uniweave.models.base import UnifiedModel
from uniweave.rewards import RewardService, build_reward_service
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.methods.grpo.objective import GRPOObjective, Reference, anchor_old_logprobs
from uniweave.train.methods.grpo.source import GRPOSource
from uniweave.train.onpolicy.prompts import PromptSampler, prompt_pools
from uniweave.train.onpolicy.scoring import load_run_classifier
from uniweave.train.onpolicy.workers import RewardWorkers, start_workers


def check_prefix_sharing(algo: GRPOConfig, supported: bool, model: str) -> None:
    """ConfigError (`algorithm.share_prompt_prefix`) when prefix sharing is asked of a
    model (`model`: how to name it) that does not support it (`supported`: the model's
    `supports_prefix_sharing`, or what its directory says, `ModelFacts`)."""
    if algo.share_prompt_prefix and not supported:
        raise ConfigError(
            f"{model} does not support it (the tiny model with model.tiny.mixer_kernel 0 does)",
            key="algorithm.share_prompt_prefix",
        )


def build_grpo_job(
    cfg: UniweaveConfig, model: UnifiedModel, run_dir: Path, info: DistInfo
) -> tuple[GRPOSource, GRPOObjective]:
    """GRPO: rollouts + rewards as the batch source, the clipped surrogate as objective.

    Call before the trainer resumes: the reference is the model as given (the initial
    policy, e.g. the SFT checkpoint of `model.path`)."""
    algo = cfg.algorithm
    assert isinstance(algo, GRPOConfig), "build_grpo_job of a GRPO config"
    # done by the preflight of `uniweave train` (from the model's config); free here
    check_prefix_sharing(algo, model.supports_prefix_sharing, type(model).__name__)
    resources = load_run_classifier(cfg, run_dir, info)
    sampler = PromptSampler(prompt_pools(cfg, model), cfg.data.task_weights, cfg.data.seed)
    anchor = None
    if algo.updates_per_batch > 1 or algo.mismatch.percentile is not None:
        # the percentile guard's global threshold is computed before the update's first
        # micro-batch, so the rows must carry the replay ℓ° already (docs/numerics.md §7a)
        anchor = partial(anchor_old_logprobs, model, cfg, info)
    workers = None
    if cfg.rollout.workers or cfg.reward.workers:
        workers = start_workers(cfg, model, resources)
    rewards: RewardService | RewardWorkers
    if workers is not None and workers.rewards is not None:
        rewards = workers.rewards
    else:
        rewards = build_reward_service(
            cfg.reward, decode_images=model.codec.decode, resources=resources, features=True
        )
    source = GRPOSource(model, sampler, rewards, cfg, info, run_dir, anchor, workers)
    # LoRA from scratch: the reference is the base (adapters off); from an initial adapter
    # it is base + that adapter, a frozen copy (the initial policy either way)
    lora_off = cfg.trainer.lora.enabled and cfg.model.initial_adapter is None
    reference = Reference(model, lora_off) if algo.kl.type != "none" else None
    return source, GRPOObjective(algo, reference)
