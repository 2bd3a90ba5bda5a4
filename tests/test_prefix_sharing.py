"""Prompt-prefix sharing: the engine's shared prefill and replay's shared prompt forward.

Rollout: prefilling each distinct prompt once and copying its cache to the G rows that
hold it gives the same tokens and log-probs as prefilling every row. Replay / GRPO: running
each distinct prompt once (`share_prompt_prefix`) gives the same hidden states, loss and
gradients as the unshared forward, in float64 (transformers' RMSNorm computes in float32,
so sums over a group's rows in another order differ at ~1e-7 relative).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_fixtures import codec, mixed_requests, mixed_samples, tiny_model, tokenizer
from tolerances import (
    assert_within,
    fp64_forward_bound,
    gradient_reductions,
    guidance_gain,
    logprob_bound,
    magnitude,
    mixed_fp64_bound,
    rmsnorm_fp32_reductions,
    tiny_decoder_reductions,
)

from uniweave.config import validate_config
from uniweave.config.algorithms import GRPOConfig
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.forward import body_hidden, prefix_groups, prompt_lengths, shared_prefix_hidden
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.replay import replay_logprobs
from uniweave.rollout import RolloutEngine, SamplingParams, sampling_records
from uniweave.train.methods.grpo.objective import GRPOObjective

G = 3


def plain_model(kind: str) -> TinyUnifiedModel:
    """A tiny model without the conv prior (the one prefix sharing is built for)."""
    torch.manual_seed(0)
    config = TinyArchitecture(
        visual_head=kind,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        initializer_range=0.1,
        mixer_kernel=0,
    )
    return TinyUnifiedModel(config, tokenizer(), codec(kind)).eval()


def group_requests(guidance: float) -> list:
    """G requests per sample of the four digits tasks (same prompt, seeds apart)."""
    text = SamplingParams(max_new_tokens=12, temperature=0.9)
    image = SamplingParams(max_new_tokens=16, length_semantics="exact", guidance=guidance)
    base = mixed_requests(mixed_samples(2), text, image)
    return [replace(r, prompt=r.prompt.fork(m), seed=r.seed + m) for r in base for m in range(G)]


def prefill_rows(model, engine: RolloutEngine, requests) -> tuple[list, int]:
    """The trajectories and the batch size of the engine's first body forward."""
    rows = []
    hook = model.decoder.register_forward_pre_hook(
        lambda m, a, k: rows.append(k["inputs_embeds"].shape[0]), with_kwargs=True
    )
    try:
        trajs = engine.generate(requests)
    finally:
        hook.remove()
    return trajs, rows[0]


@pytest.mark.parametrize("kind, guidance", [("vq", 1.0), ("vq", 3.0), ("bsq", 1.0)])
def test_shared_prefill_gives_the_same_trajectories(kind, guidance):
    model = tiny_model(kind)  # the default body, conv prior included (its cache is shared too)
    requests = group_requests(guidance)
    shared, n_shared = prefill_rows(model, RolloutEngine(model), requests)
    alone, n_alone = prefill_rows(model, RolloutEngine(model, share_prefill=False), requests)
    engine = RolloutEngine(model)
    prompts = [engine.prompt_trajectory(r)[0] for r in requests]
    distinct = {(tuple(p.token_ids.tolist()), p.visual_codes.numpy().tobytes()) for p in prompts}
    n_twins = sum(r.params.guided for r in requests)
    assert n_alone == len(requests) + n_twins
    # one row per distinct prompt; all t2i rows' unconditional twins hold one prompt
    assert n_shared == len(distinct) + (n_twins > 0) < n_alone
    for a, b, p, r in zip(shared, alone, prompts, requests):
        # prompts serialised once per forked sample (`RolloutEngine._prompt`) are the
        # request's own prompt, under its own id
        assert a.sample_id == r.prompt.id and torch.equal(a.token_ids[: len(p)], p.token_ids)
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(a.visual_codes, b.visual_codes)
        assert torch.equal(a.rollout_logp, b.rollout_logp)
        if a.rollout_logp_factors is not None:
            assert torch.equal(a.rollout_logp_factors, b.rollout_logp_factors)


def rollout_batch(kind: str, guidance: float = 1.0):
    model = plain_model(kind)
    trajs = RolloutEngine(model).generate(group_requests(guidance))
    return model.double(), trajs, TrajectoryBatch.collate(trajs, model.special_ids.pad)


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_shared_prefix_hidden_equals_the_full_forward(kind):
    model, trajs, batch = rollout_batch(kind)
    lengths = prompt_lengths(batch, [r.prompt_length for r in sampling_records(trajs)])
    first_of, inverse = prefix_groups(batch, lengths)
    rows = [
        (n, tuple(t.token_ids[:n].tolist()), t.visual_codes[:n].numpy().tobytes())
        for n, t in zip(lengths, trajs)
    ]
    assert len(first_of) == len(set(rows)) < len(batch) and inverse[:G] == [0] * G
    assert all(rows[first_of[g]] == row for g, row in zip(inverse, rows))
    real = batch.attention_mask.bool()
    with torch.no_grad():
        full = body_hidden(model, batch)
        shared = shared_prefix_hidden(model, batch, lengths)
    # float64 forwards, the prompt over another batch (tests/tolerances.py)
    n = tiny_decoder_reductions(
        model.config, batch.token_ids.shape[1], head=model.config.hidden_size
    )
    tol = fp64_forward_bound(magnitude(full[real]), n)
    assert_within((shared[real] - full[real]).abs(), tol, "shared prefix hidden")
    # prompt lengths from the owners agree with the records
    assert prompt_lengths(batch, [None] * len(batch)) == lengths


def test_guided_replay_shares_twins_too():
    model, trajs, batch = rollout_batch("vq", guidance=3.0)
    records = sampling_records(trajs)
    with torch.no_grad():
        full = replay_logprobs(model, batch, records)
        shared = replay_logprobs(model, batch, records, share_prefix=True)
    # float64 forwards (fp64_forward_bound), a guided log-prob: x guidance_gain(3)
    n = tiny_decoder_reductions(model.config, batch.token_ids.shape[1])
    tol = logprob_bound(full.logp, n, torch.float64) * guidance_gain(3.0)
    assert_within((shared.logp - full.logp).abs(), tol, "guided shared replay")


def grpo_loss_and_grads(model, batch, share: bool):
    algo = GRPOConfig(kl={"type": "none"}, share_prompt_prefix=share, group_size=G)
    model.zero_grad()
    loss, stats = GRPOObjective(algo, None).loss(
        model, batch, GRPOObjective(algo, None).count(batch)
    )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), stats, grads


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_grpo_loss_and_gradients_equal_unshared(kind):
    model, trajs, _ = rollout_batch(kind)
    gen = torch.Generator().manual_seed(0)
    for t in trajs:
        t.advantage = float(torch.randn((), generator=gen, dtype=torch.float64))
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    model.train()
    loss_a, stats_a, grads_a = grpo_loss_and_grads(model, batch, share=False)
    loss_b, stats_b, grads_b = grpo_loss_and_grads(model, batch, share=True)
    # float64 weights, float32 norms (tests/tolerances.py): the loss and its sums are
    # forward values over the scored tokens; a gradient adds the backward and the sum over
    # tokens, with the norms' float32 backward
    cfg, tokens = model.config, int(batch.attention_mask.sum())
    fwd = tiny_decoder_reductions(cfg, batch.token_ids.shape[1])
    tol = fp64_forward_bound(magnitude(loss_a), fwd + tokens)
    assert_within((loss_b - loss_a).abs(), tol, "loss")
    assert stats_a.keys() == stats_b.keys()
    for key in stats_a:
        tol = fp64_forward_bound(magnitude(stats_a[key]), fwd + tokens)
        assert_within(abs(stats_b[key] - stats_a[key]), tol, key)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    n64 = gradient_reductions(fwd, tokens)
    n32 = rmsnorm_fp32_reductions(cfg.hidden_size, cfg.num_layers)
    for name, g in grads_a.items():
        assert float(g.abs().max()) > 0, name
        tol = mixed_fp64_bound(magnitude(g), n64, n32)
        assert_within((grads_b[name] - g).abs(), tol, name)


def test_refusals():
    model, trajs, batch = rollout_batch("vq")
    lengths = prompt_lengths(batch, [r.prompt_length for r in sampling_records(trajs)])
    with pytest.raises(ValueError, match="does not support prompt-prefix sharing"):
        shared_prefix_hidden(tiny_model("vq").double(), batch, lengths)
    base = {
        "algorithm": {"name": "grpo", "share_prompt_prefix": True},
        "reward": {"plugins": [{"name": "mc_exact"}]},
    }
    with pytest.raises(ValueError, match="algorithm.share_prompt_prefix"):
        validate_config(base)  # the default tiny body has the conv prior
    plain = {**base, "model": {"kind": "tiny", "tiny": {"mixer_kernel": 0}}}
    validate_config(plain)
    with pytest.raises(ValueError, match="algorithm.share_prompt_prefix.*gradient checkpointing"):
        validate_config({**plain, "trainer": {"gradient_checkpointing": True}})
    model.train()
    model.enable_gradient_checkpointing()  # transformers would drop the prompt's cache
    with pytest.raises(ValueError, match="gradient checkpointing"):
        shared_prefix_hidden(model, batch, lengths)
