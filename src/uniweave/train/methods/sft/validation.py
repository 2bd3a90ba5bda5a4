"""SFT's teacher-forced validation loss: the training cross-entropy on fixed val rows.

Over the val rows (`data.val_size` per task, serialised as training serialises them) in
eval mode (no dropout), without BitFlip noise or Information Gain, under the training
precision's autocast:

    loss              = (Σ_text ℓ_t + λ_visual · Σ_visual ℓ_t) / (N_text + N_visual)
    loss_text         = Σ_text ℓ_t / N_text
    loss_image_<head> = Σ_visual ℓ_t / N_visual          (<head>: vq, or bits for BSQ)

with ℓ_t the per-position CE of `uniweave.algorithms.sft` — the normaliser of the training
loss (every scored position of the rows counts once), so `val/loss` and the training
`loss` are the same function on different rows. A term with no positions is left out.
The sums are float64 over micro-batches of `trainer.micro_batch_size` rows, so the value
does not depend on that size beyond float32 rounding of each position's CE.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from uniweave.algorithms.sft import text_ce, visual_ce
from uniweave.config import UniweaveConfig
from uniweave.config.algorithms import SFTConfig
from uniweave.config.schema import VISUAL_LOSS
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.forward import forward_interleaved
from uniweave.models.base import UnifiedModel
from uniweave.train.engine.forward_mode import autocast
from uniweave.train.methods.sft.information_gain import eval_mode


def validation_loss(
    cfg: UniweaveConfig, model: UnifiedModel, rows: Sequence[Trajectory], pad_id: int
) -> dict[str, float]:
    """`loss`, `loss_text`, `loss_image_<head>` of `rows` (module docstring)."""
    text_sum = visual_sum = 0.0
    n_text = n_visual = 0
    size = cfg.trainer.micro_batch_size
    with eval_mode(model), torch.no_grad():
        for start in range(0, len(rows), size):
            batch = TrajectoryBatch.collate(list(rows[start : start + size]), pad_id)
            batch = batch.to(model.device)
            with autocast(cfg.trainer, model.device):
                out = forward_interleaved(model, batch)
            text = text_ce(out.text_logits, out.text_targets)
            visual = visual_ce(out.visual_logits, out.visual_targets)
            text_sum += float(text.double().sum())
            visual_sum += float(visual.double().sum())
            n_text += len(text)
            n_visual += len(visual)
    if n_text + n_visual == 0:
        raise ValueError("validation loss: the val rows have no scored position")
    algo = cfg.algorithm
    assert isinstance(algo, SFTConfig), "the SFT validation loss of an SFT config"
    lam = algo.lambda_visual
    metrics = {"loss": (text_sum + lam * visual_sum) / (n_text + n_visual)}
    if n_text:
        metrics["loss_text"] = text_sum / n_text
    if n_visual:
        metrics[f"loss_image_{VISUAL_LOSS[cfg.model.visual_head]}"] = visual_sum / n_visual
    return metrics


def ig_report_name(update: int) -> str:
    """The file name, under the run's `evals/`, of the IG validation report of `update`."""
    return f"ig-val-update-{update:06d}.json"
