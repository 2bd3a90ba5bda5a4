"""Rollout engine: KV-cache parity, stateless seeds, the row state machine, stop reasons."""

from __future__ import annotations

import random

import pytest
import torch
from rollout_fixtures import (
    logp_bounds,
    mixed_requests,
    mixed_samples,
    scripted_model,
    text_sample,
    tiny_model,
    token_id,
    tokenizer,
)
from tolerances import tiny_decoder_reductions

from uniweave.core.sample import GenerationRequest, ImagePart, Sample, TextPart
from uniweave.core.types import Modality, Owner
from uniweave.data.template import parse, serialize
from uniweave.data.tokenizer import SpecialIds
from uniweave.models.base import ModelInputs, image_positions
from uniweave.rollout import (
    RolloutEngine,
    RolloutRequest,
    RolloutService,
    RowState,
    SamplingParams,
    has_cycle,
    interleave,
)
from uniweave.rollout.guidance import unconditional_prompt
from uniweave.rollout.policy import text_distribution, visual_distribution

SP = SpecialIds.from_tokenizer(tokenizer())
HEADER = [
    ("\n", "<image_gen>"),
    ("<image_gen>", "generate"),
    ("generate", "image"),
]


def _last_hidden(model, ids, modality, codes):
    """Hidden state at the last position of one sequence, by a full forward (no cache)."""
    T = ids.shape[0]
    mask = torch.ones(1, T, dtype=torch.bool)
    inputs = ModelInputs(
        ids[None],
        modality[None],
        codes[None],
        mask,
        torch.arange(T)[None],
        image_positions(modality[None]),
        [[]],
    )
    return model.hidden(inputs).hidden[:, -1]


@torch.no_grad()
def _greedy_by_recomputation(model, engine, request):
    """Reference decoder: the same row state machine, every step a full forward."""
    prompt, grid = engine.prompt_trajectory(request)
    params = request.params
    twin = unconditional_prompt(model, prompt) if params.guided else None
    state = RowState(prompt, params, tokenizer(), engine.max_positions, grid)
    while not state.done:
        if state.action == "controller":
            state.push_controller()
            continue
        ids, modality, _, codes = state.stream()
        h = _last_hidden(model, ids, modality, codes)
        if state.action == "text":
            dist = text_distribution(model.text_logits(h), params)
            token = dist.mode()
            state.push_text(int(token), float(dist.log_prob(token)))
            continue
        u = None
        if twin is not None:
            n = len(prompt)
            hu = _last_hidden(
                model,
                torch.cat([twin.token_ids, ids[n:]]),
                torch.cat([twin.modality, modality[n:]]),
                torch.cat([twin.visual_codes, codes[n:]]),
            )
            u = model.visual_logits(hu)
        dist = visual_distribution(model.visual_head, model.visual_logits(h), u, params)
        code = dist.mode()
        if model.visual_head == "bsq":
            f = dist.log_prob_factors(code)[0]
            state.push_visual(code[0], float(f.sum()), f)
        else:
            state.push_visual(int(code), float(dist.log_prob(code)))
    return state.to_trajectory(request.id, request.seed)


def _same_stream(a, b) -> None:
    assert a.sample_id == b.sample_id
    assert torch.equal(a.token_ids, b.token_ids), a.sample_id
    assert torch.equal(a.modality, b.modality) and torch.equal(a.owner, b.owner)
    assert torch.equal(a.visual_codes, b.visual_codes), a.sample_id
    assert a.image_grids == b.image_grids and a.finish_reason == b.finish_reason


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_greedy_kv_cache_equals_full_recomputation(kind):
    model = tiny_model(kind, init=0.5)
    text = SamplingParams(greedy=True, max_new_tokens=24, top_k=20)
    image = SamplingParams(greedy=True, max_new_tokens=16, length_semantics="exact", guidance=3.0)
    requests = mixed_requests(mixed_samples(2), text, image)
    engine = RolloutEngine(model)
    fast = engine.generate(requests)
    assert len({len(t) for t in fast}) > 2  # rows of different lengths finish independently
    for req, got in zip(requests, fast):
        ref = _greedy_by_recomputation(model, engine, req)
        _same_stream(got, ref)
        # KV cache vs a full forward per step: two fp32 paths (tests/tolerances.py)
        err = (got.rollout_logp - ref.rollout_logp).abs()
        tol = logp_bounds(model, ref, req.params, tiny_decoder_reductions(model.config, len(ref)))
        assert bool((err <= tol).all()), (req.prompt.id, float((err / tol).max()))


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_same_seed_same_trajectory_at_any_batch_size_and_order(kind):
    model = tiny_model(kind, init=0.5)
    text = SamplingParams(max_new_tokens=20, top_k=30)
    image = SamplingParams(max_new_tokens=16, length_semantics="exact", guidance=2.0)
    requests = mixed_requests(mixed_samples(2), text, image)
    engine = RolloutEngine(model)
    full = engine.generate(requests)
    singles = [engine.generate([r])[0] for r in requests]
    threes = [t for s in range(0, 8, 3) for t in engine.generate(requests[s : s + 3])]
    order = list(range(8))
    random.Random(0).shuffle(order)
    shuffled = engine.generate([requests[k] for k in order])
    unshuffled = [shuffled[order.index(k)] for k in range(8)]
    masked = RolloutEngine(model, finished="mask").generate(requests)
    params = {r.prompt.id: r.params for r in requests}
    for other in (singles, threes, unshuffled, masked):
        for a, b in zip(full, other):
            _same_stream(a, b)
            # same draws; log-probs agree up to fp32 noise of the batch geometry
            err = (a.rollout_logp - b.rollout_logp).abs()
            tol = logp_bounds(
                model, a, params[a.sample_id], tiny_decoder_reductions(model.config, len(a))
            )
            assert bool((err <= tol).all()), (a.sample_id, float((err / tol).max()))
    # a different seed draws a different trajectory
    reseeded = RolloutRequest(requests[1].prompt, requests[1].seed + 1, text)
    assert not torch.equal(engine.generate([reseeded])[0].token_ids, full[1].token_ids)


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_exact_length_image_requests_end_length_exact(kind):
    model = tiny_model(kind)
    image = SamplingParams(max_new_tokens=16, length_semantics="exact", guidance=1.5)
    samples = mixed_samples(3)[::4]  # the t2i samples
    requests = [RolloutRequest(s, k, image, image_grid=(4, 4)) for k, s in enumerate(samples)]
    asked = Sample("asked", [TextPart("draw the digit 5"), GenerationRequest(4, 4)])
    requests.append(RolloutRequest(asked, 99, image))
    for traj in RolloutEngine(model).generate(requests):
        assert traj.finish_reason == "length_exact" and traj.length_semantics == "exact"
        n = traj.sampling.prompt_length
        owner, modality = traj.owner[n:], traj.modality[n:]
        assert int((owner == Owner.POLICY).sum()) == 16
        assert bool((modality[:-1] == Modality.VISUAL).all())
        assert int(traj.token_ids[-1]) == SP.vision_end and int(owner[-1]) == Owner.CONTROLLER
        assert isinstance(parse(traj, tokenizer())[-1], ImagePart)
    bad = SamplingParams(max_new_tokens=10, length_semantics="exact")
    with pytest.raises(ValueError, match="max_new_tokens == H\\*W = 16"):
        RolloutEngine(model).generate([RolloutRequest(samples[0], 0, bad, image_grid=(4, 4))])
    with pytest.raises(ValueError, match="needs a forced image grid"):
        RolloutEngine(model).generate([RolloutRequest(samples[0], 0, bad)])


def test_interleaved_header_switches_to_visual_and_back():
    script = [*HEADER, ("image", "2"), ("2", "3"), ("3", "<|vision_start|>")]
    script += [("<|vision_end|>", "7"), ("7", "<|im_end|>")]
    for kind in ("vq", "bsq"):
        model = scripted_model(kind, script)
        params = SamplingParams(greedy=True, max_new_tokens=40)
        traj = RolloutEngine(model).generate([RolloutRequest(text_sample(), 0, params)])[0]
        n = traj.sampling.prompt_length
        words = ["<image_gen>", "generate", "image", "2", "3", "<|vision_start|>"]
        expected = [token_id(w) for w in words] + [SP.image_pad] * 6
        expected += [SP.vision_end, token_id("7"), SP.eos]
        assert traj.token_ids[n:].tolist() == expected
        assert traj.owner[n:].tolist() == [Owner.POLICY] * 12 + [Owner.CONTROLLER] + [1, 1]
        assert traj.modality[n:].tolist() == [0] * 6 + [1] * 6 + [0] * 3
        assert traj.image_grids == [(2, 3)] and traj.finish_reason == "eos"
        parts = parse(traj, tokenizer())
        assert isinstance(parts[1], ImagePart) and parts[1].codes.shape[:2] == (2, 3)
        assert parts[2].text == "7"
        assert (traj.rollout_logp[n:][traj.owner[n:] == Owner.CONTROLLER] == 0).all()


@pytest.mark.parametrize(
    "numbers, bounds",
    [(("4",), (1, 64)), (("0", "9"), (1, 64)), (("9", "10"), (1, 8)), (("2", "9"), (3, 8))],
    ids=["malformed", "zero-side", "too-large", "too-small"],
)
def test_invalid_headers_end_the_row_without_crashing_the_batch(numbers, bounds):
    chain = ["image", *numbers, "<|vision_start|>"]
    script = HEADER[:-1] + [("generate", "image")] + list(zip(chain[:-1], chain[1:]))
    script += [("<|vision_start|>", "A")]
    model = scripted_model("vq", script)
    lo, hi = bounds
    params = SamplingParams(greedy=True, max_new_tokens=12, min_grid_side=lo, max_grid_side=hi)
    forced = SamplingParams(max_new_tokens=16, length_semantics="exact")
    requests = [
        RolloutRequest(text_sample(), 0, params),
        RolloutRequest(text_sample(sample_id="t2i"), 1, forced, image_grid=(4, 4)),
    ]
    invalid, ok = RolloutEngine(model).generate(requests)
    assert invalid.finish_reason == "invalid" and ok.finish_reason == "length_exact"
    assert int(invalid.token_ids[-1]) == SP.vision_start and invalid.image_grids == []
    as_text = SamplingParams(
        greedy=True,
        max_new_tokens=12,
        min_grid_side=lo,
        max_grid_side=hi,
        on_invalid_header="text",
        cycle_max_period=0,
    )
    cont = RolloutEngine(model).generate([RolloutRequest(text_sample(), 0, as_text)])[0]
    n = cont.sampling.prompt_length
    assert cont.finish_reason == "cap" and int((cont.owner == Owner.POLICY).sum()) == 12
    assert token_id("A") in cont.token_ids[n:].tolist()
    assert not (cont.modality == Modality.VISUAL).any()


def test_cycle_detector_ends_a_repeating_row():
    model = scripted_model("vq", [("\n", "A"), ("A", "B"), ("B", "A")])
    params = SamplingParams(greedy=True, max_new_tokens=50)
    traj = RolloutEngine(model).generate([RolloutRequest(text_sample(), 0, params)])[0]
    n = traj.sampling.prompt_length
    assert traj.finish_reason == "cycle"
    assert traj.token_ids[n:].tolist() == [token_id("A"), token_id("B")] * 3
    looping = scripted_model("vq", [("\n", "C"), ("C", "C")])
    traj = RolloutEngine(looping).generate([RolloutRequest(text_sample(), 0, params)])[0]
    assert traj.finish_reason == "cycle" and len(traj) - n == 3
    off = SamplingParams(greedy=True, max_new_tokens=9, cycle_max_period=0)
    traj = RolloutEngine(model).generate([RolloutRequest(text_sample(), 0, off)])[0]
    assert traj.finish_reason == "cap" and len(traj) - n == 9


def test_has_cycle_matches_brute_force():
    rng = random.Random(0)
    for _ in range(500):
        seq = [rng.randrange(3) for _ in range(rng.randrange(0, 14))]
        brute = any(
            len(seq) >= 3 * p and seq[-p:] * 3 == seq[len(seq) - 3 * p :] for p in range(1, 5)
        )
        assert has_cycle(seq, 4, 3) == brute
    assert not has_cycle([1, 2, 3, 4, 5] * 2, 4, 3) and has_cycle([1, 2, 3, 4, 5] * 3, 5, 3)


def test_cap_stop_tokens_and_context_limits():
    model = scripted_model("bsq", [("\n", "A"), ("A", "B"), ("B", "C"), ("C", "D"), ("D", "A")])
    params = SamplingParams(greedy=True, max_new_tokens=5)
    capped = RolloutEngine(model).generate([RolloutRequest(text_sample(), 0, params)])[0]
    n = capped.sampling.prompt_length
    assert capped.finish_reason == "cap" and capped.length_semantics == "cap"
    assert len(capped) - n == 5
    stop = SamplingParams(greedy=True, max_new_tokens=5, stop_token_ids=(token_id("B"),))
    model.train()
    stopped = RolloutEngine(model).generate([RolloutRequest(text_sample(), 0, stop)])[0]
    assert stopped.finish_reason == "eos" and len(stopped) - n == 2
    assert model.training  # the engine samples in eval mode and restores the mode
    limit = n + 3
    ctx = RolloutEngine(model, max_positions=limit).generate(
        [RolloutRequest(text_sample(), 0, params)]
    )[0]
    assert ctx.finish_reason == "context" and len(ctx) == limit
    small = tiny_model("vq", max_positions=limit)
    assert RolloutEngine(small).max_positions == limit
    with pytest.raises(ValueError, match="more than the context length"):
        forced = SamplingParams(max_new_tokens=16, length_semantics="exact")
        RolloutEngine(small).generate([RolloutRequest(text_sample(), 0, forced, (4, 4))])


def test_prompt_trajectory_with_forced_header_and_rejections():
    model = tiny_model("vq")
    engine = RolloutEngine(model)
    prompt = serialize(
        Sample("p", [TextPart("draw the digit 2"), GenerationRequest(4, 4)]),
        tokenizer(),
        add_generation_prompt=True,
    )
    params = SamplingParams(max_new_tokens=16, length_semantics="exact")
    traj = engine.generate([RolloutRequest(prompt, 3, params)])[0]
    assert traj.finish_reason == "length_exact" and traj.image_grids == [(4, 4)]
    with pytest.raises(ValueError, match="outside"):
        engine.generate([RolloutRequest(prompt, 3, SamplingParams(max_grid_side=2))])
    with pytest.raises(ValueError, match="all PROMPT"):
        engine.generate([RolloutRequest(traj, 3, SamplingParams())])


def test_default_unconditional_prompt_blanks_user_content():
    model = tiny_model("vq")
    sample = mixed_samples(1)[1]  # i2t_mc: user image + question
    prompt = serialize(sample, tokenizer(), model.codec.encode, add_generation_prompt=True)
    twin = unconditional_prompt(model, prompt)
    assert len(twin) == len(prompt) and twin.image_grids == []
    changed = twin.token_ids != prompt.token_ids
    assert changed.any() and (twin.token_ids[changed] == SP.pad).all()
    assert not (twin.modality == Modality.VISUAL).any()
    keep = [SP.im_start, SP.im_end, token_id("user"), token_id("assistant")]
    kept = torch.isin(prompt.token_ids, torch.tensor(keep))
    assert torch.equal(twin.token_ids[kept], prompt.token_ids[kept])
    twin.validate()


def test_sampling_params_validation():
    for bad in (
        {"temperature": 0.0},
        {"top_p": 0.0},
        {"top_k": -1},
        {"guidance_logprob": "z/w"},
        {"length_semantics": "truncated"},
        {"max_new_tokens": 0},
        {"stop_token_ids": [3]},
        {"min_grid_side": 5, "max_grid_side": 4},
        {"on_invalid_header": "crash"},
    ):
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**bad)


def test_rollout_service_shards_round_robin_and_reassembles_in_request_order():
    """Two ranks' shards, each decoded in fixed-size batches, interleave back into the
    one-process rollout (rows one at a time, so batching cannot change a token); each
    trajectory carries its request's seed and sampling record."""
    model = tiny_model("vq")
    requests = mixed_requests(
        mixed_samples(2), SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=16)
    )
    calls = []
    whole = RolloutService(model, batch_size=1).generate(requests, lambda: calls.append(1))
    assert len(calls) == len(requests)
    parts = [RolloutService(model, 1, rank=r, world_size=2) for r in range(2)]
    shards = [p.generate(p.shard(requests)) for p in parts]
    assert [len(s) for s in shards] == [4, 4]
    for a, b, req in zip(whole, interleave(shards), requests):
        assert a.sample_id == b.sample_id == req.id and a.seed == b.seed == req.seed
        assert torch.equal(a.token_ids, b.token_ids) and a.sampling.seed == req.seed
    with pytest.raises(ValueError, match="round-robin"):
        interleave([shards[0], shards[1][:2]])
