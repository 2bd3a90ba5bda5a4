"""Replay: log-prob parity with the sampler, policy refusal, chunked heads and gradients."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_fixtures import batch_logp_bounds, mixed_requests, mixed_samples, tiny_model
from tolerances import decoder_reductions, fp32_storage_bound, reduction_bound

from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.forward import scored_indices
from uniweave.replay import replay_distributions, replay_logprobs, replay_map
from uniweave.rollout import RolloutEngine, RolloutRequest, SamplingParams, sampling_records


def _rollout(model, text, image, n_per_task=2):
    trajs = RolloutEngine(model).generate(mixed_requests(mixed_samples(n_per_task), text, image))
    return trajs, TrajectoryBatch.collate(trajs, model.tokenizer.pad_token_id)


def _check_parity(model, trajs, batch, tol=None):
    """Replay (one full forward) vs rollout (KV cache, batched): two fp32 paths, bounded per
    position by `batch_logp_bounds` (tests/tolerances.py), or by `tol` [B, T]."""
    with torch.no_grad():
        out = replay_logprobs(model, batch, sampling_records(trajs))
    policy = batch.policy_mask
    assert (out.logp[~policy] == 0).all()
    if tol is None:
        tol = batch_logp_bounds(model, trajs, batch.rollout_logp.shape)
    err = (out.logp.float() - batch.rollout_logp).abs()
    assert bool((err <= tol).all()), float((err / tol.clamp(min=1e-30)).max())
    if batch.is_bits:
        tol_f = batch_logp_bounds(model, trajs, batch.rollout_logp.shape, factors=True)
        err_f = (out.logp_factors.float() - batch.rollout_logp_factors).abs()
        assert bool((err_f <= tol_f[..., None]).all()), float(err_f.max())
    return out


def test_text_logprobs_match_rollout_with_per_row_params():
    model = tiny_model("vq")
    samples = [s for s in mixed_samples(3) if s.task != "t2i"]
    params = [
        SamplingParams(max_new_tokens=30),
        SamplingParams(temperature=0.7, top_k=12, max_new_tokens=18),
        SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=25),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=7),
    ]
    requests = [RolloutRequest(s, 100 + k, params[k % 4]) for k, s in enumerate(samples)]
    trajs = RolloutEngine(model).generate(requests)
    assert len({len(t) for t in trajs}) > 3  # rows of different lengths
    batch = TrajectoryBatch.collate(trajs, model.tokenizer.pad_token_id)
    _check_parity(model, trajs, batch)


@pytest.mark.parametrize("kind", ["vq", "bsq"])
@pytest.mark.parametrize(
    "guidance, mode",
    [(1.0, "guided"), (3.0, "guided"), (3.0, "conditional")],
    ids=["no-cfg", "cfg-guided", "cfg-conditional"],
)
def test_visual_logprobs_match_rollout(kind, guidance, mode):
    model = tiny_model(kind)
    truncate = {"top_k": 9, "top_p": 0.95} if mode == "guided" else {}
    image = SamplingParams(
        max_new_tokens=16,
        length_semantics="exact",
        guidance=guidance,
        guidance_logprob=mode,
        temperature=0.8,
        bit_temperature=0.7,
        **truncate,
    )
    text = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50)
    trajs, batch = _rollout(model, text, image)
    assert batch.visual_mask.any() and batch.rollout_logp.isfinite().all()
    _check_parity(model, trajs, batch)


def test_guided_replay_is_exact_in_float64():
    """In float64 replay and rollout differ only by the float32 storage of rollout_logp."""
    model = tiny_model("vq", init=0.5).double()
    image = SamplingParams(
        max_new_tokens=16, length_semantics="exact", guidance=4.0, top_k=8, top_p=0.9
    )
    text = SamplingParams(max_new_tokens=12, top_p=0.85, temperature=0.6)
    trajs, batch = _rollout(model, text, image)
    _check_parity(model, trajs, batch, tol=fp32_storage_bound(batch.rollout_logp).float())


def test_replay_refuses_a_different_policy():
    model = tiny_model("vq")
    image = SamplingParams(max_new_tokens=16, length_semantics="exact", guidance=3.0)
    trajs, batch = _rollout(model, SamplingParams(max_new_tokens=6), image, n_per_task=1)
    records = sampling_records(trajs)
    for change, field in (
        ({"guidance": 2.0}, "guidance"),
        ({"guidance_logprob": "conditional"}, "guidance_logprob"),
        ({"temperature": 0.5}, "temperature"),
    ):
        with pytest.raises(ValueError, match=f"{field}: sampled"):
            replay_logprobs(model, batch, records, params=replace(image, **change))
    same = replace(image, max_new_tokens=99, greedy=True)  # not part of the policy
    t2i = [k for k, s in enumerate(batch.sample_ids) if s.startswith("t2i")]
    with torch.no_grad():
        out = replay_logprobs(model, batch[t2i], [records[k] for k in t2i], params=same)
    tol = batch_logp_bounds(model, [trajs[k] for k in t2i], out.logp.shape)
    assert bool(((out.logp - batch[t2i].rollout_logp).abs() <= tol).all())
    with pytest.raises(ValueError, match="records"):
        replay_logprobs(model, batch, records[:-1])


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_heads_only_at_policy_positions_in_chunks(kind):
    model = tiny_model(kind)
    image = SamplingParams(max_new_tokens=16, length_semantics="exact", guidance=2.0)
    trajs, batch = _rollout(model, SamplingParams(max_new_tokens=20), image)
    records = sampling_records(trajs)
    seen = {"text": [], "visual": []}
    hooks = [
        model.text_head.register_forward_hook(lambda m, i, o: seen["text"].append(i[0].shape)),
        model.visual_head_proj.register_forward_hook(
            lambda m, i, o: seen["visual"].append(i[0].shape)
        ),
    ]
    chunk = 7
    with torch.no_grad():
        out = replay_logprobs(model, batch, records, chunk_size=chunk)
    for h in hooks:
        h.remove()
    text_index, visual_index = scored_indices(batch)
    assert sum(s[0] for s in seen["text"]) == len(text_index)
    assert all(s[0] <= chunk for s in seen["text"])
    # guided visual chunks carry the conditional and the unconditional rows together
    assert sum(s[0] for s in seen["visual"]) == 2 * len(visual_index)
    assert all(s[0] <= 2 * chunk for s in seen["visual"])
    rebuilt = torch.zeros_like(out.logp)
    with torch.no_grad():
        for c in replay_distributions(model, batch, records, chunk_size=chunk):
            assert len(c) <= chunk
            assert (c.modality == Modality.VISUAL) == bool(batch.visual_mask[c.rows, c.cols].all())
            rebuilt[c.rows, c.cols] = c.dist.log_prob(c.targets)
    assert torch.equal(rebuilt, out.logp)  # the same chunks through the same kernels


def test_replay_map_gradients_do_not_depend_on_chunking():
    model = tiny_model("vq").train()
    image = SamplingParams(max_new_tokens=16, length_semantics="exact", guidance=2.0)
    trajs, batch = _rollout(model, SamplingParams(max_new_tokens=10), image, n_per_task=1)
    records = sampling_records(trajs)

    def entropy(chunk):
        return chunk.dist.entropy()

    grads = []
    for chunk_size in (3, 10_000):
        model.zero_grad()
        values = replay_map(model, batch, records, entropy, chunk_size=chunk_size)
        assert (values[~batch.policy_mask] == 0).all()
        values.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    # the heads' GEMMs in chunks of 3 or in one: two fp32 paths back through the decoder,
    # whose weight gradients also reduce over the batch's B * T positions
    c = model.config
    B, T = batch.token_ids.shape
    n = B * T + decoder_reductions(
        c.hidden_size,
        c.intermediate_size,
        c.num_layers,
        T,
        c.hidden_size // c.num_heads,
        mixer_kernel=c.mixer_kernel,
    )
    for a, b in zip(*grads):
        assert float((a - b).abs().max()) <= reduction_bound(float(b.abs().max()), n)
