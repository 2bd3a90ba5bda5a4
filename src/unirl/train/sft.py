"""SFT: a dataset cursor as the batch source and the cross-entropy objective.

The batch of update u is a pure function of (data seed, u): the rows are walked through a
fresh permutation per epoch, so the data cursor is the update counter and a resumed run
continues the exact order.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from unirl.algorithms.sft import bitflip, bitflip_rates, sft_loss, sft_terms
from unirl.config.algorithms import SFTConfig
from unirl.core.seeding import generator_for
from unirl.core.trajectory import Trajectory, TrajectoryBatch
from unirl.forward import forward_interleaved, scored_indices
from unirl.models.base import UnifiedModel


class DatasetSource:
    """Global batches of `batch_size` rows walked through per-epoch permutations."""

    def __init__(
        self, trajectories: list[Trajectory], batch_size: int, seed: int, shuffle: bool = True
    ) -> None:
        if not trajectories:
            raise ValueError("the SFT dataset is empty")
        self.rows = trajectories
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self.rows)
            rng = np.random.default_rng([self.seed, epoch])
            self._orders = {epoch: rng.permutation(n) if self.shuffle else np.arange(n)}
        return self._orders[epoch]

    def indices(self, update: int) -> list[int]:
        n = len(self.rows)
        out = []
        for k in range(update * self.batch_size, (update + 1) * self.batch_size):
            epoch, offset = divmod(k, n)
            out.append(int(self._order(epoch)[offset]))
        return out

    def global_batch(self, update: int) -> list[Trajectory]:
        return [self.rows[i] for i in self.indices(update)]

    def batch_metrics(self, update: int) -> dict[str, float]:
        return {"epoch": update * self.batch_size / len(self.rows)}


def _row_seed_index(sample_id: str) -> int:
    return zlib.crc32(sample_id.encode())


class SFTObjective:
    """Text CE + λ_visual · visual CE over the global count of scored positions, with
    optional BitFlip noise on the visual inputs (stateless per trajectory and update)."""

    def __init__(self, cfg: SFTConfig, run_seed: int) -> None:
        self.cfg = cfg
        self.run_seed = run_seed

    def count(self, batch: TrajectoryBatch) -> int:
        text, visual = scored_indices(batch)
        return len(text) + len(visual)

    def _noisy_inputs(
        self, model: UnifiedModel, batch: TrajectoryBatch, update: int
    ) -> torch.Tensor | None:
        p = self.cfg.bitflip.probability
        if p <= 0:
            return None
        gens = [
            generator_for(self.run_seed, update, _row_seed_index(sid), 0)
            for sid in batch.sample_ids
        ]
        uniforms = torch.stack([torch.rand((), generator=g) for g in gens])
        rates = bitflip_rates(p, self.cfg.bitflip.probability_mode, uniforms)
        return bitflip(batch.visual_codes, batch.visual_mask, rates, model.n_visual_outputs, gens)

    def loss(
        self, model: UnifiedModel, micro: TrajectoryBatch, n_global: int, update: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        out = forward_interleaved(model, micro, self._noisy_inputs(model, micro, update))
        terms = sft_terms(out.text_logits, out.text_targets, out.visual_logits, out.visual_targets)
        loss = sft_loss(terms, self.cfg.lambda_visual, n_global)
        return loss, {
            "text_ce_sum": float(terms.text_sum.detach()),
            "visual_ce_sum": float(terms.visual_sum.detach()),
            "n_text": float(terms.n_text),
            "n_visual": float(terms.n_visual),
        }
