"""Continuous batching for the rollout engine (an engine internal; docs/architecture.md §4).

`SlotBatch` decodes a fixed number of *slots* over one preallocated KV buffer per layer
([slots, heads, columns, head_dim]). Every step writes column `n` of every slot (one
shared column counter), so a step is one batched forward exactly like the static batch's.
Each slot holds its own row: its prompt occupies the columns [start, n) right before the
shared counter, everything left of `start` is masked off, and its positions are its own
(`next_position` per slot: RoPE positions 0.. of that row alone). When a row finishes,
its slot is free; the engine admits the next waiting request into it: the waiting
prompts are prefilled together (each distinct prompt once: a GRPO group's G members share
one prefill, `decode_batch.distinct_rows`) into a scratch cache, and each admitted row's
prompt keys/values are copied into its slot at columns [n - P, n). The other slots keep
decoding; nothing is recomputed.

Attention reads only the window [lo, n] where lo is the earliest `start` of a live slot
(the columns every live row may need); when the buffer is full the window is moved to
the front (or the buffer doubles). The column counter starts at the longest prompt of
the whole call, so any later prompt fits left of it.

Rows (a request's conditional row and, when guided, its unconditional twin) and their
states, seeds and sampling are the engine's (`RolloutEngine._act`): a guided request's
two rows are admitted, stepped and retired together, and its guided logits are formed
once per pair. A trajectory therefore does not depend on the slots it was decoded in,
up to the floating-point noise of the batch geometry (the same noise that the static
engine has between batch sizes).

Supported: models with the default RoPE positions (`UnifiedModel.decode_positions` not
overridden: not UniAR's M-RoPE) and a plain transformers `DynamicCache` (not the tiny
model's conv-prior `MixCache`); `check_supported` refuses the rest.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from uniweave.core.trajectory import Trajectory
from uniweave.core.types import Modality
from uniweave.models.base import ModelInputs, UnifiedModel
from uniweave.rollout.decode_batch import distinct_rows, step_tensors
from uniweave.rollout.decode_cache import RESERVE, preallocate


def unsupported(model: UnifiedModel) -> str | None:
    """Why `model` cannot decode in slots (None when it can)."""
    if type(model).decode_positions is not UnifiedModel.decode_positions:
        return (
            f"{type(model).__name__} has its own decode positions (M-RoPE); continuous "
            "batching is built for plain RoPE positions"
        )
    cache = model.new_cache()
    if type(cache) is not DynamicCache:
        return (
            f"{type(model).__name__} decodes with a {type(cache).__name__} (per-row state "
            "beyond keys/values); continuous batching is built for a plain DynamicCache"
        )
    return None


def check_supported(model: UnifiedModel) -> None:
    reason = unsupported(model)
    if reason is not None:
        raise ValueError(reason)


class SlotLayer(DynamicLayer):
    """One layer's keys/values of every slot: views [lo, n) of a [S, H, C, D] buffer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, lo: int, n: int) -> None:
        super().__init__()
        self.buf_k, self.buf_v = keys, values
        self.lo, self.n = lo, n
        self.device = keys.device
        self.is_initialized = True
        self.views()

    def views(self) -> None:
        self.keys = self.buf_k[:, :, self.lo : self.n]
        self.values = self.buf_v[:, :, self.lo : self.n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = key_states.shape[-2]
        self.buf_k[:, :, self.n : self.n + t] = key_states
        self.buf_v[:, :, self.n : self.n + t] = value_states
        self.n += t
        self.views()
        return self.buf_k[:, :, self.lo : self.n], self.buf_v[:, :, self.lo : self.n]

    def get_seq_length(self) -> int:
        return self.n - self.lo


class SlotBatch:
    """Device-side state of continuous batching (module docstring): the slot KV buffers,
    the key mask, each slot's first prompt column, next position and last hidden state."""

    def __init__(self, model: UnifiedModel, slots: int, margin: int, lean: Any) -> None:
        self.model, self.S, self.margin, self.lean = model, slots, margin, lean
        self.n = margin  # the next column every slot writes
        self.lo = margin
        self.cache: DynamicCache | None = None  # built at the first admission (`_allocate`)
        self.mask = torch.zeros(0, 0, dtype=torch.bool)  # bool [S, C]
        self.start: list[int | None] = [None] * slots  # first column of each live slot
        self.next_position = torch.zeros(0, dtype=torch.long)  # long [S]
        self.hidden = torch.zeros(0, 0)  # [S, d]
        self.bits: int | None = None

    @property
    def layers(self) -> list[SlotLayer]:
        """The slot layers of the cache (after the first admission)."""
        assert self.cache is not None, "no slot cache before the first admission"
        return cast("list[SlotLayer]", self.cache.layers)

    # ---- admission -------------------------------------------------------------------
    def admit(self, placed: list[tuple[int, Trajectory]], pad_id: int) -> None:
        """Prefill the prompts of `placed` ((slot, prompt) pairs; each distinct prompt once)
        and copy each prompt's keys/values, position and last hidden state into its slot."""
        prompts = [p for _, p in placed]
        first_of, inverse = distinct_rows(prompts)
        run = [prompts[i] for i in first_of]
        inputs = self.model.prepare_prompts(run, pad_id)
        scratch = preallocate(self.model.new_cache())
        out = self.model.hidden(inputs, scratch)
        width = inputs.token_ids.shape[1]
        last = out.hidden[:, -1]
        nxt = self.model.decode_positions(inputs).next_position
        if self.cache is None:
            self._allocate(out.cache, last, prompts[0])
        n = self.n
        for (slot, prompt), j in zip(placed, inverse):
            P = len(prompt)
            for layer, src in zip(self.layers, out.cache.layers):
                layer.buf_k[slot, :, n - P : n] = src.keys[j, :, width - P :]
                layer.buf_v[slot, :, n - P : n] = src.values[j, :, width - P :]
            self.mask[slot, :n] = False
            self.mask[slot, n - P : n] = True
            self.start[slot] = n - P
            self.next_position[slot] = nxt[j]
            self.hidden[slot] = last[j]
        self._window()

    def _allocate(self, scratch: Any, last: torch.Tensor, prompt: Trajectory) -> None:
        C = self.margin + 2 * RESERVE
        layers = []
        for src in scratch.layers:
            _, H, _, D = src.keys.shape
            k = src.keys.new_zeros(self.S, H, C, D)
            v = src.values.new_zeros(self.S, H, C, src.values.shape[-1])
            layers.append(SlotLayer(k, v, self.lo, self.n))
        self.cache = DynamicCache()
        self.cache.layers = list(layers)
        self.mask = torch.zeros(self.S, C, dtype=torch.bool, device=last.device)
        self.next_position = torch.zeros(self.S, dtype=torch.long, device=last.device)
        self.hidden = last.new_zeros(self.S, last.shape[-1])
        codes = prompt.visual_codes
        self.bits = int(codes.shape[1]) if codes.dim() == 2 else None

    def free(self, slot: int) -> None:
        self.start[slot] = None

    def _window(self) -> None:
        live = [s for s in self.start if s is not None]
        self.lo = min(live) if live else self.n
        for layer in self.layers:
            layer.lo = self.lo
            layer.views()

    # ---- compaction (no request waiting) ---------------------------------------------
    def select(self, keep: list[int]) -> None:
        """Keep only slots `keep` (in this order)."""
        idx = torch.tensor(keep, device=self.mask.device)
        for layer in self.layers:
            layer.buf_k, layer.buf_v = layer.buf_k[idx], layer.buf_v[idx]
            layer.views()
        self.mask, self.hidden = self.mask[idx], self.hidden[idx]
        self.next_position = self.next_position[idx]
        self.start = [self.start[s] for s in keep]
        self.S = len(keep)

    # ---- decoding ----------------------------------------------------------------------
    def _room(self) -> None:
        """Make column n writable: move the live window to the front, or double."""
        C = self.mask.shape[1]
        if self.n < C:
            return
        shift = self.lo - 0
        shift = min(shift, self.n - self.margin)  # later prompts still fit left of n
        if shift >= C // 4:
            w = self.n - shift
            for layer in self.layers:
                layer.buf_k[:, :, :w] = layer.buf_k[:, :, shift : self.n].clone()
                layer.buf_v[:, :, :w] = layer.buf_v[:, :, shift : self.n].clone()
            self.mask[:, :w] = self.mask[:, shift : self.n].clone()
            self.mask[:, w:] = False
            self.start = [None if s is None else s - shift for s in self.start]
            self.n, self.lo = w, self.lo - shift
        else:
            grow = C
            for layer in self.layers:
                layer.buf_k = torch.cat(
                    [layer.buf_k, torch.zeros_like(layer.buf_k)[:, :, :grow]], 2
                )
                layer.buf_v = torch.cat(
                    [layer.buf_v, torch.zeros_like(layer.buf_v)[:, :, :grow]], 2
                )
            self.mask = torch.cat([self.mask, torch.zeros_like(self.mask)[:, :grow]], 1)
        for layer in self.layers:
            layer.n, layer.lo = self.n, self.lo
            layer.views()

    def step(self, inputs: tuple[list, list, list, list]) -> None:
        """Feed one position per slot (padding in free slots)."""
        self._room()
        ids = inputs[0]
        ids_t, mod_t, codes_t, where_t = step_tensors(inputs, self.bits, self.mask.device)
        self.mask[:, self.n] = True
        keys = self.mask[:, self.lo : self.n + 1]
        # No masked key in the window (every slot live since lo): no mask, as the static
        # engine and transformers pass none then (the same numbers, a faster SDPA path).
        dense = all(s == self.lo for s in self.start)
        pos = self.next_position[:, None]
        self.next_position = self.next_position + 1
        step = ModelInputs(
            token_ids=ids_t,
            modality=mod_t,
            visual_codes=codes_t,
            attention_mask=keys,
            position_ids=pos,
            image_position=where_t,
            images=[[] for _ in ids],
        )
        if self.lean is None:
            out = self.model.hidden(step, self.cache)
            self.hidden = out.hidden[:, -1]
        else:
            mask = None if dense else keys
            self.hidden = self.lean(self.model.embed(step), mask, pos, self.cache)[:, -1]
        self.n += 1


def pad_input(pad_id: int) -> tuple[int, int, None, int]:
    """The input fed to a free slot."""
    return pad_id, int(Modality.TEXT), None, 0
