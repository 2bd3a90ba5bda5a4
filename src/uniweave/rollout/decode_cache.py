"""Preallocated KV storage for the decode loop (an engine internal).

transformers' `DynamicLayer` appends each step's keys and values with `torch.cat`, which
copies the whole cache of every layer at every step: O(T) per step, O(T^2) per rollout,
and on the dev CPU the largest cost of a decode step. `GrowingLayer` is a `DynamicLayer`
whose keys and values are views `[:, :, :n]` of a buffer with spare positions: a step
writes its new positions in place; the buffer doubles when it is full (amortised O(1)
per position). Compaction (`batch_select_indices`) gathers the kept rows' used positions
to the front of the same buffer (in place: nothing is reallocated); `compact` with a
`holes_filled` order moves only the rows that change place. Attention reads the same
numbers as with `cat`, in the same layout apart from the row stride, so the decode is
unchanged.

`preallocate(cache)` installs it into an empty cache that would otherwise create plain
`DynamicLayer`s (any `DynamicCache` subclass, e.g. the tiny model's `MixCache`); any other
cache is left as the model made it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

RESERVE = 64


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` with in-place appends into a buffer of spare capacity."""

    def __init__(self, reserve: int = RESERVE) -> None:
        super().__init__()
        self.reserve = reserve
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._n = 0

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers (after the first update)."""
        assert self._keys is not None and self._values is not None
        return self._keys, self._values

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._buffers()
        self.keys = keys[:, :, : self._n]
        self.values = values[:, :, : self._n]
        return self.keys, self.values

    def _grow(self, need: int) -> None:
        cap = max(2 * need, need + self.reserve)
        keys, values = self._buffers()
        shape = (*keys.shape[:2], cap, keys.shape[-1])
        self._keys = new_k = keys.new_empty(shape)
        self._values = new_v = values.new_empty((*values.shape[:2], cap, values.shape[-1]))
        new_k[:, :, : self._n] = keys[:, :, : self._n]
        new_v[:, :, : self._n] = values[:, :, : self._n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        if self._keys is None:
            self._keys, self._values = key_states[:, :, :0], value_states[:, :, :0]
            self._grow(t)
        elif self._n + t > self._keys.shape[-2]:
            self._grow(self._n + t)
        keys, values = self._buffers()
        keys[:, :, self._n : self._n + t] = key_states
        values[:, :, self._n : self._n + t] = value_states
        self._n += t
        return self._views()

    def get_seq_length(self) -> int:
        return self._n

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (in this order), moved to the front of the same buffer;
        more rows than the buffer holds (a shared prefill copied to its group's rows) get
        a new buffer."""
        if self._keys is None:
            return
        keys, values = self._buffers()
        k, n = len(indices), self._n
        if k > keys.shape[0]:
            self._keys = new_k = keys.new_empty((k, *keys.shape[1:]))
            self._values = new_v = values.new_empty((k, *values.shape[1:]))
            new_k[:, :, :n] = keys[indices, :, :n]
            new_v[:, :, :n] = values[indices, :, :n]
            self._views()
            return
        keys[:k, :, :n] = keys[indices, :, :n]
        values[:k, :, :n] = values[indices, :, :n]
        self._keys, self._values = keys[:k], values[:k]
        self._views()

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, keep: int) -> None:
        """Copy rows `src` onto rows `dst` (in place), then keep the first `keep` rows."""
        if self._keys is None:
            return
        keys, values = self._buffers()
        n = self._n
        keys[dst, :, :n] = keys[src, :, :n]
        values[dst, :, :n] = values[src, :, :n]
        self._keys, self._values = keys[:keep], values[:keep]
        self._views()

    def reset(self) -> None:
        self._keys = self._values = None
        self._n = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of positions to remove")
        if tokens_to_remove and self._keys is not None:
            self._n = max(0, self._n + tokens_to_remove)
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._keys is None:
            return
        keys, values = self._buffers()
        self._keys = keys.repeat_interleave(repeats, dim=0)
        self._values = values.repeat_interleave(repeats, dim=0)
        self._views()


def preallocate(cache: Any) -> Any:
    """`cache` with `GrowingLayer`s in place of the `DynamicLayer`s it would create (when
    it is empty and creates exactly `DynamicLayer`); otherwise `cache` unchanged."""
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) or getattr(cache, "offloading", False):
        return cache
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
    return cache


def holes_filled(kept: list[int]) -> list[int]:
    """The new batch order when rows `kept` (ascending) stay: a kept row below
    len(kept) keeps its place, the kept rows beyond it fill the freed places in order.
    Compaction then moves only those rows (`compact`), not every kept row."""
    k, keep = len(kept), set(kept)
    movers = iter([r for r in kept if r >= k])
    return [b if b in keep else next(movers) for b in range(k)]


def compact(cache: Any, order: list[int], device: torch.device) -> None:
    """Keep batch rows `order` (from `holes_filled`) of `cache`, whose tensors are on
    `device`. A plain `DynamicCache` of `GrowingLayer`s moves only the rows that change
    place; any other cache (e.g. one that carries more per-row state) selects through
    its own `batch_select_indices`."""
    plain = type(cache).batch_select_indices is DynamicCache.batch_select_indices
    if not plain or not all(isinstance(layer, GrowingLayer) for layer in cache.layers):
        cache.batch_select_indices(torch.tensor(order, device=device))
        return
    moved = [(b, r) for b, r in enumerate(order) if b != r]
    dst = torch.tensor([b for b, _ in moved], dtype=torch.long, device=device)
    src = torch.tensor([r for _, r in moved], dtype=torch.long, device=device)
    for layer in cache.layers:
        layer.move_rows(dst, src, len(order))
