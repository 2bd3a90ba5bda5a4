"""The engine's one-query decode attention: the same numbers as SDPA, the same rollouts."""

from __future__ import annotations

import pytest
import torch
from rollout_fixtures import mixed_requests, mixed_samples, tiny_model
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from unirl.rollout import RolloutEngine, SamplingParams
from unirl.rollout.decode_attention import decode_attention, use_decode_attention


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_attention_equals_sdpa(groups, mask, q_len):
    gen = torch.Generator().manual_seed(0)
    B, H, T, D = 5, 4, 9, 8
    module = nn.Module()
    module.num_key_value_groups = groups
    query = torch.randn(B, H, q_len, D, generator=gen)
    # keys as the engine's cache holds them: a view of a longer buffer
    key = torch.randn(B, H // groups, T + 4, D, generator=gen)[:, :, :T]
    value = torch.randn(B, H // groups, T + 4, D, generator=gen)[:, :, :T]
    valid = torch.rand(B, 1, q_len, T, generator=gen) > 0.3
    valid[..., -1] = True
    attn = {
        "none": None,
        "bool": valid,
        "additive": torch.zeros(valid.shape).masked_fill(~valid, torch.finfo(torch.float32).min),
    }[mask]
    ours, _ = decode_attention(module, query, key, value, attn, scaling=0.3, is_causal=False)
    ref, _ = sdpa_attention_forward(module, query, key, value, attn, scaling=0.3, is_causal=False)
    assert ours.shape == ref.shape == (B, q_len, H, D)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_engine_with_direct_attention_samples_the_same_rows():
    model = tiny_model("vq")
    text = SamplingParams(max_new_tokens=12, temperature=0.9)
    image = SamplingParams(max_new_tokens=16, length_semantics="exact", guidance=3.0)
    requests = mixed_requests(mixed_samples(2), text, image)
    calls = []
    hook = model.decoder.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a, k: calls.append(m.config._attn_implementation), with_kwargs=True
    )
    direct = RolloutEngine(model).generate(requests)
    sdpa = RolloutEngine(model, direct_attention=False).generate(requests)
    hook.remove()
    assert set(calls) == {"unirl_decode", "sdpa"}
    assert model.decoder.config._attn_implementation == "sdpa"  # restored after decoding
    for a, b in zip(direct, sdpa):
        assert torch.equal(a.token_ids, b.token_ids)
        torch.testing.assert_close(a.rollout_logp, b.rollout_logp, rtol=0, atol=1e-5)


def test_configs_restored_after_an_error():
    model = tiny_model("vq")
    with pytest.raises(RuntimeError, match="inside"):
        with use_decode_attention(model):
            assert model.decoder.config._attn_implementation == "unirl_decode"
            raise RuntimeError("inside")
    assert model.decoder.config._attn_implementation == "sdpa"
