"""GRPO on the shared trainer: the objective, the reference policy and the job builder.

The batch comes from `GRPOSource` (rollouts, rewards, advantages; `uniweave.train.methods.grpo.source`). For
each micro-batch the objective replays the policy at training geometry (one forward,
heads at scored positions only, `uniweave.replay.replay_map`) and computes, per scored
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

Rollout-training mismatch (docs/numerics.md §5a, §7a): Δ = ℓ° − ℓˢ, the replay at the
sampling parameters minus the sampler's log-prob. `surrogate: aligned` clips the replay
ratio exp(ℓ − ℓ°) and weights the loss by the constant exp(Δ), so its value is the ratio
to the sampler and its gradient the importance-weighted score function. The guards
(`mismatch.replay_bound` per row, `mismatch.percentile` against a threshold computed in
`begin_update` from the whole global batch, all ranks) zero the masked actions' loss,
the counts unchanged. The diagnostics (`mismatch/*`) are sums plus nearest-rank quantiles
of |Δ| over the whole global batch, whose populations `loss` keeps and `finalize`
gathers over ranks.

The reference is a frozen copy of the initial policy (the weights at job build, before
any resume), or — with LoRA from scratch — the same model with its adapters disabled (no
second model in memory); a run started from `model.initial_adapter` has base + adapter
as its initial policy, so its reference is a frozen copy of that.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from uniweave.algorithms.grpo import (
    AlignedSurrogate,
    LossCounts,
    Surrogate,
    aggregate,
    aligned_surrogate,
    aligned_surrogate_factors,
    clipped_surrogate,
    clipped_surrogate_factors,
    jsd_penalty,
    k3_mismatch,
    kl_penalty,
    kl_penalty_factors,
    mismatch_delta,
    percentile_keep,
    replay_bound_keep,
    sequence_k3,
)
from uniweave.config import UniweaveConfig
from uniweave.config.algorithms import GRPOConfig
from uniweave.core.distributions import (
    TextCategorical,
    VisualBits,
    blockwise_entropy,
    generalized_jsd,
)
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.forward import scored_mask
from uniweave.models.base import UnifiedModel
from uniweave.replay import DistributionChunk, ReplayPlan, replay_logprobs, replay_map
from uniweave.rollout import SamplingRecord
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.batching import rank_micro_batches
from uniweave.train.engine.forward_mode import autocast
from uniweave.train.engine.lora import set_adapters_enabled
from uniweave.train.engine.protocols import Objective
from uniweave.train.methods.grpo.mismatch import global_threshold, population_quantiles
from uniweave.train.onpolicy.stats import finalize_loss_stats


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
                assert self.frozen is not None, "a reference without LoRA holds a frozen copy"
                yield self.frozen
                return
            set_adapters_enabled(self.policy, False)
            try:
                yield self.policy
            finally:
                set_adapters_enabled(self.policy, True)


@dataclass
class _Terms:
    """Per-position surrogate terms of a micro-batch [B, T]: the loss; the trust-region
    ratio r and the clipped / dual-clipped shares (BSQ: factor means); whether ℓ° is this
    forward; the replay at the sampling parameters ℓ° (detached); aligned only: the
    sampler weight w, the aligned ratio w·r and the unweighted loss L(r)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    dual: torch.Tensor
    self_anchored: bool
    old_replay: torch.Tensor
    weight: torch.Tensor | None
    aligned_ratio: torch.Tensor | None
    base: torch.Tensor | None


def _replay(model: UnifiedModel, batch: TrajectoryBatch, records, algo: GRPOConfig):
    """A replay of `batch` as GRPO replays it (the algorithm's chunk size
    and prompt-prefix sharing): the reference's log-probs and the anchor's."""
    return replay_logprobs(
        model, batch, records, chunk_size=algo.chunk_size, share_prefix=algo.share_prompt_prefix
    )


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
        self._dist = DistInfo()
        self._threshold: float | None = None
        self._abs_delta: list[torch.Tensor] = []
        self._row_abs_delta: list[torch.Tensor] = []

    def begin_update(self, update: int, micros: list[TrajectoryBatch], dist: DistInfo) -> None:
        """Start an update: clear the mismatch populations gathered by `loss`, remember the
        process group (`finalize` gathers the populations over ranks), and with
        `mismatch.percentile` compute the update's global |Δ| threshold from the anchor the
        rows carry (every scored action of every micro-batch of every rank, all-gathered)."""
        self._dist = dist
        self._abs_delta, self._row_abs_delta = [], []
        self._threshold = None
        p = self.algo.mismatch.percentile
        if p is None:
            return
        local = []
        for micro in micros:
            if micro.old_logp is None:
                raise ValueError(
                    f"mismatch.percentile: rows {micro.sample_ids[:3]} carry no replay anchor "
                    "(old_logp); the GRPO source anchors them when the guard is on"
                )
            mask = scored_mask(micro)
            delta = mismatch_delta(micro.old_logp, micro.need("rollout_logp"), mask)
            local.append(delta[mask].abs().cpu())
        self._threshold = global_threshold(local, p, dist)

    def _reference(self) -> Reference:
        """The reference policy (the objective has one when a KL or JSD penalty is on)."""
        assert self.reference is not None, "a KL/JSD penalty needs the reference policy"
        return self.reference

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
        (`uniweave.core.distributions.generalized_jsd` at β = ½)."""
        bits = batch.is_bits

        def fn(chunk: DistributionChunk) -> torch.Tensor:
            dist, n = chunk.dist, len(chunk)
            factors: torch.Tensor | None
            if bits and chunk.modality == Modality.VISUAL:
                assert isinstance(dist, VisualBits), "BSQ visual positions are bits"
                factors = dist.log_prob_factors(chunk.targets)
                logp = factors.sum(-1)
            else:
                logp = dist.log_prob(chunk.targets)
                factors = logp.new_zeros(n, batch.n_factors) if bits else None
            if isinstance(dist, TextCategorical):
                cols = [logp, blockwise_entropy(dist.log_probs)]
            else:
                with torch.no_grad():
                    cols = [logp, dist.entropy()]
            if ref_plan is not None:
                with self._reference().active():
                    ref = ref_plan.distribution(chunk.index, chunk.rows, chunk.cols)
                if isinstance(dist, TextCategorical) and isinstance(ref, TextCategorical):
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
        with self._reference().active() as ref_model:
            ref = _replay(ref_model, micro, records, self.algo)
        kl = kl_penalty(logp, ref.logp, kind)
        if factors is not None:
            kl = torch.where(visual, kl_penalty_factors(factors, ref.logp_factors, kind), kl)
        return kl

    def _replay_old(
        self, micro: TrajectoryBatch, logp: torch.Tensor, factors: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The replay at the sampling parameters ℓ° (and per factor), and whether it is this
        forward itself: the anchor the rows carry (a separate no-grad replay before the
        round's first update: `updates_per_batch` > 1, or the percentile guard), else this
        replay, detached (one update per batch: the parameters have not moved)."""
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

    def _old_logp(
        self, micro: TrajectoryBatch, logp: torch.Tensor, factors: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The ratio's denominator ℓ° (and per factor) and whether it is this forward
        itself: the sampler's log-probs (rollout); the anchor the rows carry (replay,
        `updates_per_batch` > 1: a separate replay before the round's first update); or
        this replay, detached (replay, one update per batch: ρ ≡ 1 by construction)."""
        if self.algo.old_logp_source == "rollout":
            return micro.need("rollout_logp"), micro.rollout_logp_factors, False
        return self._replay_old(micro, logp, factors)

    def _surrogate(
        self,
        micro: TrajectoryBatch,
        logp: torch.Tensor,
        factors: torch.Tensor | None,
        adv: torch.Tensor,
        visual: torch.Tensor,
    ) -> _Terms:
        """The surrogate's per-position terms (docs/numerics.md §5, §5a)."""
        a = self.algo
        clip = (a.clip_low, a.clip_high, a.dual_clip)
        old_r, old_rf, self_r = self._replay_old(micro, logp, factors)
        surr: Surrogate | AlignedSurrogate
        if a.surrogate == "standard":
            old, old_f, self_anchored = self._old_logp(micro, logp, factors)
            surr = clipped_surrogate(logp, old, adv, *clip)
            weight = base = None
        else:
            old, old_f, self_anchored = old_r, old_rf, self_r
            aligned = aligned_surrogate(logp, old, micro.need("rollout_logp").to(logp), adv, *clip)
            surr, weight, base = aligned, aligned.weight, aligned.base_loss
        t = _Terms(
            surr.loss,
            surr.ratio,
            surr.clipped.double(),
            surr.dual_clipped.double(),
            self_anchored,
            old_r,
            weight,
            None if weight is None else weight * surr.ratio,
            base,
        )
        if factors is None:
            return t
        assert old_f is not None, "BSQ rows carry per-factor old log-probs"
        sf: Surrogate | AlignedSurrogate
        if a.surrogate == "standard":
            sf = clipped_surrogate_factors(factors, old_f, adv, *clip)
        else:
            sampled_f = micro.need("rollout_logp_factors").to(factors)
            asf = aligned_surrogate_factors(factors, old_f, sampled_f, adv, *clip)
            assert t.weight is not None and t.aligned_ratio is not None and t.base is not None
            t.weight = torch.where(visual, asf.weight.mean(-1), t.weight)
            t.aligned_ratio = torch.where(
                visual, (asf.weight * asf.ratio).mean(-1), t.aligned_ratio
            )
            t.base = torch.where(visual, asf.base_loss, t.base)
            sf = asf
        t.loss = torch.where(visual, sf.loss, t.loss)
        t.ratio = torch.where(visual, sf.ratio.mean(-1), t.ratio)
        t.clipped = torch.where(visual, sf.clipped.double().mean(-1), t.clipped)
        t.dual = torch.where(visual, sf.dual_clipped.double().mean(-1), t.dual)
        return t

    def _guards(
        self, micro: TrajectoryBatch, delta: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The scored actions the mismatch guards keep (None with both off) and the masked
        counts: the replay bound per row, the percentile at the update's global threshold."""
        m = self.algo.mismatch
        if m.replay_bound is None and m.percentile is None:
            return None, {}
        keep = mask.clone()
        stats: dict[str, float] = {}
        if m.replay_bound is not None:
            rows = replay_bound_keep(delta, mask, m.replay_bound)
            out = ~rows & mask.any(-1)
            stats["bound_masked_rows"] = float(out.sum())
            stats["bound_masked_actions"] = float(mask[out].sum())
            keep &= rows[:, None]
        if m.percentile is not None:
            if self._threshold is None:
                raise RuntimeError("mismatch.percentile: begin_update was not called this update")
            below = percentile_keep(delta, mask, self._threshold)
            stats["percentile_masked_actions"] = float((mask & ~below).sum())
            keep &= below
        stats["masked_actions"] = float((mask & ~keep).sum())
        return keep, stats

    def _mismatch_stats(
        self, micro: TrajectoryBatch, logp, old_r, delta: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """Sums of the separated diagnostics (sampled, replay and current log-probs, K3 per
        action and per sequence); the |Δ| per action and the mean |Δ| per row are kept for
        `finalize`'s global quantiles."""
        rows = mask.any(-1)
        abs_delta = delta.abs()
        self._abs_delta.append(abs_delta[mask].cpu())
        row_mean = abs_delta.sum(-1) / mask.sum(-1).clamp(min=1)
        self._row_abs_delta.append(row_mean[rows].cpu())
        k3 = kl_penalty(torch.zeros_like(delta), delta, "k3")
        return {
            "logp_sampled_sum": float(micro.need("rollout_logp").double()[mask].sum()),
            "logp_replay_sum": float(old_r.detach().double()[mask].sum()),
            "logp_sum": float(logp.detach().double()[mask].sum()),
            "mismatch_k3_sum": float(k3[mask].sum()),
            "mismatch_k3_seq_sum": float(sequence_k3(delta, mask)[rows].sum()),
            "abs_delta_sum": float(abs_delta[mask].sum()),
            "n_scored_rows": float(rows.sum()),
        }

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
            with self._reference().active() as ref_model:
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
        t = self._surrogate(micro, logp, factors, adv, visual)
        anchor = micro.old_logp if micro.old_logp is not None else t.old_replay
        delta = mismatch_delta(anchor, micro.need("rollout_logp"), mask)
        keep, guard_stats = self._guards(micro, delta, mask)
        per_pos = t.loss
        if keep is not None:
            per_pos = torch.where(keep, per_pos, torch.zeros_like(per_pos))
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
        k3 = (
            float(k3_mismatch(micro.need("rollout_logp").double(), logp.detach().double(), mask))
            * n
        )
        return loss, {
            "n_rows": float(len(micro)),
            "n_self_anchored_rows": float(len(micro)) if t.self_anchored else 0.0,
            "n_positions": float(n),
            "n_text": float((mask & ~visual).sum()),
            "n_visual": float(visual.sum()),
            "pg_loss": float(pg.detach()),
            "kl_loss": kl_loss,
            "kl_sum": kl_sum,
            "entropy_text_sum": float(entropy[mask & ~visual].sum()),
            "entropy_visual_sum": float(entropy[visual].sum()),
            "ratio_sum": float(t.ratio[mask].sum()),
            "clipped": float(t.clipped[mask].sum()),
            "dual_clipped": float(t.dual[mask].sum()),
            "k3_sum": k3,
            **self._mismatch_stats(micro, logp, t.old_replay, delta, mask),
            **guard_stats,
            **self._aligned_stats(t, keep, mask, counts),
        }

    def _aligned_stats(
        self, t: _Terms, keep: torch.Tensor | None, mask: torch.Tensor, counts: LossCounts
    ) -> dict[str, float]:
        """Aligned surrogate only: sums of w and of the aligned ratio w·r, and the unweighted
        loss L(r) (the same guards and aggregation), to compare with `pg_loss`."""
        if t.weight is None:
            return {}
        assert t.base is not None and t.aligned_ratio is not None, "aligned terms come together"
        a = self.algo
        base = t.base.detach()
        if keep is not None:
            base = torch.where(keep, base, torch.zeros_like(base))
        unweighted = aggregate(base, mask, a.aggregation, counts, a.horizon)
        return {
            "aligned_weight_sum": float(t.weight.double()[mask].sum()),
            "aligned_ratio_sum": float(t.aligned_ratio.detach().double()[mask].sum()),
            "pg_loss_unaligned": float(unweighted),
        }

    def finalize(self, sums: dict[str, float], n_global: int) -> dict[str, float]:
        """Means of the summed statistics (`policy/*`). `policy/ratio_is_one_by_construction`
        is 1 when every row's ratio denominator was its own forward (replay anchoring with
        one update per batch: REINFORCE with a group baseline), else 0. The mismatch
        diagnostics (`mismatch/*`, docs/numerics.md §7a) add the quantiles of |Δ| over every
        scored action and row of the global batch, gathered here over ranks (a collective:
        every rank calls `finalize`)."""
        out = finalize_loss_stats(sums)
        n = max(sums["n_positions"], 1.0)
        n_rows = max(sums["n_scored_rows"], 1.0)
        out.update(
            {
                "mismatch/logp_sampled_mean": sums["logp_sampled_sum"] / n,
                "mismatch/logp_replay_mean": sums["logp_replay_sum"] / n,
                "policy/logp_mean": sums["logp_sum"] / n,
                "mismatch/k3": sums["mismatch_k3_sum"] / n,
                "mismatch/k3_seq": sums["mismatch_k3_seq_sum"] / n_rows,
                "mismatch/abs_dlogp_mean": sums["abs_delta_sum"] / n,
            }
        )
        out.update(population_quantiles("abs_dlogp", self._abs_delta, self._dist))
        out.update(population_quantiles("row_abs_dlogp", self._row_abs_delta, self._dist))
        self._abs_delta, self._row_abs_delta = [], []
        m = self.algo.mismatch
        if m.replay_bound is not None:
            out["mismatch/bound_masked_rows"] = sums["bound_masked_rows"]
            out["mismatch/bound_masked_row_share"] = sums["bound_masked_rows"] / n_rows
            out["mismatch/bound_masked_share"] = sums["bound_masked_actions"] / n
        if m.percentile is not None:
            assert self._threshold is not None, "begin_update sets the percentile threshold"
            out["mismatch/percentile_threshold"] = float(self._threshold)
            out["mismatch/percentile_masked_actions"] = sums["percentile_masked_actions"]
            out["mismatch/percentile_masked_share"] = sums["percentile_masked_actions"] / n
        if m.replay_bound is not None or m.percentile is not None:
            out["mismatch/masked_actions"] = sums["masked_actions"]
            out["mismatch/masked_share"] = sums["masked_actions"] / n
        if self.algo.surrogate == "aligned":
            out["policy/aligned_weight_mean"] = sums["aligned_weight_sum"] / n
            out["policy/aligned_ratio_mean"] = sums["aligned_ratio_sum"] / n
            out["policy/pg_loss_unaligned"] = sums["pg_loss_unaligned"]
        return out


@torch.no_grad()
def anchor_old_logprobs(
    model: UnifiedModel, cfg: UniweaveConfig, info: DistInfo, trajs: list[Trajectory]
) -> None:
    """Set `old_logp` (and `old_logp_factors`) on the rows this rank trains, from a no-grad
    replay at training geometry (this rank's micro-batches, the trainer's precision)
    before the round's first update: the ratio anchor of every update of the round
    (verl's compute_log_prob)."""
    algo = cfg.algorithm
    assert isinstance(algo, GRPOConfig), "the GRPO anchor of a GRPO config"
    for group in rank_micro_batches(trajs, info, cfg.trainer):
        batch = TrajectoryBatch.collate(group, model.special_ids.pad).to(model.device)
        records = _records(batch)
        with autocast(cfg.trainer, model.device):
            out = _replay(model, batch, records, algo)
        for b, traj in enumerate(group):
            n, device = len(traj), traj.token_ids.device
            traj.old_logp = out.logp[b, :n].to(device)
            if out.logp_factors is not None:
                traj.old_logp_factors = out.logp_factors[b, :n].to(device)
