"""SFT: a dataset cursor as the batch source and the cross-entropy objective.

The batch of update u is a pure function of (data seed, u): the rows are walked through a
fresh permutation per epoch, so the data cursor is the update counter and a resumed run
continues the exact order. Each row of update u carries the stateless seed
`seed_for(run seed, u, crc32(sample id), 0)` of its input noise (BitFlip).
"""

from __future__ import annotations

import torch

from uniweave.algorithms.sft import (
    SFTTerms,
    bitflip,
    bitflip_rates,
    half_partition,
    sft_loss,
    soft_bsq_distances,
    text_ce,
    visual_ce,
)
from uniweave.config.algorithms import SFTConfig
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.forward import ForwardOutput, forward_interleaved, scored_indices
from uniweave.models.base import UnifiedModel
from uniweave.train.distributed.comm import DistInfo, all_gather_objects, all_reduce_sum
from uniweave.train.engine.ema import EMA
from uniweave.train.engine.forward_mode import draws_dropout
from uniweave.train.engine.protocols import Objective
from uniweave.train.methods.sft.information_gain import (
    IGTerms,
    contributing_rows,
    eval_mode,
    finalize_sums,
    full_logp,
    ig_terms,
)
from uniweave.train.methods.sft.necessity import Carriers, finalize_nd, nd_terms, teacher_carriers


class SFTObjective(Objective):
    """Text CE + λ_visual · visual CE over the global count of scored positions, with
    optional BitFlip noise on the visual inputs drawn from each row's seed, plus
    `information_gain.weight` · L_IG (`uniweave.algorithms.information_gain`).

    IG: the full view is the SFT forward itself (one backbone call gives text CE, visual
    CE and the full scores) when that forward is clean — no BitFlip, no active dropout;
    otherwise the IG rows get their own clean eval-mode forward (with gradient). Blind
    views are detached (`train.information_gain.blind_scores`). L_IG is the
    trajectory-first mean over the *global* batch's contributing rows and the cycle index
    is the update number, both set by `begin_update` (the trainer calls it before the
    micro-batches), so neither depends on the split of the batch nor on a resume.

    BitFlip `partition: half`: `begin_update` gathers the global batch's row seeds (all
    ranks) and keeps the set `half_partition` chooses; a chosen row gets exactly the noise
    it would get under `all` (same generator, same draws), every other row stays clean.
    With IG on, IG scores the clean rows only; `student_full_view` fused takes their full
    view from the SFT forward (one backbone call for noisy SFT rows and clean IG rows),
    sequential runs a separate eval-mode forward of the clean rows.

    Soft-BSQ (`soft_bsq.weight` λ > 0): + λ · Σ_p ‖F(ĉ_p) − sg F(c_p)‖² / N_visual over
    the SFT forward's scored visual positions (`uniweave.algorithms.sft.soft_bsq_distances`),
    N_visual the global batch's count (`begin_update`), F the codec's frozen
    `feature_projection`.

    EMA Necessity distillation (`necessity_distillation.weight` λ > 0;
    `train.methods.sft.necessity`): `begin_update` scores every micro-batch with the EMA
    shadow (fused 11/10 views, no grad), keeps its carriers and teacher logits, and counts
    the global batch's rows with carriers; `loss` adds λ · Σ_i mean_{p ∈ C_i} D_p / that
    count; `after_step` moves the shadow; `state_dict` carries it through checkpoints.
    The shadow starts as the parameters at the first update of the run (after a resume's
    or a parent's weights are loaded).
    """

    def __init__(self, cfg: SFTConfig, model: UnifiedModel | None = None) -> None:
        self.cfg = cfg
        self.ig = cfg.information_gain
        self.cycle_index = 0
        self.ig_rows_global = 0
        self.half = cfg.bitflip.probability > 0 and cfg.bitflip.partition == "half"
        self.noised_seeds: frozenset[int] | None = None
        self.batch_seeds: frozenset[int] = frozenset()
        self.soft_bsq = cfg.soft_bsq.weight
        self.visual_global = 0
        self._projection: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.nd = cfg.necessity_distillation
        self.model = model
        self.ema = EMA(self.nd.ema_decay) if self.nd.weight > 0 else None
        if self.ema is not None and model is None:
            raise ValueError("necessity distillation: SFTObjective needs the trained model")
        self._carriers: list[Carriers] = []
        self.nd_rows_global = 0

    def begin_update(self, update: int, micros: list[TrajectoryBatch], dist: DistInfo) -> None:
        """Cycle index = `update`; the global count of rows contributing IG events; under
        BitFlip `partition: half`, the seeds of the noised rows of the global batch."""
        self.cycle_index = update
        if self.half:
            local = [s for m in micros for s in _row_seeds(m)]
            every = [s for part in all_gather_objects(local, dist) for s in part]
            self.batch_seeds = frozenset(every)
            self.noised_seeds = half_partition(every)
        if self.soft_bsq > 0:
            n_visual = sum(len(scored_indices(m)[1]) for m in micros)
            self.visual_global = int(all_reduce_sum(torch.tensor(float(n_visual)), dist).item())
        if self.ema is not None:
            self._score_carriers(micros, dist)
        if self.ig.weight <= 0:
            return
        n_rows = sum(contributing_rows(m, self.ig, update, self.ig_rows(m)) for m in micros)
        self.ig_rows_global = int(all_reduce_sum(torch.tensor(float(n_rows)), dist).item())

    def _score_carriers(self, micros: list[TrajectoryBatch], dist: DistInfo) -> None:
        assert self.ema is not None and self.model is not None
        if not self.ema.ready:
            self.ema.attach(self.model)
        self._carriers = [teacher_carriers(self.model, self.ema, m, self.nd) for m in micros]
        local = sum(c.n_rows for c in self._carriers)
        self.nd_rows_global = int(all_reduce_sum(torch.tensor(float(local)), dist).item())

    def after_step(self) -> None:
        """θ̄ ← μ·θ̄ + (1 − μ)·θ (necessity distillation on)."""
        if self.ema is not None:
            if not self.ema.ready:
                raise RuntimeError("necessity distillation: the EMA was never attached")
            self.ema.update()

    def state_dict(self) -> dict | None:
        return None if self.ema is None else {"ema": self.ema.state_dict()}

    def load_state_dict(self, state: dict | None) -> None:
        if self.ema is None:
            if state is not None:
                raise ValueError("the checkpoint holds an EMA shadow this run does not use")
            return
        if state is None or "ema" not in state:
            raise ValueError("necessity distillation: the checkpoint holds no EMA shadow")
        self.ema.load_state_dict(state["ema"])

    def ig_rows(self, batch: TrajectoryBatch) -> list[int] | None:
        """The rows IG scores: the clean ones under BitFlip `partition: half`, else every
        row (None)."""
        if not self.half:
            return None
        return [b for b, noised in enumerate(self.noised_rows(batch)) if not noised]

    def projection(self, model: UnifiedModel) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(W, b, L) of the model codec's frozen code -> feature projection, on the
        model's device (read once)."""
        if self._projection is None:
            self._projection = soft_bsq_projection(model)
        return self._projection

    def count(self, batch: TrajectoryBatch) -> int:
        text, visual = scored_indices(batch)
        return len(text) + len(visual)

    def _noisy_inputs(self, model: UnifiedModel, batch: TrajectoryBatch) -> torch.Tensor | None:
        p = self.cfg.bitflip.probability
        if p <= 0:
            return None
        seeds = _row_seeds(batch)
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        uniforms = torch.stack([torch.rand((), generator=g) for g in gens])
        rates = bitflip_rates(p, self.cfg.bitflip.probability_mode, uniforms)
        if self.half:
            chosen = self.noised_rows(batch)
            if not any(chosen):
                return None
            rates = rates * torch.tensor(chosen, dtype=rates.dtype)  # rate 0: no draw flips
        return bitflip(batch.visual_codes, batch.visual_mask, rates, model.n_visual_outputs, gens)

    def noised_rows(self, batch: TrajectoryBatch) -> list[bool]:
        """Which rows of `batch` BitFlip noises (all of them under `partition: all`)."""
        if self.cfg.bitflip.probability <= 0:
            return [False] * len(batch.sample_ids)
        if not self.half:
            return [True] * len(batch.sample_ids)
        seeds = _row_seeds(batch)
        if self.noised_seeds is None or not set(seeds) <= self.batch_seeds:
            raise RuntimeError("bitflip partition half: begin_update was not called this update")
        return [s in self.noised_seeds for s in seeds]

    def loss(
        self, model: UnifiedModel, micro: TrajectoryBatch, n_global: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        noisy = self._noisy_inputs(model, micro)
        out = forward_interleaved(model, micro, noisy)
        text_pos = text_ce(out.text_logits, out.text_targets)
        visual_pos = visual_ce(out.visual_logits, out.visual_targets)
        terms = SFTTerms(text_pos.sum(), visual_pos.sum(), len(text_pos), len(visual_pos))
        loss = sft_loss(terms, self.cfg.lambda_visual, n_global)
        stats = {
            "text_ce_sum": float(terms.text_sum.detach()),
            "visual_ce_sum": float(terms.visual_sum.detach()),
            "n_text": float(terms.n_text),
            "n_visual": float(terms.n_visual),
        }
        if self.soft_bsq > 0:
            loss = loss + self._soft_bsq_term(model, out, stats)
        if self.ig.weight > 0:
            ig = self._ig(model, micro, out, noisy is not None, text_pos, visual_pos)
            if ig.n_rows and self.ig_rows_global <= 0:
                raise RuntimeError("information gain: begin_update was not called this update")
            if ig.n_rows:
                loss = loss + self.ig.weight * ig.loss_sum / self.ig_rows_global
            stats.update(ig.sums)
        if self.ema is not None:
            loss = loss + self._nd_term(model, micro, out, noisy is not None, stats)
        return loss, stats

    def _nd_term(
        self,
        model: UnifiedModel,
        micro: TrajectoryBatch,
        out: ForwardOutput,
        noisy: bool,
        stats: dict[str, float],
    ) -> torch.Tensor:
        """λ · Σ_i mean_{p ∈ C_i} D_p / (global rows with carriers) of this micro-batch."""
        if not self._carriers:
            raise RuntimeError("necessity distillation: begin_update was not called this update")
        car = self._carriers.pop(0)
        clean = not noisy and not (model.training and draws_dropout(model))
        loss_sum, n_rows, sums = nd_terms(model, micro, car, self.nd, out if clean else None)
        stats.update(sums)
        if n_rows == 0:
            return loss_sum
        return self.nd.weight * loss_sum / self.nd_rows_global

    def _soft_bsq_term(
        self, model: UnifiedModel, out: ForwardOutput, stats: dict[str, float]
    ) -> torch.Tensor:
        """λ · Σ_p d_p / N_visual of this micro-batch's scored visual positions."""
        weight, bias, latent_dim = self.projection(model)
        d = soft_bsq_distances(out.visual_logits, out.visual_targets, weight, bias, latent_dim)
        stats["soft_bsq_sum"] = float(d.detach().sum())
        if not len(d):
            return d.sum()
        if self.visual_global <= 0:
            raise RuntimeError("soft-BSQ: begin_update was not called this update")
        return self.soft_bsq * d.sum() / self.visual_global

    def _ig(
        self,
        model: UnifiedModel,
        micro: TrajectoryBatch,
        out: ForwardOutput,
        noisy: bool,
        text_pos: torch.Tensor,
        visual_pos: torch.Tensor,
    ) -> IGTerms:
        """IG terms of the micro-batch. The full view is the SFT forward when it is clean
        for the scored rows (no BitFlip, or `partition: half` fused: IG scores the clean
        rows only) and no dropout is active; otherwise a separate clean eval-mode forward
        of the scored rows."""
        rows = self.ig_rows(micro)
        dropout = model.training and draws_dropout(model)
        fused = self.ig.student_full_view == "fused"
        if self.half and fused and dropout:
            raise RuntimeError(
                "information_gain.student_full_view fused: the model has active dropout, so "
                "the SFT forward is not a clean full view; set algorithm.information_gain.student_full_view=sequential"
            )
        if (self.half and fused) or not (noisy or dropout or self.half):
            logp = full_logp(out, text_pos, visual_pos)
            ig = ig_terms(model, micro, logp, self.ig, self.cycle_index, rows)
            ig.sums["ig/full_calls"] = 0.0
            return ig
        if rows is not None and not rows:  # sequential, every row noised: nothing to score
            ig = ig_terms(model, micro, text_pos.new_zeros(out.visual_mask.shape),
                          self.ig, self.cycle_index, [])  # fmt: skip
            ig.sums["ig/full_calls"] = 0.0
            return ig
        batch = micro if rows is None else micro[rows]
        with eval_mode(model):
            view = forward_interleaved(model, batch)
        text = text_ce(view.text_logits, view.text_targets)
        visual = visual_ce(view.visual_logits, view.visual_targets)
        ig = ig_terms(model, batch, full_logp(view, text, visual), self.ig, self.cycle_index)
        ig.sums["ig/full_calls"] = 1.0
        return ig

    def finalize(self, sums: dict[str, float], n_global: int) -> dict[str, float]:
        """The summed cross-entropies and counts, the mean CE per modality, and with IG
        on its per-direction means (`train.information_gain.finalize_sums`)."""
        ce = {k: v for k, v in sums.items() if not k.startswith(("ig/", "nd/"))}
        out = {
            **ce,
            "text_ce": sums["text_ce_sum"] / max(sums["n_text"], 1.0),
            "visual_ce": sums["visual_ce_sum"] / max(sums["n_visual"], 1.0),
        }
        if self.soft_bsq > 0:
            out["soft_bsq"] = sums["soft_bsq_sum"] / max(sums["n_visual"], 1.0)
        if self.ig.weight > 0:
            out.update(finalize_sums(sums))
        if self.ema is not None:
            out.update(finalize_nd(sums))
        return out


def soft_bsq_projection(model: UnifiedModel) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(W [h, L], b [h], L) of `model.codec.feature_projection()` on the model's device;
    ValueError for a codec without one (a VQ codec, a plugin codec)."""
    codec = model.codec
    if model.visual_head != "bsq" or not hasattr(codec, "feature_projection"):
        raise ValueError(
            f"soft-BSQ needs a BSQ codec with a code -> feature projection, got "
            f"{type(codec).__name__} ({model.visual_head} head)"
        )
    weight, bias = codec.feature_projection()
    if weight.shape[1] != codec.latent_dim:
        raise ValueError(
            f"soft-BSQ: the codec projection takes {weight.shape[1]} dims, not L={codec.latent_dim}"
        )
    return weight.to(model.device), bias.to(model.device), int(codec.latent_dim)


def _row_seeds(batch: TrajectoryBatch) -> list[int]:
    seeds = [s for s in batch.seeds or [] if s is not None]
    if batch.seeds is None or len(seeds) != len(batch.seeds):
        raise ValueError("BitFlip noise needs every row's seed (DatasetSource sets them)")
    return seeds
