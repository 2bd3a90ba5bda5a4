"""GRPO on the shared trainer: the objective, the reference policy and the job builder.

The batch comes from `GRPOSource` (rollouts, rewards, advantages; `grpo_source`). For
each micro-batch the objective replays the policy at training geometry (one forward,
heads at scored positions only, `unirl.replay.replay_map`) and computes, per scored
position t of row i with advantage A_i (NUMERICS "Clipped surrogate" .. "KL"):

    L_t = −min(ρ_t·A_i, clip(ρ_t, 1 − ε_low, 1 + ε_high)·A_i)   [dual clip optional]
    ρ_t = exp(ℓ_t − ℓ°_t); BSQ visual positions: ρ and the clip per factor, L_t the mean
    over the L factors
    loss = aggregate(L) + β · aggregate(D),   D_t = k1 | k2 | k3 on the sampled action
    (per factor, averaged, for BSQ) or the full-distribution JSD to the reference

aggregated (`algorithm.aggregation`) with the global count of the whole batch.

`old_logp_source`: "rollout" takes ℓ° from the sampler's log-probs; "replay" takes it
from the replay at training geometry before the update. On the first update of a rollout
batch that *is* this forward (ℓ° = ℓ.detach()), so ρ ≡ 1 and the clip fraction is 0 by
construction (logged as `policy/ratio_is_one_by_construction: 1`): with one update per
batch the objective is REINFORCE with a group baseline. With `updates_per_batch` K > 1
(replay only) the first update records ℓ° per sample and the next K − 1 updates of the
same batch use it, so their ratios and clipping are real. Either way the
rollout-vs-replay gap K3 (`k3_mismatch`, sampler vs current replay) is logged every
update.

The reference is a frozen copy of the initial policy (the weights at job build, before
any resume), or — with LoRA — the same model with its adapters disabled (no second
model in memory).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from unirl.algorithms.grpo import (
    LossCounts,
    aggregate,
    clipped_surrogate,
    clipped_surrogate_factors,
    jsd_penalty,
    k3_mismatch,
    kl_penalty,
    kl_penalty_factors,
)
from unirl.config import ConfigError, UnirlConfig
from unirl.config.algorithms import GRPOConfig
from unirl.core.sample import Sample
from unirl.core.trajectory import TrajectoryBatch
from unirl.core.types import Modality
from unirl.data.digits import make_task_samples
from unirl.data.digits_images import load_split
from unirl.data.loader import load_dataset
from unirl.forward import scored_indices
from unirl.models.base import UnifiedModel
from unirl.replay import DistributionChunk, replay_distributions, replay_logprobs, replay_map
from unirl.rewards import build_reward_service
from unirl.rollout.config import sampling_params
from unirl.train.build import set_adapters_enabled
from unirl.train.distributed import DistInfo, barrier
from unirl.train.evaluate import CLASSIFIER_DIR, load_or_fit_classifier
from unirl.train.grpo_metrics import LOSS_STAT_KEYS, StepStats
from unirl.train.grpo_source import GRPOSource, PromptSampler, Rollout, SourceSettings


class Reference:
    """The reference policy: a frozen copy, or the LoRA-disabled base of `policy`."""

    def __init__(self, policy: UnifiedModel, lora: bool) -> None:
        self.policy = policy
        self.lora = lora
        self.frozen = None
        if not lora:
            self.frozen = copy.deepcopy(policy).eval()
            for p in self.frozen.parameters():
                p.requires_grad_(False)

    @contextmanager
    def active(self) -> Iterator[UnifiedModel]:
        """The reference model, under no_grad (adapters switched off for its duration)."""
        with torch.no_grad():
            if not self.lora:
                yield self.frozen
                return
            set_adapters_enabled(self.policy, False)
            try:
                yield self.policy
            finally:
                set_adapters_enabled(self.policy, True)


def scored_mask(batch: TrajectoryBatch) -> torch.Tensor:
    """bool [B, T]: the scored (policy-owned, t >= 1) positions."""
    text, visual = scored_indices(batch)
    mask = torch.zeros(batch.token_ids.shape, dtype=torch.bool, device=batch.token_ids.device)
    mask[text.rows, text.cols] = True
    mask[visual.rows, visual.cols] = True
    return mask


class GRPOObjective:
    """The GRPO loss of a micro-batch (module docstring); statistics go to `source.stats`."""

    def __init__(self, source: GRPOSource, algo: GRPOConfig, reference: Reference | None) -> None:
        self.source = source
        self.algo = algo
        self.reference = reference

    def count(self, batch: TrajectoryBatch) -> int:
        counts = LossCounts.from_mask(scored_mask(batch))
        return counts.n_tokens if self.algo.aggregation == "token_mean" else counts.n_seqs

    def _columns(self, batch: TrajectoryBatch, ref_chunks: list[DistributionChunk] | None):
        """Per chunk [n, C]: log-prob, entropy, (JSD to the reference), (BSQ factors)."""
        bits = batch.is_bits

        def fn(chunk: DistributionChunk) -> torch.Tensor:
            dist, n = chunk.dist, len(chunk)
            if bits and chunk.modality == Modality.VISUAL:
                factors = dist.log_prob_factors(chunk.targets)
                logp = factors.sum(-1)
            else:
                logp = dist.log_prob(chunk.targets)
                factors = logp.new_zeros(n, batch.n_factors) if bits else None
            cols = [logp, dist.entropy().detach()]
            if ref_chunks is not None:
                ref = ref_chunks[chunk.index]
                if not (torch.equal(ref.rows, chunk.rows) and torch.equal(ref.cols, chunk.cols)):
                    raise RuntimeError("reference and policy replay chunks are not aligned")
                cols.append(jsd_penalty(dist, ref.dist))
            out = torch.stack(cols, -1)
            return out if factors is None else torch.cat([out, factors], -1)

        return fn

    def _divergence(
        self, micro: TrajectoryBatch, records, logp, factors, visual, jsd
    ) -> torch.Tensor | None:
        kind = self.algo.kl.type
        if kind == "none":
            return None
        if kind == "jsd":
            return jsd
        with self.reference.active() as ref_model:
            ref = replay_logprobs(ref_model, micro, records, chunk_size=self.algo.chunk_size)
        kl = kl_penalty(logp, ref.logp, kind)
        if factors is not None:
            kl = torch.where(visual, kl_penalty_factors(factors, ref.logp_factors, kind), kl)
        return kl

    def _old_logp(
        self,
        micro: TrajectoryBatch,
        rollout: Rollout,
        logp: torch.Tensor,
        factors: torch.Tensor | None,
        update: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ratio's denominator ℓ° (and per factor): the sampler's log-probs, or this
        replay on the first update of a rollout batch (recorded for its later updates),
        or the replay recorded then."""
        if self.algo.old_logp_source == "rollout":
            return micro.rollout_logp, micro.rollout_logp_factors
        if self.source.first_of_round(update):
            if self.source.s.updates_per_batch > 1:
                for b, sid in enumerate(micro.sample_ids):
                    n = int(micro.lengths[b])
                    f = None if factors is None else factors[b, :n].detach().cpu().clone()
                    rollout.old_logp[sid] = (logp[b, :n].detach().cpu().clone(), f)
            return logp.detach(), None if factors is None else factors.detach()
        old = torch.zeros_like(logp)
        old_f = None if factors is None else torch.zeros_like(factors)
        for b, sid in enumerate(micro.sample_ids):
            lp, f = rollout.old_logp[sid]
            old[b, : lp.numel()] = lp.to(old)
            if old_f is not None:
                old_f[b, : lp.numel()] = f.to(old_f)
        return old, old_f

    def loss(
        self, model: UnifiedModel, micro: TrajectoryBatch, n_global: int, update: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.algo
        rollout = self.source.rollout(update)
        records = [rollout.records[sid] for sid in micro.sample_ids]
        device = micro.token_ids.device
        adv = torch.tensor([rollout.advantages[sid] for sid in micro.sample_ids], device=device)
        adv = adv[:, None]
        mask = scored_mask(micro)
        visual = mask & (micro.modality == Modality.VISUAL)
        ref_chunks = None
        if a.kl.type == "jsd":
            with self.reference.active() as ref_model:
                ref_chunks = list(
                    replay_distributions(ref_model, micro, records, chunk_size=a.chunk_size)
                )
        fn = self._columns(micro, ref_chunks)
        out = replay_map(model, micro, records, fn, chunk_size=a.chunk_size)
        logp, entropy = out[..., 0], out[..., 1].detach()
        jsd = out[..., 2] if ref_chunks is not None else None
        factors = out[..., 3 if jsd is not None else 2 :] if micro.is_bits else None
        old, old_f = self._old_logp(micro, rollout, logp, factors, update)
        clip = (a.clip_low, a.clip_high, a.dual_clip)
        surr = clipped_surrogate(logp, old, adv, *clip)
        per_pos, ratio = surr.loss, surr.ratio
        clipped, dual = surr.clipped.double(), surr.dual_clipped.double()
        if factors is not None:
            sf = clipped_surrogate_factors(factors, old_f, adv, *clip)
            per_pos = torch.where(visual, sf.loss, per_pos)
            ratio = torch.where(visual, sf.ratio.mean(-1), ratio)
            clipped = torch.where(visual, sf.clipped.double().mean(-1), clipped)
            dual = torch.where(visual, sf.dual_clipped.double().mean(-1), dual)
        counts = LossCounts(n_global, n_global)
        pg = aggregate(per_pos, mask, a.aggregation, counts, a.horizon)
        divergence = self._divergence(micro, records, logp, factors, visual, jsd)
        loss, kl_loss, kl_sum = pg, 0.0, 0.0
        if divergence is not None:
            kl_term = a.kl.coef * aggregate(divergence, mask, a.aggregation, counts, a.horizon)
            loss = pg + kl_term
            kl_loss = float(kl_term.detach())
            kl_sum = float(divergence.detach()[mask].sum())
        n = int(mask.sum())
        k3 = float(k3_mismatch(micro.rollout_logp.double(), logp.detach().double(), mask)) * n
        self.source.stats.add(
            update,
            {
                "n_positions": n,
                "n_text": int((mask & ~visual).sum()),
                "n_visual": int(visual.sum()),
                "pg_loss": float(pg.detach()),
                "kl_loss": kl_loss,
                "kl_sum": kl_sum,
                "entropy_text_sum": float(entropy[mask & ~visual].sum()),
                "entropy_visual_sum": float(entropy[visual].sum()),
                "ratio_sum": float(ratio[mask].sum()),
                "clipped": float(clipped[mask].sum()),
                "dual_clipped": float(dual[mask].sum()),
                "k3_sum": k3,
            },
        )
        return loss, {}


def prompt_pools(cfg: UnirlConfig, image_size: tuple[int, int] = (8, 8)) -> dict[str, list[Sample]]:
    """Training prompts per task: `data.path` rows of each task (images must have the
    model's `image_size`), or the built-in digits tasks on the train split
    (`data.train_size` per task, 0 = one per train image)."""
    tasks = list(cfg.data.tasks)
    if cfg.data.path:
        rows = load_dataset(cfg.data.path, image_size=image_size)
        return {t: [s for s in rows if s.task == t] for t in tasks}
    n = cfg.data.train_size or len(load_split("train"))
    return {t: make_task_samples(t, "train", n, seed=cfg.data.seed) for t in tasks}


def _needs_classifier(cfg: UnirlConfig) -> bool:
    return any(
        p.path is None
        and (p.name == "digit_classifier" or bool(p.kwargs.get("require_image_class")))
        for p in cfg.reward.plugins
    )


def _classifier(run_dir: Path, info: DistInfo):
    """The run's digits classifier (fitted once by rank 0, then loaded by the others)."""
    if info.is_main:
        load_or_fit_classifier(run_dir / CLASSIFIER_DIR)
    barrier(info)
    return load_or_fit_classifier(run_dir / CLASSIFIER_DIR)


def source_settings(cfg: UnirlConfig, model: UnifiedModel) -> SourceSettings:
    """Prompts per update, batch sizes, seeds and the rows' `SamplingParams`."""
    r, algo = cfg.rollout, cfg.algorithm
    grid = tuple(model.codec.grid)
    if r.length_semantics == "exact" and r.max_new_tokens != grid[0] * grid[1]:
        raise ConfigError(
            f"length_semantics 'exact' forces an image of the codec's {grid[0]}x{grid[1]} "
            f"grid: max_new_tokens must be {grid[0] * grid[1]}, got {r.max_new_tokens}",
            key="rollout.max_new_tokens",
        )
    params = sampling_params(r)
    return SourceSettings(
        group_size=algo.group_size,
        n_prompts=cfg.trainer.global_batch_size // algo.group_size,
        batch_size=r.batch_size,
        run_seed=cfg.run.seed,
        text_params=params,
        image_params=params,
        image_grid=grid,
        updates_per_batch=algo.updates_per_batch,
    )


def build_grpo_job(
    cfg: UnirlConfig, model: UnifiedModel, run_dir: Path, info: DistInfo
) -> tuple[GRPOSource, GRPOObjective]:
    """GRPO: rollouts + rewards as the batch source, the clipped surrogate as objective.

    Call before the trainer resumes: the reference is the model as given (the initial
    policy, e.g. the SFT checkpoint of `model.path`)."""
    algo = cfg.algorithm
    resources = {"digit_classifier": _classifier(run_dir, info)} if _needs_classifier(cfg) else {}
    rewards = build_reward_service(
        cfg.reward, decode_images=model.codec.decode, resources=resources
    )
    image_size = tuple(getattr(model.codec, "image_size", (8, 8)))
    sampler = PromptSampler(prompt_pools(cfg, image_size), cfg.data.task_weights, cfg.data.seed)
    stats = StepStats(LOSS_STAT_KEYS)
    settings = source_settings(cfg, model)
    source = GRPOSource(model, sampler, rewards, algo, settings, info, stats, run_dir)
    reference = Reference(model, cfg.trainer.lora.enabled) if algo.kl.type != "none" else None
    return source, GRPOObjective(source, algo, reference)
