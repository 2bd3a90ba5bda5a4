"""GRPO on the shared trainer: the objective, the reference policy and the job builder.

The batch comes from `GRPOSource` (rollouts, rewards, advantages; `unirl.train.methods.grpo.source`). For
each micro-batch the objective replays the policy at training geometry (one forward,
heads at scored positions only, `unirl.replay.replay_map`) and computes, per scored
position t of row i with advantage A_i (docs/numerics.md §5-7):

    L_t = −min(ρ_t·A_i, clip(ρ_t, 1 − ε_low, 1 + ε_high)·A_i)   [dual clip optional]
    ρ_t = exp(ℓ_t − ℓ°_t); BSQ visual positions: ρ and the clip per factor, L_t the mean
    over the L factors
    loss = aggregate(L) + β · aggregate(D),   D_t = k1 | k2 | k3 on the sampled action
    (per factor, averaged, for BSQ) or the full-distribution JSD to the reference

aggregated (`algorithm.aggregation`) with the global count of the whole batch.

`old_logp_source`: "rollout" takes ℓ° from the sampler's log-probs; "replay" takes it
from a replay at training geometry before the update. With one update per batch that
replay *is* this forward (ℓ° = ℓ.detach()), so ρ ≡ 1 and the clip fraction is 0 by
construction (logged as `policy/ratio_is_one_by_construction: 1`): the objective is
REINFORCE with a group baseline. With `updates_per_batch` K > 1 (replay only) the source
runs a separate no-grad replay at training geometry before the round's first update
(`anchor_old_logprobs`, as verl's compute_log_prob) and the rows carry it as `old_logp`
through all K updates (and in the round file), so every update's ratio is a real one
(`ratio_is_one_by_construction: 0`; ≈ 1 on the first). Either way the rollout-vs-replay
gap K3 (`k3_mismatch`, sampler vs current replay) is logged every update.

The reference is a frozen copy of the initial policy (the weights at job build, before
any resume), or — with LoRA — the same model with its adapters disabled (no second
model in memory).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

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
from unirl.config import UnirlConfig
from unirl.config.algorithms import GRPOConfig
from unirl.core.distributions import TextCategorical, blockwise_entropy, generalized_jsd
from unirl.core.trajectory import Trajectory, TrajectoryBatch
from unirl.core.types import Modality
from unirl.forward import scored_mask
from unirl.models.base import UnifiedModel
from unirl.replay import DistributionChunk, ReplayPlan, replay_logprobs, replay_map
from unirl.rollout import SamplingRecord
from unirl.train.dist.comm import DistInfo
from unirl.train.engine.batching import rank_micro_batches
from unirl.train.engine.build import set_adapters_enabled
from unirl.train.engine.protocols import Objective
from unirl.train.engine.trainer import autocast
from unirl.train.rollouts.stats import finalize_loss_stats


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


def _records(micro: TrajectoryBatch) -> list[SamplingRecord]:
    """The rows' sampling records (carried by the batch); ValueError naming a row without."""
    sampling = micro.sampling or [None] * len(micro)
    for sid, rec in zip(micro.sample_ids, sampling):
        if not isinstance(rec, SamplingRecord):
            raise ValueError(f"row {sid!r} carries no SamplingRecord: GRPO replays as sampled")
    return list(sampling)


class GRPOObjective(Objective):
    """The GRPO loss of a micro-batch (module docstring), from the micro-batch alone: the
    rows carry their advantages, sampling records and (later updates of a round) the
    anchor log-probs. Statistics are sums (`loss`) finalised into means (`finalize`)."""

    def __init__(self, algo: GRPOConfig, reference: Reference | None) -> None:
        self.algo = algo
        self.reference = reference

    def frozen_models(self) -> list[torch.nn.Module]:
        """The reference copy (none under LoRA: the policy with adapters off), which a
        sharded data-parallel wrapper shards with the policy."""
        frozen = self.reference.frozen if self.reference is not None else None
        return [frozen] if frozen is not None else []

    def count(self, batch: TrajectoryBatch) -> int:
        counts = LossCounts.from_mask(scored_mask(batch))
        return counts.n_tokens if self.algo.aggregation == "token_mean" else counts.n_seqs

    def _columns(self, batch: TrajectoryBatch, ref_plan: ReplayPlan | None):
        """Per chunk [n, C]: log-prob, entropy, (JSD to the reference), (BSQ factors). The
        reference's chunk is rebuilt from its hidden states inside the chunk (and again
        when backward recomputes it): one chunk of distributions alive at a time, and the
        categorical reductions over the vocabulary run a block of rows at a time
        (`unirl.core.distributions.generalized_jsd` at β = ½)."""
        bits = batch.is_bits

        def fn(chunk: DistributionChunk) -> torch.Tensor:
            dist, n = chunk.dist, len(chunk)
            if bits and chunk.modality == Modality.VISUAL:
                factors = dist.log_prob_factors(chunk.targets)
                logp = factors.sum(-1)
            else:
                logp = dist.log_prob(chunk.targets)
                factors = logp.new_zeros(n, batch.n_factors) if bits else None
            categorical = isinstance(dist, TextCategorical)
            if categorical:
                cols = [logp, blockwise_entropy(dist.log_probs)]
            else:
                with torch.no_grad():
                    cols = [logp, dist.entropy()]
            if ref_plan is not None:
                with self.reference.active():
                    ref = ref_plan.distribution(chunk.index, chunk.rows, chunk.cols)
                if categorical and isinstance(ref, TextCategorical):
                    cols.append(generalized_jsd(dist.log_probs, ref.log_probs, 0.5))
                else:
                    cols.append(jsd_penalty(dist, ref))
                del ref
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
            ref = replay_logprobs(
                ref_model,
                micro,
                records,
                chunk_size=self.algo.chunk_size,
                share_prefix=self.algo.share_prompt_prefix,
            )
        kl = kl_penalty(logp, ref.logp, kind)
        if factors is not None:
            kl = torch.where(visual, kl_penalty_factors(factors, ref.logp_factors, kind), kl)
        return kl

    def _old_logp(
        self, micro: TrajectoryBatch, logp: torch.Tensor, factors: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The ratio's denominator ℓ° (and per factor) and whether it is this forward
        itself: the sampler's log-probs (rollout); the anchor the rows carry (replay,
        `updates_per_batch` > 1: a separate replay before the round's first update); or
        this replay, detached (replay, one update per batch: ρ ≡ 1 by construction)."""
        if self.algo.old_logp_source == "rollout":
            return micro.rollout_logp, micro.rollout_logp_factors, False
        if micro.old_logp is not None:
            if micro.is_bits and micro.old_logp_factors is None:
                raise ValueError("BSQ rows carry old_logp without old_logp_factors")
            return micro.old_logp.to(logp), micro.old_logp_factors, False
        if self.algo.updates_per_batch > 1:
            raise ValueError(
                f"updates_per_batch={self.algo.updates_per_batch} with old_logp_source "
                f"replay: rows {micro.sample_ids[:3]} carry no anchor log-probs (old_logp)"
            )
        return logp.detach(), None if factors is None else factors.detach(), True

    def loss(
        self, model: UnifiedModel, micro: TrajectoryBatch, n_global: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.algo
        records = _records(micro)
        if micro.advantages is None:
            raise ValueError(f"rows {micro.sample_ids[:3]} carry no advantages")
        adv = micro.advantages.to(micro.token_ids.device)[:, None]
        scoring = micro.without_training_data()
        mask = scored_mask(micro)
        visual = mask & (micro.modality == Modality.VISUAL)
        ref_plan = None
        if a.kl.type == "jsd":
            with self.reference.active() as ref_model:
                ref_plan = ReplayPlan(
                    ref_model,
                    scoring,
                    records,
                    chunk_size=a.chunk_size,
                    share_prefix=a.share_prompt_prefix,
                )
        fn = self._columns(micro, ref_plan)
        out = replay_map(
            model, scoring, records, fn, chunk_size=a.chunk_size, share_prefix=a.share_prompt_prefix
        )
        logp, entropy = out[..., 0], out[..., 1].detach()
        jsd = out[..., 2] if ref_plan is not None else None
        factors = out[..., 3 if jsd is not None else 2 :] if micro.is_bits else None
        old, old_f, self_anchored = self._old_logp(micro, logp, factors)
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
        divergence = self._divergence(scoring, records, logp, factors, visual, jsd)
        loss, kl_loss, kl_sum = pg, 0.0, 0.0
        if divergence is not None:
            kl_term = a.kl.coef * aggregate(divergence, mask, a.aggregation, counts, a.horizon)
            loss = pg + kl_term
            kl_loss = float(kl_term.detach())
            kl_sum = float(divergence.detach()[mask].sum())
        n = int(mask.sum())
        k3 = float(k3_mismatch(micro.rollout_logp.double(), logp.detach().double(), mask)) * n
        return loss, {
            "n_rows": float(len(micro)),
            "n_self_anchored_rows": float(len(micro)) if self_anchored else 0.0,
            "n_positions": float(n),
            "n_text": float((mask & ~visual).sum()),
            "n_visual": float(visual.sum()),
            "pg_loss": float(pg.detach()),
            "kl_loss": kl_loss,
            "kl_sum": kl_sum,
            "entropy_text_sum": float(entropy[mask & ~visual].sum()),
            "entropy_visual_sum": float(entropy[visual].sum()),
            "ratio_sum": float(ratio[mask].sum()),
            "clipped": float(clipped[mask].sum()),
            "dual_clipped": float(dual[mask].sum()),
            "k3_sum": k3,
        }

    def finalize(self, sums: dict[str, float], n_global: int) -> dict[str, float]:
        """Means of the summed statistics (`policy/*`). `policy/ratio_is_one_by_construction`
        is 1 when every row's ratio denominator was its own forward (replay anchoring with
        one update per batch: REINFORCE with a group baseline), else 0."""
        return finalize_loss_stats(sums)


@torch.no_grad()
def anchor_old_logprobs(
    model: UnifiedModel, cfg: UnirlConfig, info: DistInfo, trajs: list[Trajectory]
) -> None:
    """Set `old_logp` (and `old_logp_factors`) on the rows this rank trains, from a no-grad
    replay at training geometry (this rank's micro-batches, the trainer's precision)
    before the round's first update: the ratio anchor of every update of the round
    (verl's compute_log_prob)."""
    for group in rank_micro_batches(trajs, info, cfg.trainer):
        batch = TrajectoryBatch.collate(group, model.special_ids.pad).to(model.device)
        records = _records(batch)
        with autocast(cfg.trainer, model.device):
            out = replay_logprobs(
                model,
                batch,
                records,
                chunk_size=cfg.algorithm.chunk_size,
                share_prefix=cfg.algorithm.share_prompt_prefix,
            )
        for b, traj in enumerate(group):
            n, device = len(traj), traj.token_ids.device
            traj.old_logp = out.logp[b, :n].to(device)
            if out.logp_factors is not None:
                traj.old_logp_factors = out.logp_factors[b, :n].to(device)
