"""UniAR's `forward_interleaved`: one teacher-forced forward on transformers-style inputs
(`input_ids`, `attention_mask`, `image_grid_thw`, `pixel_values`) plus the bits of the
generated positions, which are found from the ids alone (`generated_mask`). The public API
for custom losses (recipes/uniar/README.md); training itself goes through `prepare` +
`hidden`, which this reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from uniweave.core.types import Modality
from uniweave.models.uniar.positions import batch_positions, true_runs

UniARModel = Any
"""A `uniweave.models.uniar.model.UniARModel` (not imported: that module imports this one)."""


@dataclass
class InterleavedOutput:
    """`forward_interleaved`'s result: pre-final-norm states [B, T, d], M-RoPE positions
    [3, B, T], the generated-visual mask [B, T] and the visual-head bit logits [N, D] at
    the N scored visual targets (`visual_rows`, `visual_cols`; each from the state at
    col - 1)."""

    hidden: torch.Tensor
    position_ids: torch.Tensor
    visual_mask: torch.Tensor
    visual_logits: torch.Tensor
    visual_rows: torch.Tensor
    visual_cols: torch.Tensor


def generated_mask(
    model: UniARModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """bool [B, T]: the generated-image positions of a token stream, read from the ids
    alone: each run of `<|image_pad|>` ids right after a `<|vision_start|>` that ends a
    `<image_gen> generate image H W` header (an understanding image's placeholder run
    has no such header)."""
    pad_id, start_id = int(model.config.image_token_id), int(model.special_ids.vision_start)
    out = torch.zeros(input_ids.shape, dtype=torch.bool)
    mask = attention_mask.bool().cpu()
    for b, row in enumerate(input_ids.cpu()):
        real = mask[b].nonzero().flatten()
        ids = row[real].tolist()
        for s, e in true_runs([t == pad_id for t in ids]):
            if s > 0 and ids[s - 1] == start_id and model.parse_image_header(ids[: s - 1]):
                out[b, real[s:e]] = True
    return out.to(input_ids.device)


def grids_per_row(
    model: UniARModel, placeholder: torch.Tensor, image_grid_thw: torch.Tensor | None
) -> list[list[list[int]]]:
    """`image_grid_thw` rows split over the batch rows in order, each row taking
    images until their t*(h/m)*(w/m) placeholders fill its placeholder count."""
    thw = [] if image_grid_thw is None else image_grid_thw.tolist()
    rows, k = [], 0
    for b, need in enumerate(placeholder.sum(1).tolist()):
        row = []
        while need > 0 and k < len(thw):
            t, h, w = (int(v) for v in thw[k])
            row.append([t, h, w])
            need -= t * (h // model.merge) * (w // model.merge)
            k += 1
        if need != 0:
            raise ValueError(
                f"image_grid_thw: row {b}'s image placeholders do not match its images "
                f"({len(thw)} images for {int(placeholder.sum())} placeholders in all)"
            )
        rows.append(row)
    if k != len(thw):
        raise ValueError(f"image_grid_thw: {len(thw)} images but only {k} have placeholders")
    return rows


def forward_interleaved(
    model: UniARModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    visual_codes: torch.Tensor | None = None,
    pixel_values: torch.Tensor | None = None,
    scored_mask: torch.Tensor | None = None,
) -> InterleavedOutput:
    """One teacher-forced forward of an interleaved batch, on transformers-style inputs.

    `input_ids` / `attention_mask` long/bool [B, T] (left or right padding) as
    `prompt_trajectory` lays them out; understanding images as Qwen's image processor
    gives them, `pixel_values` [sum t*h*w, C*tp*p*p] and `image_grid_thw` [n, 3] in
    order over the rows (both or neither); `visual_codes` bits [B, T, k*k*L], read at
    the generated positions (`generated_mask`; required when there are any);
    `scored_mask` bool [B, T] the visual targets whose bit logits to compute (default:
    every generated position). A target at column c is predicted from the state at
    c - 1; column 0 is never scored. The heads run only there. Returns
    `InterleavedOutput` (pre-final-norm states; `project_text` gives text logits)."""
    device = model.device
    ids = input_ids.to(device)
    mask = attention_mask.bool().to(device)
    visual = generated_mask(model, ids, mask)
    if visual_codes is None:
        if bool(visual.any()):
            raise ValueError("visual_codes: required, the batch has generated images")
        visual_codes = torch.zeros(*ids.shape, model.n_visual_outputs)
    codes = visual_codes.to(device)
    if (pixel_values is None) != (image_grid_thw is None):
        raise ValueError("pixel_values and image_grid_thw: give both or neither")
    placeholder = (ids == int(model.config.image_token_id)) & ~visual & mask
    grids = grids_per_row(model, placeholder, image_grid_thw)
    modality = torch.where(visual, int(Modality.VISUAL), int(Modality.TEXT))
    position_ids = batch_positions(
        model.model.get_rope_index, ids, modality, mask, int(model.config.image_token_id),
        grids, model.parse_image_header, model.merge,
    )  # fmt: skip
    embeds = model.token_embeddings(ids, visual, codes)
    deepstack = None
    if bool(placeholder.any()):
        embeds, deepstack = model.with_image_features(
            embeds, placeholder, pixel_values, image_grid_thw
        )
    hidden = model.body(embeds, mask, position_ids, None, deepstack).hidden
    scored = visual.clone() if scored_mask is None else scored_mask.to(device) & visual
    scored[:, 0] = False
    rows, cols = scored.nonzero(as_tuple=True)
    return InterleavedOutput(
        hidden=hidden,
        position_ids=position_ids,
        visual_mask=visual,
        visual_logits=model.visual_logits(hidden[rows, cols - 1]),
        visual_rows=rows,
        visual_cols=cols,
    )
