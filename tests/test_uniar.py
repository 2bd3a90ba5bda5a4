"""UniAR (Qwen3-VL + BSQ bit head) on tiny random Qwen3-VL configs built in the test:
KV-cached decoding equals the full forward on interleaved batches, greedy text equals
transformers' generate, M-RoPE positions equal `get_rope_index` (and a wrong position
changes the logits), rollout vs replay log-probs for text and 1,024-factor bit positions
with heads on scored positions only, save/reload bitwise, bad checkpoints refused."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_fixtures import UNIAR_SIZES, random_bsq_codec
from tolerances import (
    assert_within,
    bit_decoder_reductions,
    decoder_reductions,
    factor_sum_bound,
    logprob_bound,
    reduction_bound,
)

from uniweave.codecs.base import single_thread
from uniweave.core.sample import GenerationRequest, ImagePart, Sample, TextPart
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.forward import forward_interleaved as teacher_forced
from uniweave.models import load_model
from uniweave.models.base import image_positions, rope_positions
from uniweave.models.uniar import UniARModel, UniARSpec, build_tiny_uniar
from uniweave.models.uniar.template import special_id_map
from uniweave.replay import replay_logprobs
from uniweave.rollout import RolloutEngine, RolloutRequest, SamplingParams, sampling_records


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def model() -> UniARModel:
    return build_tiny_uniar(random_bsq_codec(16, 2, 1), UNIAR_SIZES, seed=0)  # 4x4 grid, 16 bits


@pytest.fixture(scope="module")
def model1024() -> UniARModel:
    codec = random_bsq_codec(64, 1, 4)  # 2x2 composite positions of 4*4*64 = 1,024 bits
    assert codec.bits_per_position == 1024 and codec.grid == (2, 2)
    return build_tiny_uniar(codec, UNIAR_SIZES, seed=1)


def _pixels(seed: int, size: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).random((size, size, 3)).astype(np.float32)


def _bits(seed: int, h: int, w: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (h, w, n), generator=g).float()


def _interleaved(seed: int, words: str, h: int = 4, w: int = 4, n: int = 16) -> Sample:
    """An understanding image, text, a generated image, more text."""
    return Sample(
        f"s{seed}",
        [
            ImagePart(pixels=_pixels(seed), role="user"),
            TextPart(words, role="user"),
            TextPart("draw 3", role="assistant"),
            ImagePart(codes=_bits(seed, h, w, n), role="assistant"),
            TextPart("it is 3", role="assistant"),
        ],
    )


# ---- template and positions ----------------------------------------------------------


def test_template_puts_understanding_images_in_placeholders_and_generated_images_in_bits(model):
    traj = model.prompt_trajectory(_interleaved(0, "what ?"), add_generation_prompt=False)
    sp = model.special_ids
    ids, visual = traj.token_ids.tolist(), (traj.modality == Modality.VISUAL).tolist()
    n_ph = model.vision.n_tokens(_pixels(0))
    start = ids.index(sp.vision_start)
    assert ids[start + 1 : start + 1 + n_ph] == [sp.image_pad] * n_ph
    assert not any(visual[: start + 1 + n_ph]) and ids[start + 1 + n_ph] == sp.vision_end
    assert traj.image_grids == [(4, 4)] and sum(visual) == 16 and len(traj.images) == 1
    assert tuple(traj.images[0].shape) == (8, 8, 3)  # colour kept
    prefix = model.image_generation_prefix(4, 4)  # <image_gen> generate image 4 4<|vision_start|>
    g = ids.index(prefix[0])
    assert ids[g : g + len(prefix)] == prefix and visual[g + len(prefix)]
    parts = model.parse_response(traj)
    assert [type(p).__name__ for p in parts] == ["TextPart", "ImagePart", "TextPart"]
    assert torch.equal(parts[1].codes, _bits(0, 4, 4, 16))
    with pytest.raises(ValueError, match="outside 1..30"):
        model.image_generation_prefix(31, 2)


def _hf_rope_index(model: UniARModel, ids: torch.Tensor, images: list, extra_grids=()):
    """`get_rope_index` called as transformers' processor output would call it."""
    grids = [list(model.vision.grid(x)) for x in images] + [list(g) for g in extra_grids]
    types = (ids == model.config.image_token_id).int()
    thw = torch.tensor(grids) if grids else None
    return model.model.get_rope_index(ids[None], types[None], image_grid_thw=thw)[0][:, 0]


def test_positions_follow_get_rope_index_and_a_wrong_position_changes_the_logits(model):
    sample = _interleaved(1, "what is it ?", h=2, w=3)  # a non-square generated grid
    traj = model.prompt_trajectory(sample, add_generation_prompt=False)
    batch = TrajectoryBatch.collate([traj], model.special_ids.pad)
    inputs = model.prepare(batch)
    pos = inputs.position_ids[:, 0]
    prompt = model.prompt_trajectory(sample)  # the prompt alone, as HF would see it
    n = len(prompt)
    assert torch.equal(pos[:, :n], _hf_rope_index(model, prompt.token_ids, prompt.images))
    # the generated 2x3 image: (s, s + i // 3, s + i % 3), then text at s + max(2, 3)
    v = (traj.modality == Modality.VISUAL).nonzero()[:, 0]
    s = int(pos[0, v[0] - 1]) + 1
    i = torch.arange(6)
    assert torch.equal(pos[:, v], torch.stack([torch.full((6,), s), s + i // 3, s + i % 3]))
    assert pos[:, v[-1] + 1].tolist() == [s + 3] * 3
    # ... which is the rule for an image of that grid (1, 2*merge, 3*merge) patches
    ids = traj.token_ids.masked_fill(traj.modality == Modality.VISUAL, model.config.image_token_id)
    assert torch.equal(pos, _hf_rope_index(model, ids, traj.images, [(1, 4, 6)]))
    with torch.no_grad():
        good = model.hidden(inputs).hidden
        flat = rope_positions(batch.attention_mask)[None].expand(3, -1, -1)
        wrong = model.hidden(type(inputs)(**{**vars(inputs), "position_ids": flat})).hidden
    after = v[0]
    assert float((good[0, after:] - wrong[0, after:]).abs().max()) > 1e-2
    assert (
        float((model.text_logits(good[0, -1:]) - model.text_logits(wrong[0, -1:])).abs().max())
        > 1e-2
    )


# ---- KV-cached decoding == full forward -------------------------------------------------


def test_kv_cached_decoding_equals_the_full_forward_left_and_right_padded(model):
    samples = [_interleaved(2, "what ?"), _interleaved(3, "what is in the picture ?")]
    trajs = [model.prompt_trajectory(s, add_generation_prompt=False) for s in samples]
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)  # right padding
    with torch.no_grad():
        full_inputs = model.prepare(batch)
        full = model.hidden(full_inputs).hidden
    K = 24  # the generated image (16), its close and the text after it, fed one by one
    assert all(int((t.modality == Modality.VISUAL).sum()) == 16 for t in trajs)
    prompts = [_prefix(t, len(t) - K) for t in trajs]
    with torch.no_grad():
        pre = model.prepare_prompts(prompts, model.special_ids.pad)  # left padding
        out = model.hidden(pre, model.new_cache())
        positions = model.decode_positions(pre)
        mask, cache = pre.attention_mask, out.cache
        P = pre.token_ids.shape[1]
        # cached decoding and the full forward reduce over other key blockings and batch
        # shapes: two fp32 paths through the decoder and the longer (bit) head
        N = _reductions(model, max(len(t) for t in trajs))
        # probabilities: |dp| = p |d log p| <= p max(1, |log p|) x (bound at scale 1) <= it
        tol_p = reduction_bound(1.0, N)
        for r, t in enumerate(trajs):  # the prefill's last state == the full forward's
            err = _heads(model, out.hidden[r, -1:]) - _heads(model, full[r, len(t) - K - 1 :][:1])
            assert_within(err.abs(), tol_p, "prefill heads")
        for j in range(K):
            cols = [len(t) - K + j for t in trajs]
            rows = range(len(trajs))
            ids = torch.tensor([[int(t.token_ids[c])] for t, c in zip(trajs, cols)])
            mod = torch.tensor([[int(t.modality[c])] for t, c in zip(trajs, cols)])
            where = torch.stack(
                [image_positions(t.modality[None])[0, c] for t, c in zip(trajs, cols)]
            )[:, None]
            codes = torch.stack([t.visual_codes[c] for t, c in zip(trajs, cols)])[:, None]
            pos = positions.next(mod, where, ids)
            assert torch.equal(pos[:, :, 0], full_inputs.position_ids[:, list(rows), cols])
            mask = torch.cat([mask, mask.new_ones(len(trajs), 1)], dim=1)
            step = type(pre)(ids, mod, codes, mask, pos, where, [[] for _ in trajs])
            o = model.hidden(step, cache)
            cache = o.cache
            err = _heads(model, o.hidden[:, 0]) - _heads(model, full[list(rows), cols])
            assert_within(err.abs(), tol_p, f"decode heads {j}")
            lp = _next_logp(model, o.hidden[:, 0], trajs, cols)
            ref = _next_logp(model, full[list(rows), cols], trajs, cols)
            # a log-prob's error scales with |log-prob| (a visual one: 16 bits, summed)
            tol = logprob_bound(ref, N)
            assert_within((lp - ref).abs(), tol, f"decode log-prob {j}")
    assert P < max(len(t) for t in trajs)


def _reductions(model: UniARModel, keys: int) -> int:
    """tests/tolerances.py's N for a head output of `model` over `keys` keys: the decoder,
    then the longer of the two heads (the bit decoder; the text head is 2 * hidden)."""
    s, spec = UNIAR_SIZES, model.spec
    width = spec.decoder_width or s.hidden_size
    head = bit_decoder_reductions(s.hidden_size, width, spec.decoder_layers)
    head_dim = s.hidden_size // s.num_heads
    return decoder_reductions(
        s.hidden_size, s.intermediate_size, s.num_layers, keys, head_dim, head=head
    )


def _heads(model: UniARModel, hidden: torch.Tensor) -> torch.Tensor:
    """What decoding reads from a state: the text and bit probabilities, side by side.
    (Pre-final-norm states reach |h| ~ 100 at this init; log-probs of ids with p ~ e^-40
    carry fp32 rounding of a few 1e-6, so whole distributions are compared as
    probabilities, and the log-probs of the actual next positions separately.)"""
    return torch.cat(
        [model.text_logits(hidden).softmax(-1), model.visual_logits(hidden).sigmoid()], -1
    )


def _next_logp(model: UniARModel, hidden: torch.Tensor, trajs, cols) -> torch.Tensor:
    """log-prob of each row's actual position at `cols` (+1 is the target) from `hidden`."""
    out = []
    for r, (t, c) in enumerate(zip(trajs, cols)):
        if c + 1 >= len(t):
            continue
        h = hidden[r : r + 1]
        if int(t.modality[c + 1]) == Modality.VISUAL:
            z, b = model.visual_logits(h)[0], t.visual_codes[c + 1]
            out.append((b * F.logsigmoid(z) + (1 - b) * F.logsigmoid(-z)).sum())
        else:
            out.append(model.text_logits(h).log_softmax(-1)[0, int(t.token_ids[c + 1])])
    return torch.stack(out) if out else torch.zeros(1)


def _prefix(traj, n: int):
    k = int((traj.modality[:n] == Modality.VISUAL).sum())
    n_images = len(traj.image_grids) if k else 0
    return replace(
        traj,
        token_ids=traj.token_ids[:n],
        modality=traj.modality[:n],
        owner=traj.owner[:n],
        visual_codes=traj.visual_codes[:n],
        image_grids=traj.image_grids[:n_images],
    )


# ---- greedy text == transformers' generate ---------------------------------------------


def test_greedy_text_answers_equal_transformers_generate(model):
    params = SamplingParams(
        greedy=True, max_new_tokens=10, cycle_max_period=0, on_invalid_header="text"
    )
    samples = [
        Sample(f"q{k}", [ImagePart(pixels=_pixels(10 + k), role="user"), TextPart(q, role="user")])
        for k, q in enumerate(["what is it ?", "which digit ? A B C D"])
    ]
    ours = RolloutEngine(model).generate([RolloutRequest(s, 0, params) for s in samples])
    hf = model._hf
    answers = []
    for o in ours:
        n = o.sampling.prompt_length
        ids = o.token_ids[:n][None]
        pixel_values, thw = model.vision(o.images)
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixel_values,
            image_grid_thw=thw,
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            suppress_tokens=[model.config.image_token_id],  # never a text action (text_logits)
            do_sample=False,
            max_new_tokens=10,
        )
        assert o.token_ids[n:].tolist() == ref[0, n:].tolist()
        answers.append(o.token_ids[n:].tolist())
    assert answers[0] != answers[1] and len(answers[0]) > 1


# ---- rollout vs replay; heads at scored positions only ------------------------------------


def test_rollout_logprobs_equal_replay_for_text_and_1024_factor_bits(model1024):
    model = model1024
    guided = SamplingParams(
        max_new_tokens=4, length_semantics="exact", guidance=3.0, bit_temperature=0.8
    )
    plain = SamplingParams(max_new_tokens=4, length_semantics="exact")
    text = SamplingParams(temperature=0.9, top_k=40, max_new_tokens=8)
    requests = []
    for k, words in enumerate(["draw 3", "draw a 7 please"]):
        t2i = Sample(f"t{k}", [TextPart(words, role="user"), GenerationRequest(2, 2)])
        requests.append(RolloutRequest(t2i, 10 + k, guided if k else plain))
        q = Sample(
            f"q{k}", [ImagePart(pixels=_pixels(k), role="user"), TextPart("what ?", role="user")]
        )
        requests.append(RolloutRequest(q, 20 + k, text))
    trajs = RolloutEngine(model).generate(requests)
    assert {t.finish_reason for t in trajs[::2]} == {"length_exact"}
    seen = {"text": 0, "visual": 0}
    h1 = model.lm_head.register_forward_hook(
        lambda m, i, o: seen.__setitem__("text", seen["text"] + i[0].shape[0])
    )
    h2 = model.visual_decoder.register_forward_hook(
        lambda m, i, o: seen.__setitem__("visual", seen["visual"] + i[0].shape[0])
    )
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    with torch.no_grad():
        out = replay_logprobs(model, batch, sampling_records(trajs))
    h1.remove(), h2.remove()
    policy, visual = batch.policy_mask, batch.modality == Modality.VISUAL
    # rollout (KV-cached, batched) and replay (one full forward) are two fp32 paths
    N = _reductions(model, batch.token_ids.shape[1])
    err = (out.logp - batch.rollout_logp).abs()
    tol_text = logprob_bound(batch.rollout_logp[policy & ~visual], N)
    assert_within(err[~visual], tol_text, "text log-probs")
    ferr = (out.logp_factors - batch.rollout_logp_factors).abs().max()  # each of 1,024 factors
    tol_f = logprob_bound(batch.rollout_logp_factors[policy & visual], N)
    assert_within(ferr, tol_f, "bit factors")
    assert out.logp_factors.shape[-1] == 1024
    # a position's sum of its 1,024 factor log-probs (~ -700)
    tol_v = factor_sum_bound(tol_f, 1024, float(batch.rollout_logp[policy & visual].abs().max()))
    assert_within(err[visual], tol_v, "1,024-bit sums")
    n_text = int((policy & ~visual).sum())
    n_vis = int((policy & visual).sum())
    assert seen["text"] == n_text and seen["visual"] == n_vis + 4  # + the guided row's twin
    vis = batch.rollout_logp[policy & (batch.modality == Modality.VISUAL)]
    assert float(vis.max()) < -100.0  # 1,024 factors per position


# ---- save / reload and bad checkpoints ------------------------------------------------------


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("uniar") / "ckpt"
    model.save_pretrained(path)
    return path


def test_save_and_reload_reproduce_the_logits_bitwise(model, saved):
    loaded = load_model(saved)
    assert isinstance(loaded, UniARModel)
    trajs = [model.prompt_trajectory(_interleaved(k, "what ?"), False) for k in (4, 5)]
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    with torch.no_grad():
        a, b = (
            model.hidden(model.prepare(batch)).hidden,
            loaded.hidden(loaded.prepare(batch)).hidden,
        )
        assert torch.equal(a, b)
        assert torch.equal(model.text_logits(a[:, -3:]), loaded.text_logits(b[:, -3:]))
        assert torch.equal(model.visual_logits(a[:, -3:]), loaded.visual_logits(b[:, -3:]))
    assert {k for k in loaded.state_dict()} == {k for k in model.state_dict()}
    record = json.loads((saved / "uniweave_model.json").read_text())
    assert record["special_ids"] == special_id_map(model.tokenizer)


def _edit_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    for key, value in fields.items():
        target = data
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("break_it", "file", "field"),
    [
        (lambda d: shutil.rmtree(d / "codec"), "codec/codec.json", "missing"),
        (
            lambda d: _edit_json(d / "uniweave_model.json", **{"special_ids.image_gen": 3}),
            "uniweave_model.json",
            "special_ids.image_gen",
        ),
        (
            lambda d: _edit_json(d / "config.json", auto_map={"AutoModel": "x.Y"}),
            "config.json",
            "auto_map",
        ),
        (lambda d: _edit_json(d / "codec" / "codec.json", group=2), "codec/codec.json", "group"),
        (
            lambda d: _edit_json(d / "config.json", image_token_id=5),
            "config.json",
            "image_token_id",
        ),
    ],
)
def test_bad_checkpoints_are_refused_naming_file_and_field(saved, tmp_path, break_it, file, field):
    bad = Path(shutil.copytree(saved, tmp_path / "bad"))
    break_it(bad)
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        UniARModel.from_pretrained(bad)
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and str(bad / file) in msg and field in msg, msg


@pytest.mark.parametrize("train_vision", [False, True])
def test_vision_tower_is_frozen_by_default_and_trains_when_asked(train_vision):
    model = build_tiny_uniar(random_bsq_codec(16, 2, 1), spec=UniARSpec(train_vision=train_vision))
    model.train()
    assert model.model.visual.training == train_vision  # a frozen tower stays in eval
    traj = model.prompt_trajectory(_interleaved(6, "what ?"), add_generation_prompt=False)
    batch = TrajectoryBatch.collate([traj], model.special_ids.pad)
    out = teacher_forced(model, batch)  # heads at the scored positions
    (out.text_logits.logsumexp(-1).sum() + out.visual_logits.sum()).backward()
    tower = [p.grad for p in model.model.visual.parameters()]
    assert all(g is None for g in tower) != train_vision
    assert model.bit_embed.proj.weight.grad is not None  # generated positions read their bits
    assert model.model.language_model.layers[0].mlp.up_proj.weight.grad is not None


# ---- forward_interleaved on transformers-style inputs ---------------------------------


def test_forward_interleaved_takes_image_grid_thw_and_matches_the_training_forward(model):
    """`forward_interleaved(input_ids, attention_mask, image_grid_thw, visual_codes,
    pixel_values=...)` (pixels through the checkpoint's own image processor) gives the
    states, positions and generated mask of the path training uses (`prepare` + `hidden`),
    and bit logits = the visual head on the state before each scored target."""
    samples = [_interleaved(7, "what ?"), _interleaved(8, "what is in the picture ?")]
    trajs = [model.prompt_trajectory(s, add_generation_prompt=False) for s in samples]
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    images = [_pixels(7), _pixels(8)]
    vision = model.image_processor(images=images, return_tensors="pt", do_rescale=False)
    with torch.no_grad():
        inputs = model.prepare(batch)
        ref = model.hidden(inputs).hidden
        out = model.forward_interleaved(
            batch.token_ids,
            batch.attention_mask,
            vision["image_grid_thw"],
            batch.visual_codes,
            pixel_values=vision["pixel_values"],
        )
    assert torch.equal(out.visual_mask, batch.modality == Modality.VISUAL)
    assert torch.equal(out.position_ids, inputs.position_ids)
    assert torch.equal(out.hidden, ref)  # the same ops on the same inputs
    rows, cols = (batch.modality == Modality.VISUAL).nonzero(as_tuple=True)
    assert torch.equal(out.visual_rows, rows) and torch.equal(out.visual_cols, cols)
    with torch.no_grad():
        expected = model.visual_logits(ref[rows, cols - 1])
    assert torch.equal(out.visual_logits, expected)
    with pytest.raises(ValueError, match="pixel_values and image_grid_thw: give both"):
        model.forward_interleaved(
            batch.token_ids, batch.attention_mask, vision["image_grid_thw"], batch.visual_codes
        )
    with pytest.raises(ValueError, match="image_grid_thw: row 1"):
        model.forward_interleaved(
            batch.token_ids,
            batch.attention_mask,
            vision["image_grid_thw"][:1],
            batch.visual_codes,
            pixel_values=vision["pixel_values"],
        )
    with pytest.raises(ValueError, match="visual_codes: required"):
        model.forward_interleaved(batch.token_ids, batch.attention_mask)


def test_image_placeholder_is_never_a_text_action(model):
    """text_logits = project_text except the placeholder column, whose probability is 0
    and whose log-probability stays finite (so p log p terms are 0, not NaN)."""
    h = torch.randn(5, model.lm_head.in_features)
    pad = int(model.config.image_token_id)
    raw, masked = model.project_text(h), model.text_logits(h)
    others = torch.ones(raw.shape[-1], dtype=torch.bool)
    others[pad] = False
    assert torch.equal(masked[:, others], raw[:, others])
    logp = masked.log_softmax(-1)
    assert bool(torch.isfinite(logp).all()) and float(logp[:, pad].exp().max()) == 0.0
    assert float((logp.exp() * logp).sum(-1).isnan().sum()) == 0
    # backward through the in-place write: the gradient of the other columns only
    w = torch.randn(raw.shape)
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    (model.text_logits(h1) * w).sum().backward()
    (model.project_text(h2)[:, others] * w[:, others]).sum().backward()
    # W^T w over the vocabulary, with a zero pad column or without it: two fp32 GEMM
    # shapes; the scale of the terms is (|w| @ |W|)
    scale = float((w[:, others].abs() @ model.lm_head.weight[others].abs()).max())
    tol = reduction_bound(scale, raw.shape[-1])
    assert_within((h1.grad - h2.grad).abs(), tol, "placeholder grad")
