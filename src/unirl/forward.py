"""Teacher-forced forward over an interleaved batch, heads at scored positions only.

Position t holds token t; its log-prob comes from the hidden state at t - 1. The scored
positions are the policy-owned ones (`TrajectoryBatch.policy_mask`, never t = 0). The
text head is applied to the hidden states of scored text positions and the visual head to
those of scored visual positions, so no [B, T, V] logits tensor is ever formed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unirl.core.trajectory import TrajectoryBatch
from unirl.core.types import Modality
from unirl.models.base import UnifiedModel


@dataclass
class ScoredIndex:
    """Where the scored targets of one modality sit: batch row and target position."""

    rows: torch.Tensor
    cols: torch.Tensor

    def __len__(self) -> int:
        return int(self.rows.numel())


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [B, T, d]
    visual_mask: torch.Tensor  # bool [B, T]
    text_index: ScoredIndex
    visual_index: ScoredIndex
    text_logits: torch.Tensor  # [N_text, V]
    visual_logits: torch.Tensor  # [N_visual, K | L]
    text_targets: torch.Tensor  # long [N_text]
    visual_targets: torch.Tensor  # long [N_visual] (VQ) | float [N_visual, L] (BSQ)


def scored_indices(batch: TrajectoryBatch) -> tuple[ScoredIndex, ScoredIndex]:
    """Scored (policy-owned, t >= 1) text and visual target positions of `batch`."""
    scored = batch.policy_mask.clone()
    scored[:, 0] = False
    visual = batch.modality == Modality.VISUAL
    t_rows, t_cols = torch.nonzero(scored & ~visual, as_tuple=True)
    v_rows, v_cols = torch.nonzero(scored & visual, as_tuple=True)
    return ScoredIndex(t_rows, t_cols), ScoredIndex(v_rows, v_cols)


def body_hidden(
    model: UnifiedModel, batch: TrajectoryBatch, visual_inputs: torch.Tensor | None = None
) -> torch.Tensor:
    """Decoder hidden states [B, T, d] of a right-padded batch (no cache): the model's
    own inputs (`UnifiedModel.prepare`), understanding images included.

    `visual_inputs` replaces `batch.visual_codes` as the *input* codes (e.g. BitFlip noise);
    targets always stay the clean codes.
    """
    return model.hidden(model.prepare(batch, visual_inputs)).hidden


def forward_interleaved(
    model: UnifiedModel, batch: TrajectoryBatch, visual_inputs: torch.Tensor | None = None
) -> ForwardOutput:
    """Hidden states, visual mask and head logits at the scored positions of `batch`."""
    hidden = body_hidden(model, batch, visual_inputs)
    text_index, visual_index = scored_indices(batch)
    text_h = hidden[text_index.rows, text_index.cols - 1]
    visual_h = hidden[visual_index.rows, visual_index.cols - 1]
    return ForwardOutput(
        hidden=hidden,
        visual_mask=batch.modality == Modality.VISUAL,
        text_index=text_index,
        visual_index=visual_index,
        text_logits=model.text_logits(text_h),
        visual_logits=model.visual_logits(visual_h),
        text_targets=batch.token_ids[text_index.rows, text_index.cols],
        visual_targets=batch.visual_codes[visual_index.rows, visual_index.cols],
    )
