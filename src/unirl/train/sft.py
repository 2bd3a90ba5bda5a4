"""SFT: a dataset cursor as the batch source and the cross-entropy objective.

The batch of update u is a pure function of (data seed, u): the rows are walked through a
fresh permutation per epoch, so the data cursor is the update counter and a resumed run
continues the exact order. Each row of update u carries the stateless seed
`seed_for(run seed, u, crc32(sample id), 0)` of its input noise (BitFlip).
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np
import torch

from unirl.algorithms.sft import bitflip, bitflip_rates, sft_loss, sft_terms
from unirl.config.algorithms import SFTConfig
from unirl.core.seeding import seed_for
from unirl.core.trajectory import Trajectory, TrajectoryBatch
from unirl.forward import forward_interleaved, scored_indices
from unirl.models.base import UnifiedModel


class DatasetSource:
    """Global batches of `batch_size` rows walked through per-epoch permutations."""

    def __init__(
        self,
        trajectories: list[Trajectory],
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        run_seed: int = 0,
    ) -> None:
        if not trajectories:
            raise ValueError("the SFT dataset is empty")
        self.rows = trajectories
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.run_seed = run_seed
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
        """The update's rows, each with its noise seed (module docstring)."""
        out = []
        for i in self.indices(update):
            row = self.rows[i]
            seed = seed_for(self.run_seed, update, _row_seed_index(row.sample_id), 0)
            out.append(replace(row, seed=seed))
        return out

    def batch_metrics(self, update: int) -> dict[str, float]:
        return {"epoch": update * self.batch_size / len(self.rows)}


def _row_seed_index(sample_id: str) -> int:
    return zlib.crc32(sample_id.encode())


class SFTObjective:
    """Text CE + λ_visual · visual CE over the global count of scored positions, with
    optional BitFlip noise on the visual inputs drawn from each row's seed."""

    def __init__(self, cfg: SFTConfig) -> None:
        self.cfg = cfg

    def count(self, batch: TrajectoryBatch) -> int:
        text, visual = scored_indices(batch)
        return len(text) + len(visual)

    def _noisy_inputs(self, model: UnifiedModel, batch: TrajectoryBatch) -> torch.Tensor | None:
        p = self.cfg.bitflip.probability
        if p <= 0:
            return None
        if batch.seeds is None or any(s is None for s in batch.seeds):
            raise ValueError("BitFlip noise needs every row's seed (DatasetSource sets them)")
        gens = [torch.Generator().manual_seed(s) for s in batch.seeds]
        uniforms = torch.stack([torch.rand((), generator=g) for g in gens])
        rates = bitflip_rates(p, self.cfg.bitflip.probability_mode, uniforms)
        return bitflip(batch.visual_codes, batch.visual_mask, rates, model.n_visual_outputs, gens)

    def loss(
        self, model: UnifiedModel, micro: TrajectoryBatch, n_global: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        out = forward_interleaved(model, micro, self._noisy_inputs(model, micro))
        terms = sft_terms(out.text_logits, out.text_targets, out.visual_logits, out.visual_targets)
        loss = sft_loss(terms, self.cfg.lambda_visual, n_global)
        return loss, {
            "text_ce_sum": float(terms.text_sum.detach()),
            "visual_ce_sum": float(terms.visual_sum.detach()),
            "n_text": float(terms.n_text),
            "n_visual": float(terms.n_visual),
        }

    def finalize(self, sums: dict[str, float], n_global: int) -> dict[str, float]:
        """The summed cross-entropies and counts, and the mean CE per modality."""
        return {
            **sums,
            "text_ce": sums["text_ce_sum"] / max(sums["n_text"], 1.0),
            "visual_ce": sums["visual_ce_sum"] / max(sums["n_visual"], 1.0),
        }
