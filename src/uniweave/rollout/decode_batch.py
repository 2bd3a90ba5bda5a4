"""Device-side state of the rollout engine's decode loop (an engine internal).

`DecodeBatch` holds the KV cache, the attention mask (in a buffer with spare columns),
the model's next-position source and each batch row's last hidden state; `prefill` runs
the prompts (each distinct prompt once, `distinct_rows`), `step` feeds one position per
row and `select` keeps rows (compaction). A step runs the model's `embed`, then its body
through `uniweave.rollout.lean_step` when the model has a plain Llama decoder (the same
numbers without the module machinery), else through `model.hidden`.
"""

from __future__ import annotations

from typing import Any

import torch

from uniweave.core.trajectory import Trajectory
from uniweave.models.base import DecodePositions, ModelInputs, UnifiedModel
from uniweave.rollout.decode_cache import RESERVE, compact, preallocate
from uniweave.rollout.lean_step import LeanLlamaStep, lean_step


def step_tensors(
    inputs: tuple[list, list, list, list], bits: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step's (ids, modality, visual codes, image position) as (rows, 1)
    tensors (codes (rows, 1, bits) for BSQ heads); a row with no code gets -1 (VQ) or zero
    bits. Shared by the static (`DecodeBatch`) and continuous (`SlotBatch`) engines."""
    ids, modality, codes, where = inputs
    ids_t = torch.tensor(ids, dtype=torch.long, device=device)[:, None]
    mod_t = torch.tensor(modality, dtype=torch.long, device=device)[:, None]
    if bits is None:
        codes_t = torch.tensor([-1 if c is None else c for c in codes], device=device)
    else:
        zero = torch.zeros(bits)
        codes_t = torch.stack([zero if c is None else c for c in codes]).to(device)
    where_t = torch.tensor(where, dtype=torch.long, device=device)[:, None]
    return ids_t, mod_t, codes_t[:, None], where_t


class DecodeBatch:
    """Device-side state of the decode loop: KV cache, attention mask, the model's
    next-position source and the last hidden state of every batch row."""

    def __init__(
        self,
        cache: Any,
        mask: torch.Tensor,
        positions: DecodePositions,
        hidden: torch.Tensor,
        bits: int | None,
        lean: LeanLlamaStep | None = None,
    ) -> None:
        self.cache, self.positions, self.hidden = cache, positions, hidden
        self.bits, self.lean = bits, lean
        # Whether some cached key is padding (what transformers checks for its SDPA mask).
        self._padded = not bool(mask.all())
        # The attention mask lives in a buffer with spare columns (`_extend` writes in place).
        self._length = mask.shape[1]
        self._mask = mask.new_zeros(mask.shape[0], self._length + RESERVE)
        self._mask[:, : self._length] = mask

    @property
    def mask(self) -> torch.Tensor:
        """bool [B, cached + fed positions]."""
        return self._mask[:, : self._length]

    def _extend(self) -> None:
        """Append one valid column to every row's attention mask."""
        if self._length == self._mask.shape[1]:
            grown = self._mask.new_zeros(self._mask.shape[0], 2 * self._length)
            grown[:, : self._length] = self._mask
            self._mask = grown
        self._mask[:, self._length] = True
        self._length += 1

    @classmethod
    def prefill(
        cls,
        model: UnifiedModel,
        prompts: list[Trajectory],
        pad_id: int,
        share: bool = True,
        lean: bool = True,
    ) -> DecodeBatch:
        """Left-pad `prompts` (`UnifiedModel.prepare_prompts`) and run them through the
        body in one forward. With `share` (and a cache that can select rows), each
        distinct prompt is prefilled once and its cache, mask, positions and last hidden
        state are copied to every row that holds it (a GRPO group's G rows): the same
        left-padded width, positions and mask as prefilling every row. With `lean`, the
        steps run the model's plain decoder through `lean_step` when it has one."""
        cache = preallocate(model.new_cache())
        first_of, inverse = distinct_rows(prompts)
        shared = share and len(first_of) < len(prompts)
        shared = shared and hasattr(cache, "batch_select_indices")
        run = [prompts[i] for i in first_of] if shared else prompts
        inputs = model.prepare_prompts(run, pad_id)
        out = model.hidden(inputs, cache)
        first = prompts[0].visual_codes
        bits = int(first.shape[1]) if first.dim() == 2 else None
        positions = model.decode_positions(inputs)
        mask, hidden = inputs.attention_mask, out.hidden[:, -1]
        if shared:
            idx = torch.tensor(inverse, device=mask.device)
            out.cache.batch_select_indices(idx)
            positions.select(idx)
            mask, hidden = mask[idx], hidden[idx]
        return cls(out.cache, mask, positions, hidden, bits, lean_step(model) if lean else None)

    def select(self, rows: list[int]) -> None:
        """Keep only batch `rows` (in this order), in the cache too (`decode_cache.compact`:
        with `holes_filled` orders only the rows that change place move)."""
        idx = torch.tensor(rows, device=self.mask.device)
        if not hasattr(self.cache, "batch_select_indices"):
            raise TypeError(f"{type(self.cache).__name__} cannot drop rows; use finished='mask'")
        compact(self.cache, rows, idx.device)
        self.positions.select(idx)
        self._mask, self.hidden = self._mask[idx], self.hidden[idx]
        self._padded = not bool(self.mask.all())

    def step(self, model: UnifiedModel, inputs: tuple[list, list, list, list]) -> None:
        """Feed one position per row; updates cache, mask, positions and hidden."""
        ids = inputs[0]
        ids_t, mod_t, codes_t, where_t = step_tensors(inputs, self.bits, self.mask.device)
        self._extend()
        step = ModelInputs(
            token_ids=ids_t,
            modality=mod_t,
            visual_codes=codes_t,
            attention_mask=self.mask,
            position_ids=self.positions.next(mod_t, where_t, ids_t),
            image_position=where_t,
            images=[[] for _ in ids],
        )
        if self.lean is None:
            out = model.hidden(step, self.cache)
            self.cache, self.hidden = out.cache, out.hidden[:, -1]
            return
        mask = self.mask if self._padded else None
        hidden = self.lean(model.embed(step), mask, step.position_ids, self.cache)
        self.hidden = hidden[:, -1]


def distinct_rows(prompts: list[Trajectory]) -> tuple[list[int], list[int]]:
    """(index of the first row of each distinct prompt, in order; for every row, the
    number of its distinct prompt). Prompts are equal when their tokens, modalities,
    visual codes and understanding images are."""
    first_of: list[int] = []
    inverse: list[int] = []
    seen: dict[tuple, int] = {}
    for r, p in enumerate(prompts):
        key = tuple(
            (tuple(x.shape), str(x.dtype), x.cpu().numpy().tobytes())
            for x in (p.token_ids, p.modality, p.visual_codes, *p.images)
        )
        if key not in seen:
            seen[key] = len(first_of)
            first_of.append(r)
        inverse.append(seen[key])
    return first_of, inverse
