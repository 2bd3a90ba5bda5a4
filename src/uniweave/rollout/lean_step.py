"""A lean decode step for transformers Llama decoders (an engine internal).

At one new position per row, `LlamaModel.forward` spends more of a small body's step in
Python (module calls, output capturing, mask building, config look-ups) than in kernels.
`LeanLlamaStep` runs the same tensor ops in the same order on the same weights: RMSNorm
in float32, the q / k / v projections, RoPE from the decoder's own rotary module, the
cache's `update`, SDPA with the mask transformers builds at one query (none when no key
is padding, else the key-padding mask [B, 1, 1, T]), the o-projection, the SwiGLU MLP and
the final norm. Its hidden states equal the decoder's bit for bit
(`tests/test_rollout_lean.py`).

`lean_step(model)` gives one only for a model whose body is exactly a transformers
`LlamaModel` (`UnifiedModel.plain_decoder`) of the configuration above: sdpa attention,
no biases, as many key/value heads as query heads, SiLU, no module hooks. Anything else
gets None and the engine runs the model's own forward (the same numbers, slower).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaModel,
    LlamaRMSNorm,
)


def lean_step(model: Any) -> LeanLlamaStep | None:
    """The lean step of `model`'s plain decoder, or None when it has none we can run."""
    hook = getattr(model, "plain_decoder", None)
    decoder = hook() if callable(hook) else None
    if decoder is None or not _supported(decoder):
        return None
    return LeanLlamaStep(decoder)


def _supported(decoder: nn.Module) -> bool:
    """True for a `LlamaModel` whose decode step `LeanLlamaStep` reproduces exactly."""
    if type(decoder) is not LlamaModel:
        return False
    cfg = decoder.config
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    if cfg.attention_bias or cfg.mlp_bias or cfg.num_key_value_heads != cfg.num_attention_heads:
        return False
    if len(decoder.layers) != cfg.num_hidden_layers:
        return False
    for layer in decoder.layers:
        if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention:
            return False
        if type(layer.mlp) is not LlamaMLP or type(layer.mlp.act_fn) not in (
            SiLUActivation,
            nn.SiLU,
        ):
            return False
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not LlamaRMSNorm for n in norms):
            return False
    if type(decoder.norm) is not LlamaRMSNorm:
        return False
    global_hooks = (
        nn.modules.module._global_forward_hooks,
        nn.modules.module._global_forward_pre_hooks,
    )
    if any(global_hooks):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in decoder.modules())


def _rms_norm(norm: LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`LlamaRMSNorm.forward`: x / sqrt(mean(x^2) + eps) in float32, times the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanLlamaStep:
    """`decoder(inputs_embeds, attention_mask, position_ids, cache)` at one position per
    row, op for op, without the module machinery (module docstring)."""

    def __init__(self, decoder: LlamaModel) -> None:
        self.decoder = decoder

    def __call__(
        self,
        embeds: torch.Tensor,
        key_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """Hidden states [B, 1, d] after the final norm. `embeds` [B, 1, d]; `key_mask`
        bool [B, T_past + 1] when some key is padding, else None; `position_ids` [B, 1];
        `cache` a transformers cache holding the T_past positions (appended to)."""
        decoder = self.decoder
        B, T, _ = embeds.shape
        cos, sin = decoder.rotary_emb(embeds, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        hidden = embeds
        for i, block in enumerate(decoder.layers):
            layer = cast(LlamaDecoderLayer, block)
            attn, mlp = layer.self_attn, layer.mlp
            residual = hidden
            x = _rms_norm(layer.input_layernorm, hidden)
            shape = (B, T, -1, attn.head_dim)
            q = F.linear(x, attn.q_proj.weight).view(shape).transpose(1, 2)
            k = F.linear(x, attn.k_proj.weight).view(shape).transpose(1, 2)
            v = F.linear(x, attn.v_proj.weight).view(shape).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            k, v = cache.update(k, v, i)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=0.0, scale=attn.scaling, is_causal=False
            )
            out = out.reshape(out.shape[0], -1, T, v.shape[-1]).transpose(1, 2).contiguous()
            out = F.linear(out.reshape(B, T, -1).contiguous(), attn.o_proj.weight)
            hidden = residual + out
            residual = hidden
            x = _rms_norm(layer.post_attention_layernorm, hidden)
            gate = F.silu(F.linear(x, mlp.gate_proj.weight))
            x = F.linear(gate * F.linear(x, mlp.up_proj.weight), mlp.down_proj.weight)
            hidden = residual + x
        return _rms_norm(decoder.norm, hidden)
