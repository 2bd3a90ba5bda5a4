"""The OPD job: student rollouts + verification + routing as the batch source, the JSD to
the frozen teacher (+ ground-truth replay CE) as the objective, optional Ray workers
(rollouts and verification; the teacher always scores in the trainer)."""

from __future__ import annotations

from pathlib import Path

from uniweave.config import UniweaveConfig
from uniweave.config.algorithms import OPDConfig
from uniweave.models.base import UnifiedModel
from uniweave.rewards import RewardService, build_reward_service
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.methods.opd.objective import OPDObjective, load_teacher, teacher_identity
from uniweave.train.methods.opd.source import OPDSource
from uniweave.train.onpolicy.prompts import PromptSampler, prompt_pools
from uniweave.train.onpolicy.scoring import load_run_classifier
from uniweave.train.onpolicy.workers import RewardWorkers, start_workers


def build_opd_job(
    cfg: UniweaveConfig, model: UnifiedModel, run_dir: Path, info: DistInfo
) -> tuple[OPDSource, OPDObjective]:
    """OPD: student rollouts + verification + routing as the source, the trajectory-first
    JSD to the frozen teacher (+ GT-replay CE) as the objective."""
    teacher = load_teacher(cfg, model)
    rewards: RewardService | RewardWorkers | None = None
    resources: dict = {}
    if cfg.reward.plugins:
        resources = load_run_classifier(cfg, run_dir, info)
    workers = None
    if cfg.rollout.workers or cfg.reward.workers:
        # verification needs no diversity features (GRPO's reward actors compute them)
        workers = start_workers(cfg, model, resources, features=False)
    if workers is not None and workers.rewards is not None:
        rewards = workers.rewards
    elif cfg.reward.plugins:
        rewards = build_reward_service(
            cfg.reward, decode_images=model.codec.decode, resources=resources
        )
    sampler = PromptSampler(prompt_pools(cfg, model), cfg.data.task_weights, cfg.data.seed)
    source = OPDSource(model, teacher, sampler, rewards, cfg, info, workers)
    algo = cfg.algorithm
    assert isinstance(algo, OPDConfig), "build_opd_job of an OPD config"
    assert algo.teacher.path is not None, "the preflight requires algorithm.teacher.path"
    identity = teacher_identity(algo.teacher.path)
    return source, OPDObjective(algo, teacher, identity)
