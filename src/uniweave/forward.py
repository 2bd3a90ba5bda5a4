"""Teacher-forced forward over an interleaved batch, heads at scored positions only.

Position t holds token t; its log-prob comes from the hidden state at t - 1. The scored
positions are the policy-owned ones (`TrajectoryBatch.policy_mask`, never t = 0). The
text head is applied to the hidden states of scored text positions and the visual head to
those of scored visual positions, so no [B, T, V] logits tensor is ever formed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality, Owner
from uniweave.models.base import ModelInputs, UnifiedModel


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


def prompt_lengths(batch: TrajectoryBatch, recorded: Sequence[int | None]) -> list[int]:
    """Each row's prompt length: `recorded[r]` when given, else the index of its first
    position not owned by the prompt (its length when it has none)."""
    out = []
    for r, n in enumerate(recorded):
        if n is None:
            other = (batch.owner[r, : int(batch.lengths[r])] != Owner.PROMPT).nonzero()
            n = int(other[0]) if other.numel() else int(batch.lengths[r])
        out.append(int(n))
    return out


def prefix_groups(batch: TrajectoryBatch, lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """(first row of each distinct prompt, in order; each row's prompt number). Rows r, s
    share a prompt when lengths[r] == lengths[s] and their first lengths[r] tokens,
    modalities and visual codes are equal (understanding images: never shared)."""
    ids, modality, codes = (x.cpu() for x in (batch.token_ids, batch.modality, batch.visual_codes))
    first_of: list[int] = []
    inverse: list[int] = []
    seen: dict[tuple, int] = {}
    for r, n in enumerate(lengths):
        key: tuple = (n, *(x[r, :n].numpy().tobytes() for x in (ids, modality, codes)))
        if batch.images[r]:
            key = (r, "images")
        if key not in seen:
            seen[key] = len(first_of)
            first_of.append(r)
        inverse.append(seen[key])
    return first_of, inverse


def shared_prefix_hidden(
    model: UnifiedModel, batch: TrajectoryBatch, lengths: Sequence[int]
) -> torch.Tensor:
    """`body_hidden(model, batch)` at every real position, with each distinct prompt
    (`prefix_groups`; row r's prompt is its first lengths[r] positions) run through the
    body once instead of once per row that holds it (a GRPO group's G rows).

    Two forwards: the distinct prompts (right-padded to the longest, key-padding mask
    beyond each prompt), whose KV cache — carrying the gradient — is copied to each row
    (`batch_select_indices`); then every row's positions after its prompt, at their own
    positions, attending to its prompt's cached keys and causally to each other. Each
    real position sees the same keys, values and position as in the full forward, so
    the hidden states (and gradients, which sum over the rows sharing a prompt) are the
    same function of the weights. Padding positions hold no meaningful value. Needs a
    model with `supports_prefix_sharing` (RoPE positions [B, T], a plain KV cache) and,
    in training mode, no gradient checkpointing (transformers then drops the cache).
    """
    if not model.supports_prefix_sharing:
        raise ValueError(f"{type(model).__name__} does not support prompt-prefix sharing")
    if model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        raise ValueError(
            "prompt-prefix sharing continues from a KV cache, which transformers' gradient "
            "checkpointing drops in training: turn one of them off"
        )
    inputs = model.prepare(batch)
    if inputs.attention_mask.dim() != 2 or inputs.position_ids.dim() != 2:
        raise ValueError("prompt-prefix sharing needs a key-padding mask and positions [B, T]")
    device = inputs.token_ids.device
    first_of, inverse = prefix_groups(batch, lengths)
    rep = torch.tensor(first_of, device=device)
    row_group = torch.tensor(inverse, device=device)
    n = torch.tensor(list(lengths), device=device)
    B, T = inputs.token_ids.shape
    width = int(n.max())
    prompt_mask = torch.arange(width, device=device)[None] < n[rep][:, None]
    prompt = ModelInputs(
        token_ids=inputs.token_ids[rep, :width],
        modality=inputs.modality[rep, :width],
        visual_codes=inputs.visual_codes[rep, :width],
        attention_mask=prompt_mask,
        position_ids=inputs.position_ids[rep, :width],
        image_position=inputs.image_position[rep, :width],
        images=[inputs.images[int(r)] for r in first_of],
    )
    head = model.hidden(prompt, model.new_cache())
    parts = [head.hidden[row_group]]
    rest = batch.lengths.to(device) - n
    tail = int(rest.max())
    if tail > 0:
        j = torch.arange(tail, device=device)[None]
        cols = (n[:, None] + j).clamp(max=T - 1)

        def take(x: torch.Tensor) -> torch.Tensor:
            index = cols.view(B, tail, *([1] * (x.dim() - 2))).expand(B, tail, *x.shape[2:])
            return x.gather(1, index)

        cache = head.cache
        cache.batch_select_indices(row_group)
        completion = ModelInputs(
            token_ids=take(inputs.token_ids),
            modality=take(inputs.modality),
            visual_codes=take(inputs.visual_codes),
            attention_mask=torch.cat([prompt_mask[row_group], j < rest[:, None]], dim=1),
            position_ids=take(inputs.position_ids),
            image_position=take(inputs.image_position),
            images=[[] for _ in range(B)],
        )
        parts.append(model.hidden(completion, cache).hidden)
    joined = torch.cat(parts, dim=1)
    t = torch.arange(T, device=device)[None]
    where = torch.where(t < n[:, None], t, width + t - n[:, None]).clamp(0, joined.shape[1] - 1)
    return joined.gather(1, where[..., None].expand(B, T, joined.shape[-1]))


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


def scored_mask(batch: TrajectoryBatch) -> torch.Tensor:
    """bool [B, T]: the scored (policy-owned, t >= 1) positions."""
    text, visual = scored_indices(batch)
    mask = torch.zeros(batch.token_ids.shape, dtype=torch.bool, device=batch.token_ids.device)
    mask[text.rows, text.cols] = True
    mask[visual.rows, visual.cols] = True
    return mask
