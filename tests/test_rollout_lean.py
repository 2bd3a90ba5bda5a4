"""The lean decode step (`uniweave.rollout.lean_step`) is the Llama body's forward, bit for bit.

Checked three ways on tiny models without the conv prior (the bodies it applies to):
one step against `LlamaModel.forward` on the same cache, with and without padded keys;
whole rollouts (VQ and BSQ, text and images, guidance, sampling with truncation, left
padding and compaction) with the lean step on and off give identical tokens and
identical rollout log-probs; and the models it must not take (conv prior, a forward hook
on the body) get no lean step.
"""

from __future__ import annotations

import pytest
import torch
from rollout_fixtures import mixed_requests, mixed_samples, tiny_model

from uniweave.rollout import RolloutEngine, SamplingParams
from uniweave.rollout.decode_cache import compact, holes_filled, preallocate
from uniweave.rollout.lean_step import lean_step


@pytest.mark.parametrize("padded", [False, True])
def test_lean_step_equals_the_decoder_forward(padded):
    model = tiny_model("vq", mixer_kernel=0)
    decoder, step = model.decoder, lean_step(model)
    assert step is not None
    B, T, d = 5, 7, model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randn(B, T, d, generator=g)
    mask = torch.ones(B, T + 3, dtype=torch.bool)
    if padded:
        mask[1, :3] = mask[3, :1] = False
    positions = (mask[:, :T].long().cumsum(-1) - 1).clamp(min=0)
    caches = [preallocate(model.new_cache()) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            decoder(
                inputs_embeds=prompt,
                attention_mask=mask[:, :T].long(),
                position_ids=positions,
                cache=cache,
                use_cache=True,
            )
        pos = positions[:, -1:]
        for t in range(3):
            x = torch.randn(B, 1, d, generator=g)
            pos = pos + 1
            keys = mask[:, : T + t + 1]
            ref = decoder(
                inputs_embeds=x,
                attention_mask=keys.long(),
                position_ids=pos,
                cache=caches[0],
                use_cache=True,
            ).last_hidden_state
            got = step(x, keys if padded else None, pos, caches[1])
            assert torch.equal(ref, got), t
            for a, b in zip(caches[0].layers, caches[1].layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_rollouts_with_and_without_the_lean_step_are_identical(kind):
    model = tiny_model(kind, mixer_kernel=0)
    text = SamplingParams(max_new_tokens=24, temperature=1.3, top_k=40, top_p=0.9)
    image = SamplingParams(max_new_tokens=16, length_semantics="exact", guidance=2.0)
    requests = mixed_requests(mixed_samples(3), text, image)
    lean = RolloutEngine(model).generate(requests)
    generic = RolloutEngine(model, lean=False).generate(requests)
    assert any(len(t) != len(lean[0]) for t in lean)  # rows of several lengths: compaction
    for a, b in zip(lean, generic):
        assert torch.equal(a.token_ids, b.token_ids), a.sample_id
        assert torch.equal(a.visual_codes, b.visual_codes), a.sample_id
        assert torch.equal(a.rollout_logp, b.rollout_logp), a.sample_id
        if kind == "bsq":
            assert torch.equal(a.rollout_logp_factors, b.rollout_logp_factors)


def test_no_lean_step_for_bodies_it_does_not_reproduce():
    assert lean_step(tiny_model("vq")) is None  # the conv prior runs inside the body
    model = tiny_model("vq", mixer_kernel=0)
    handle = model.decoder.layers[0].mlp.register_forward_hook(lambda *args: None)
    assert lean_step(model) is None
    handle.remove()
    assert lean_step(model) is not None


def test_compaction_moving_only_the_holes_equals_a_full_select():
    """`compact` with a `holes_filled` order leaves the cache a full
    `batch_select_indices` of the same order leaves, and orders every kept row once."""
    kept = [0, 2, 3, 6, 7, 9]
    order = holes_filled(kept)
    assert sorted(order) == kept and order[:4:3] == [0, 3]
    model = tiny_model("vq", mixer_kernel=0)
    g = torch.Generator().manual_seed(1)
    caches = [preallocate(model.new_cache()) for _ in range(2)]
    x = torch.randn(10, 5, model.config.hidden_size, generator=g)
    with torch.inference_mode():
        for cache in caches:
            model.decoder(inputs_embeds=x, cache=cache, use_cache=True)
        compact(caches[0], order, torch.device("cpu"))
        caches[1].batch_select_indices(torch.tensor(order))
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert a.keys.shape[0] == len(kept)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
