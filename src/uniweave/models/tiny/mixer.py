"""A depthwise causal convolution prior for the tiny decoder body ("Canon"-style mixing).

Each decoder layer's two normalised inputs (before attention, before the MLP) pass through

    y_t = x_t + sum_{j=0}^{k-1} w_j * x_{t-j}        (w_j in R^d, elementwise; x_{<0} = 0)

a per-channel convolution over the last k positions, O(k*d) per position. It gives every
position a cheap view of its neighbours, which is what multiple-choice symbol binding
("A ) 7": the letter must travel to the digit's position) needs before attention can look
it up (issue 15; `bench/mc_binding_probe.py --conv K` measures it without images).

Padding: an input at a position the attention mask marks invalid is zeroed before mixing,
so a left-padded row (rollout prefill) mixes exactly as the unpadded row would. Packing:
a packed row's block-causal mask is a query × key mask (below), so its taps stop at its
sequence boundaries.

Decoding: `MixCache` (a `DynamicCache`) carries each mixer's last k-1 (masked) inputs per
row; a call with T new positions mixes them with the carried ones, so the cached and the
full forward agree, and `batch_select_indices` keeps the carried inputs of the kept rows.

Query × key masks (Information Gain's blind views, packed rows; full forwards only): with a bool
[B, T, T] attention mask M, tap j of position p reads x_{p-j} only where M[b, p, p-j]
(`mixer_taps`), so a query that may not attend to a key does not mix it in either. With
M = causal & key-valid this equals the padding rule above at every real position.

The mask and the cache reach the mixers through a `MixContext` that the model sets at
every body call (the decoder layers' signatures carry neither the 2-D mask nor the cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache


class MixCache(DynamicCache):
    """A KV cache that also holds each mixer's last k-1 inputs, [B, k-1, d] per mixer."""

    def __init__(self) -> None:
        super().__init__()
        self.mix_states: dict[int, torch.Tensor] = {}

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        for key, state in self.mix_states.items():
            self.mix_states[key] = state[indices]


@dataclass
class MixContext:
    """What the mixers of one body call need: `valid` [B, T] (True at real positions of
    the T new inputs), the cache's states (None: a full forward with no cache) and, under
    a query × key mask, `taps` [B, T, k] (`mixer_taps`)."""

    valid: torch.Tensor | None = None
    states: dict[int, torch.Tensor] | None = field(default=None)
    taps: torch.Tensor | None = None


def mixer_taps(mask: torch.Tensor, kernel: int) -> torch.Tensor:
    """bool [B, T, k] of a query × key mask [B, T, T]: tap j of query p reads p − j iff
    mask[b, p, p − j] (never before position 0)."""
    B, T, _ = mask.shape
    out = torch.zeros(B, T, kernel, dtype=torch.bool, device=mask.device)
    for j in range(min(kernel, T)):
        out[:, j:, j] = mask.diagonal(offset=-j, dim1=1, dim2=2)
    return out


class CausalMixer(nn.Module):
    """y = x + depthwise causal conv_k(x) over the sequence axis (module docstring)."""

    def __init__(self, hidden_size: int, kernel: int, index: int, init_std: float) -> None:
        super().__init__()
        if kernel < 1:
            raise ValueError(f"mixer kernel must be >= 1, got {kernel}")
        self.kernel, self.index = kernel, index
        self.weight = nn.Parameter(torch.randn(kernel, hidden_size) * init_std)

    def forward(self, x: torch.Tensor, ctx: MixContext) -> torch.Tensor:
        if ctx.valid is None or ctx.valid.shape != x.shape[:2]:
            raise RuntimeError(
                f"mixer {self.index}: context mask {None if ctx.valid is None else tuple(ctx.valid.shape)} "
                f"does not match the input {tuple(x.shape[:2])}"
            )
        k, t = self.kernel, x.shape[1]
        if ctx.taps is not None:
            return self._masked(x, ctx.taps)
        x_in = x * ctx.valid.unsqueeze(-1).to(x.dtype)
        if ctx.states is None or self.index not in ctx.states:
            past = x_in.new_zeros(x.shape[0], k - 1, x.shape[2])
        else:
            past = ctx.states[self.index].to(x.dtype)
        padded = torch.cat([past, x_in], dim=1)
        if ctx.states is not None and k > 1:
            ctx.states[self.index] = padded[:, -(k - 1) :].detach()
        out = x
        for j in range(k):
            out = out + self.weight[j] * padded[:, k - 1 - j : k - 1 - j + t]
        return out

    def _masked(self, x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        """The mix under a query × key mask: tap j of position p only where taps[b, p, j]."""
        k, t = self.kernel, x.shape[1]
        padded = torch.cat([x.new_zeros(x.shape[0], k - 1, x.shape[2]), x], dim=1)
        out = x
        for j in range(k):
            tap = padded[:, k - 1 - j : k - 1 - j + t] * taps[..., j : j + 1].to(x.dtype)
            out = out + self.weight[j] * tap
        return out


class MixedNorm(nn.Module):
    """A decoder layer's norm followed by a `CausalMixer` (replaces the norm in place)."""

    def __init__(self, norm: nn.Module, mixer: CausalMixer, ctx: MixContext) -> None:
        super().__init__()
        self.norm, self.mixer = norm, mixer
        self._ctx = ctx

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mixer(self.norm(hidden_states), self._ctx)


def install_mixers(decoder: nn.Module, kernel: int, init_std: float | None = None) -> MixContext:
    """Put a mixer after `input_layernorm` and `post_attention_layernorm` of every layer of
    a Llama-like `decoder`; return the context the caller fills at each body call.

    `init_std` (default 1/sqrt(k)): the taps start far from zero, so from the first update
    every position carries its neighbours (a letter reaches the digit after "A )"), which
    is what lets attention bind them before any previous-token head has formed."""
    init_std = kernel**-0.5 if init_std is None else init_std
    ctx = MixContext()
    layers: Any = decoder.layers  # an nn.ModuleList of Llama-like layers
    for i, layer in enumerate(layers):
        d = layer.input_layernorm.weight.shape[0]
        layer.input_layernorm = MixedNorm(
            layer.input_layernorm, CausalMixer(d, kernel, 2 * i, init_std), ctx
        )
        layer.post_attention_layernorm = MixedNorm(
            layer.post_attention_layernorm, CausalMixer(d, kernel, 2 * i + 1, init_std), ctx
        )
    return ctx
