"""A direct one-query attention for the decode loop (an engine internal).

A decode step asks attention for one query per row against the cached keys. torch's
`scaled_dot_product_attention` on CPU runs its flash kernel there, which pays per
(row, head) block and per call setup far above the arithmetic at the tiny/Llama sizes
(about 1.1–1.6 ms per layer call at 128 rows × 4 heads × 30 keys, against about 0.4 ms
for the same math as two batched matmuls). `decode_attention` computes

    out = softmax(q kᵀ · scale + mask) v          (bool mask: −inf where False)

as two batched matmuls (`bmm` over rows × heads) for one-query calls and hands every other call (prefill, training
forwards, dropout) to transformers' SDPA function unchanged. `use_decode_attention(model)`
switches the model's configs that use "sdpa" to it for the duration of a `with` block
(restored after, also on error); the weights, the cache and the masks are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "unirl_decode"


def decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, q, D], key/value
    [B, H_kv, T, D], bool or additive mask [B, 1 | H, q, T] or None; returns [B, q, H, D]."""
    if query.shape[2] != 1 or dropout or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    B, H, _, D = query.shape
    T = key.shape[2]
    scale = scaling if scaling is not None else D**-0.5
    scores = torch.bmm(query.reshape(B * H, 1, D), key.reshape(B * H, T, D).transpose(1, 2))
    scores = scores.view(B, H, 1, T) * scale
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    probs = scores.softmax(-1).view(B * H, 1, T)
    out = torch.bmm(probs, value.reshape(B * H, T, value.shape[-1])).view(B, H, 1, -1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, decode_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


@contextmanager
def use_decode_attention(model: nn.Module) -> Iterator[None]:
    """Inside the block, every config of `model`'s modules whose attention is "sdpa" uses
    `decode_attention` (same masks: `sdpa_mask`); other configs are left alone."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) == "sdpa":
            configs[id(config)] = config
    # Set on each config itself (the property's setter would also overwrite sub-configs).
    for config in configs.values():
        config._attn_implementation_internal = NAME
    try:
        yield
    finally:
        for config in configs.values():
            config._attn_implementation_internal = "sdpa"
