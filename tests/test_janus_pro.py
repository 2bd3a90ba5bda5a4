"""Janus-Pro adapter on tiny random `JanusForConditionalGeneration` checkpoints: loading,
template and CFG prompt, parity with transformers' generate, rollout/replay log-prob
parity, head shapes at the real vocabulary and image-token count, LoRA, bad inputs."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from rollout_fixtures import batch_logp_bounds
from tolerances import assert_within, decoder_reductions, elementwise_bound, reduction_bound
from transformers import AutoImageProcessor, JanusForConditionalGeneration

from uniweave.codecs.base import single_thread
from uniweave.config import load_config, validate_config
from uniweave.core.sample import GenerationRequest, ImagePart, Sample, TextPart
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality, Owner
from uniweave.data.digits import make_task_samples, vocabulary_texts
from uniweave.data.images import processor_for
from uniweave.data.loader import DatasetError, load_rows
from uniweave.data.tokenizer import build_tokenizer as build_digits_tokenizer
from uniweave.models import check_model_config, load_model
from uniweave.models.build import build_model
from uniweave.models.janus_pro import JanusProModel
from uniweave.models.janus_pro.template import BOI, EOI, IMAGE
from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint
from uniweave.replay import replay_logprobs
from uniweave.rollout import (
    RolloutEngine,
    RolloutRequest,
    RolloutTrajectory,
    SamplingParams,
    sampling_records,
)
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.lora import apply_lora
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.grpo.job import build_grpo_job

TEXTS = ["draw a red cat on the mat", "what is in this picture ? A B C D", "a dog"]
RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "janus_pro"
LORA_REGEX = (
    r"model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is far faster (and immune to a busy second core)."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    # init 0.2: logits far from uniform, yet fp32 rollout/replay agree well within 1e-5
    spec = TinyJanusSpec(initializer_range=0.2)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("janus"), spec, TEXTS)


@pytest.fixture(scope="module")
def model(ckpt) -> JanusProModel:
    return JanusProModel.from_pretrained(ckpt).eval()


@pytest.fixture(scope="module")
def hf(ckpt, model) -> JanusForConditionalGeneration:
    ref = JanusForConditionalGeneration.from_pretrained(str(ckpt)).eval()
    ref.generation_config.generation_kwargs = {"boi_token_id": model.tokens.boi}
    return ref


def _reductions(model: JanusProModel, err: torch.Tensor) -> int:
    """tests/tolerances.py's N for a head output of a tiny Janus-Pro (tiny.py: intermediate
    2 * hidden) over err.shape[1] keys; the head: the final norm and the generation head's
    two layers of width hidden (the text head is shorter)."""
    c = model.model.language_model.config
    d = c.hidden_size
    head_dim = d // c.num_attention_heads
    return decoder_reductions(
        d, c.intermediate_size, c.num_hidden_layers, err.shape[1], head_dim, head=3 * d
    )


def _pixels(seed: int, size: int = 16) -> np.ndarray:
    """An exactly representable uint8 image as float [S, S, 3] in [0, 1]."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (size, size, 3)).astype(np.float32) / np.float32(255.0)


def _t2i(sample_id: str, text: str, side: int = 4) -> Sample:
    return Sample(sample_id, [TextPart(text), GenerationRequest(side, side)], task="t2i")


def _i2t(sample_id: str, text: str, seed: int) -> Sample:
    parts = [ImagePart(pixels=_pixels(seed)), TextPart(text)]
    return Sample(sample_id, parts, answer="B", task="i2t_mc")


# ---- loading, freezing, saving ---------------------------------------------------------


def test_loads_a_transformers_checkpoint_and_freezes_vq_and_vision(ckpt, model, hf, tmp_path):
    loaded = load_model(ckpt)  # no uniweave_model.json: recognised by config.json model_type
    assert isinstance(loaded, JanusProModel) and not (ckpt / "uniweave_model.json").exists()
    assert set(loaded.state_dict()) == set(hf.state_dict())  # the checkpoint's own names
    loaded.train()
    assert not loaded.model.vqmodel.training and not loaded.model.vision_model.training
    assert loaded.model.language_model.training and loaded.lm_head.training
    frozen = [n for n, p in loaded.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith(("model.vqmodel.", "model.vision_model.")) for n in frozen)
    assert len(frozen) == sum(
        1
        for n, _ in hf.named_parameters()
        if n.startswith(("model.vqmodel.", "model.vision_model."))
    )
    loaded.save_pretrained(tmp_path / "saved")
    again = load_model(tmp_path / "saved")
    assert (
        json.loads((tmp_path / "saved" / "uniweave_model.json").read_text())["kind"] == "janus_pro"
    )
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


# ---- template, CFG prompt, parse ------------------------------------------------------


def test_chat_format_and_unconditional_prompt(model):
    tok = model.tokenizer
    t = model.tokens
    traj = model.prompt_trajectory(_t2i("t", "draw a cat"))
    expected = [
        t.bos,
        *tok.encode("<|User|>: draw a cat\n\n<|Assistant|>:", add_special_tokens=False),
    ]
    assert traj.token_ids.tolist() == [*expected, t.boi]
    assert (traj.owner == Owner.PROMPT).all() and (traj.modality == Modality.TEXT).all()
    # transformers' rule for the CFG row: everything but BOS and <begin_of_image> -> pad
    ids = traj.token_ids
    hf_rule = ids.masked_fill((ids != t.bos) & (ids != t.boi), t.pad)
    uncond = model.unconditional_prompt(traj)
    assert torch.equal(uncond.token_ids, hf_rule) and uncond.image_grids == []

    sample = _i2t("q", "what is in this picture ?", 0)
    prompt = model.prompt_trajectory(sample)
    block = BOI + IMAGE * model.n_image_tokens + EOI
    text = f"<|User|>: {block}\nwhat is in this picture ?\n\n<|Assistant|>:"
    assert prompt.token_ids.tolist() == [t.bos, *tok.encode(text, add_special_tokens=False)]
    assert len(prompt.images) == 1 and prompt.images[0].shape == (16, 16, 3)

    answered = Sample("sft", [*sample.parts, TextPart("B", "assistant")])
    full = model.prompt_trajectory(answered, add_generation_prompt=False)
    n = len(prompt)
    assert torch.equal(full.token_ids[:n], prompt.token_ids)
    assert full.owner[n:].tolist() == [Owner.POLICY] * (len(full) - n)
    assert int(full.token_ids[-1]) == t.eos
    assert [(type(p), p.text) for p in model.parse_response(full)] == [(TextPart, "B")]

    codes = torch.arange(16).reshape(4, 4)
    drawn = Sample("img", [TextPart("a dog"), ImagePart(codes=codes, role="assistant")])
    image = model.prompt_trajectory(drawn, add_generation_prompt=False)
    assert int(image.token_ids[-1]) == t.eoi and int(image.owner[-1]) == Owner.CONTROLLER
    assert int((image.modality == Modality.VISUAL).sum()) == 16 and image.image_grids == [(4, 4)]
    (part,) = model.parse_response(image)
    assert torch.equal(part.codes, codes)
    cut = RolloutTrajectory(
        image.token_ids[:-3],
        image.modality[:-3],
        image.owner[:-3],
        image.visual_codes[:-3],
        [(4, 4)],
    )
    assert model.parse_response(cut) is None  # stopped inside the image


def test_image_inputs_match_processor_and_get_image_features(ckpt, model, hf):
    px = _pixels(3)
    processor = AutoImageProcessor.from_pretrained(str(ckpt))
    reference = processor(images=[(px * 255).round().astype(np.uint8)], return_tensors="pt")
    ours = model.pixels.normalize(torch.from_numpy(px)[None])
    # rescale, subtract the mean, divide by the std: 3 fp32 roundings per path
    tol = elementwise_bound(float(ours.abs().max()), 3)
    assert_within((ours - reference["pixel_values"]).abs(), tol, "normalize")
    with torch.no_grad():
        features = model.image_features([px, px])
        expected = hf.model.get_image_features(reference["pixel_values"]).pooler_output
    # a batch of 2 vs 1 through the vision tower (patch conv over 4*4*3 pixels, one layer
    # of width 32 over 16 patches, post-norm and the 2-layer aligner): two fp32 paths
    n = 4 * 4 * 3 + decoder_reductions(32, 64, 1, 16, 16, head=3 * 32)
    tol = reduction_bound(float(expected.abs().max()), n)
    assert_within((features - expected.expand(2, -1, -1)).abs(), tol, "image features")
    codes = model.codec.encode(torch.from_numpy(px)[None])
    assert codes.shape == (1, 4, 4) and codes.dtype == torch.long
    decoded = model.codec.decode(codes)
    with torch.no_grad():
        raw = hf.decode_image_tokens(codes.reshape(1, -1))
    torch.testing.assert_close(decoded, (raw * 0.5 + 0.5).clamp(0, 1))
    with pytest.raises(ValueError, match="decodes 4x4 grids"):
        model.codec.decode(torch.zeros(1, 3, 3, dtype=torch.long))


# ---- parity with transformers' generate ----------------------------------------------


def test_greedy_t2i_with_guidance_equals_transformers_generate(model, hf):
    samples = [_t2i("a", "draw a cat"), _t2i("b", "draw a red cat on the mat")]
    params = SamplingParams(greedy=True, guidance=3.0, max_new_tokens=16, length_semantics="exact")
    ours = RolloutEngine(model).generate([RolloutRequest(s, 0, params) for s in samples])
    prompts = [o.token_ids[: o.sampling.prompt_length] for o in ours]
    width = max(len(p) for p in prompts)
    ids = torch.stack(
        [torch.cat([p.new_full((width - len(p),), model.tokens.pad), p]) for p in prompts]
    )
    mask = torch.stack([torch.arange(width) >= width - len(p) for p in prompts]).long()
    ref = hf.generate(
        ids, attention_mask=mask, generation_mode="image", do_sample=False, guidance_scale=3.0
    )
    for row, o in enumerate(ours):
        n = o.sampling.prompt_length
        assert o.finish_reason == "length_exact" and int(o.token_ids[-1]) == model.tokens.eoi
        assert o.visual_codes[n : n + 16].tolist() == ref[row].tolist()
    assert len(set(ref.flatten().tolist())) > 4  # not a degenerate (uniform-logit) model


def test_greedy_i2t_text_equals_transformers_generate(ckpt, model, hf):
    samples = [_i2t("q1", "what is in this picture ?", 1), _i2t("q2", "a dog ? A B C D", 2)]
    params = SamplingParams(
        greedy=True, max_new_tokens=12, cycle_max_period=0, on_invalid_header="text"
    )
    ours = RolloutEngine(model).generate([RolloutRequest(s, 0, params) for s in samples])
    processor = AutoImageProcessor.from_pretrained(str(ckpt))
    for s, o in zip(samples, ours):
        n = o.sampling.prompt_length
        ids = o.token_ids[:n][None]
        image = (s.parts[0].pixels * 255).round().astype(np.uint8)
        pixel_values = processor(images=[image], return_tensors="pt")["pixel_values"]
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixel_values,
            generation_mode="text",
            do_sample=False,
            max_new_tokens=12,
        )
        assert o.token_ids[n:].tolist() == ref[0, n:].tolist()
    assert (
        ours[0].token_ids[ours[0].sampling.prompt_length :].tolist()
        != ours[1].token_ids[ours[1].sampling.prompt_length :].tolist()
    )  # the image and question matter


# ---- rollout vs replay ---------------------------------------------------------------


def test_rollout_logprobs_equal_replay_for_i2t_and_t2i(model):
    image = [
        SamplingParams(
            guidance=3.0, guidance_logprob=mode, max_new_tokens=16, length_semantics="exact"
        )
        for mode in ("guided", "conditional")
    ]
    text = SamplingParams(temperature=0.9, top_k=40, max_new_tokens=14)
    requests = []
    for k, words in enumerate(["draw a cat", "draw a red cat on the mat", "a dog"]):
        requests.append(RolloutRequest(_t2i(f"t{k}", words), 10 + k, image[k % 2]))
        question = ["what is in this picture ?", "a dog ? A B C D", "what ?"][k]
        requests.append(RolloutRequest(_i2t(f"q{k}", question, k), 20 + k, text))
    trajs = RolloutEngine(model).generate(requests)
    assert len({t.sampling.prompt_length for t in trajs}) >= 4  # left-padded prefill
    batch = TrajectoryBatch.collate(trajs, model.tokens.pad)
    with torch.no_grad():
        out = replay_logprobs(model, batch, sampling_records(trajs))
    policy = batch.policy_mask
    assert (out.logp[~policy] == 0).all()
    err = (out.logp - batch.rollout_logp).abs()
    assert_within(
        err, batch_logp_bounds(model, trajs, err.shape, n=_reductions(model, err)), "i2t/t2i"
    )
    logp = batch.rollout_logp[policy]
    assert float(logp.max()) > -1.0 and float(logp.min()) < -5.2  # far from uniform (-4.2)


# ---- Janus scale: 102,400 text ids, 576 image tokens -----------------------------------


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory) -> Path:
    # init 0.1: with w = 5 over 576 positions, fp32 cache-vs-full-forward noise amplified by
    # the guidance (z = u + w (c - u)) reaches ~1.3e-5 at init 0.2, ~2e-6 here
    spec = TinyJanusSpec(grid=24, vocab_size=102_400, initializer_range=0.1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("janus576"), spec, TEXTS)


def test_greedy_t2i_equals_transformers_generate_at_576_tokens(big_ckpt):
    model = JanusProModel.from_pretrained(big_ckpt).eval()
    hf = JanusForConditionalGeneration.from_pretrained(str(big_ckpt)).eval()
    hf.generation_config.generation_kwargs = {"boi_token_id": model.tokens.boi}
    params = SamplingParams(greedy=True, guidance=5.0, max_new_tokens=576, length_semantics="exact")
    (ours,) = RolloutEngine(model).generate(
        [RolloutRequest(_t2i("a", "a dog", 24).fork(0), 0, params)]
    )
    n = ours.sampling.prompt_length
    ids = ours.token_ids[:n][None]
    ref = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        generation_mode="image",
        do_sample=False,
        guidance_scale=5.0,
    )
    assert ref.shape == (1, 576) and ours.visual_codes[n : n + 576].tolist() == ref[0].tolist()
    assert len(set(ref[0].tolist())) > 8


def test_replay_at_janus_scale_matches_rollout_and_heads_see_scored_positions_only(big_ckpt):
    model = JanusProModel.from_pretrained(big_ckpt)
    assert model.n_image_tokens == 576 and model.lm_head.out_features == 102_400
    guided = SamplingParams(guidance=5.0, max_new_tokens=576, length_semantics="exact")
    text = SamplingParams(max_new_tokens=8)
    question = Sample("q", [ImagePart(pixels=_pixels(0, 96)), TextPart("what ?")])
    t2i = _t2i("t", "draw a cat", 24)
    requests = [RolloutRequest(t2i, 1, guided), RolloutRequest(question, 2, text)]
    trajs = RolloutEngine(model).generate(requests)
    assert trajs[0].finish_reason == "length_exact" and len(trajs[1]) > 576  # image prompt
    seen: dict[str, list[tuple[int, ...]]] = {"text": [], "visual": []}
    model.lm_head.register_forward_hook(lambda m, i, o: seen["text"].append(tuple(i[0].shape)))
    model.model.generation_head.register_forward_hook(
        lambda m, i, o: seen["visual"].append(tuple(i[0].shape))
    )
    model.train()
    batch = TrajectoryBatch.collate(trajs, model.tokens.pad)
    out = replay_logprobs(model, batch, sampling_records(trajs), chunk_size=128)
    err = (out.logp.detach() - batch.rollout_logp).abs()
    n_text = int((batch.policy_mask & (batch.modality == Modality.TEXT)).sum())
    assert sum(s[0] for s in seen["text"]) == n_text  # no [B, T, 102400] logits anywhere
    assert sum(s[0] for s in seen["visual"]) == 2 * 576  # conditional + unconditional rows
    out.logp.sum().backward()  # recomputes the heads chunk by chunk
    assert all(len(s) == 2 and s[0] <= 128 for s in seen["text"])
    assert all(len(s) == 2 and s[0] <= 2 * 128 for s in seen["visual"])
    model.eval()  # the bounds' own forward (after the head counts above)
    tol = batch_logp_bounds(model, trajs, err.shape, n=_reductions(model, err))
    assert_within(err, tol, "576 positions")
    assert model.lm_head.weight.grad is not None
    assert all(p.grad is None for p in model.model.vision_model.parameters())


# ---- LoRA and recipes -----------------------------------------------------------------


def test_recipes_lora_targets_language_model_and_gradients_skip_frozen_parts(ckpt):
    for name in ("grpo_i2t_mc_lora", "grpo_t2i_pickscore_lora"):
        with pytest.raises(Exception, match="model.path"):  # the checkpoint path is required
            check_model_config(load_config(RECIPES / f"{name}.yaml").model)
        cfg = load_config(RECIPES / f"{name}.yaml", [f"model.path={ckpt}"])
        lora, algo = cfg.trainer.lora, cfg.algorithm
        assert lora.enabled and lora.r == 16 and lora.target_modules == LORA_REGEX
        assert cfg.trainer.gradient_checkpointing and algo.old_logp_source == "replay"
        assert algo.scope == "group"
    model = JanusProModel.from_pretrained(ckpt)
    bare = [n for n, m in model.named_modules() if n.endswith(".q_proj")]
    assert any(n.startswith("model.vision_model.") for n in bare)  # why the regex is rooted
    model.enable_gradient_checkpointing()
    targets = apply_lora(model, cfg)
    assert targets and all(t.startswith("model.language_model.layers.") for t in targets)
    model.train()
    sample = Sample("g", [TextPart("draw a cat"), GenerationRequest(4, 4)])
    prompt = model.prompt_trajectory(sample)
    params = SamplingParams(guidance=5.0, max_new_tokens=16, length_semantics="exact")
    (traj,) = RolloutEngine(model).generate([RolloutRequest(sample, 1, params)])
    assert model.training and not model.model.vqmodel.training  # generate restores modes
    batch = TrajectoryBatch.collate([traj], model.tokens.pad)
    replay_logprobs(model, batch, [traj.sampling]).logp.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert any(float(g.abs().sum()) > 0 for n, g in grads.items() if "lora_B" in n)  # B = 0 at init
    assert len(prompt) == traj.sampling.prompt_length


# ---- one GRPO update through the loop (LoRA) -------------------------------------------


def _grpo_trainer(
    root: Path, task: str, plugins: list[dict], rollout: dict, truncated: str = "zero"
) -> Trainer:
    """A Janus-Pro GRPO job on the digits tasks (8x8 images: grid 2, patch 4), LoRA r=16
    on the language model, gradient checkpointing, replay-anchored ratio, group scope."""
    ckpt = write_tiny_checkpoint(root / "ckpt", TinyJanusSpec(grid=2), vocabulary_texts())
    cfg = validate_config(
        {
            "run": {"name": "j", "seed": 0, "output_dir": str(root / "run"), "device": "cpu"},
            "model": {"kind": "janus_pro", "path": str(ckpt)},
            "data": {"tasks": [task], "train_size": 8, "val_size": 0, "test_size": 0},
            "rollout": {"batch_size": 16, **rollout},
            "reward": {"plugins": plugins, "truncated_reward": truncated},
            "algorithm": {
                "name": "grpo",
                "group_size": 8,
                "scope": "group",
                "kl": {"type": "k3", "coef": 0.05},
            },
            "trainer": {
                "total_updates": 1,
                "global_batch_size": 16,
                "micro_batch_size": 8,
                "gradient_checkpointing": True,
                "lora": {"enabled": True, "r": 16, "target_modules": LORA_REGEX},
            },
            "checkpoint": {"every_updates": 0},
            "logging": {"tensorboard": False, "progress_bar": False},
        }
    )
    model = build_model(cfg)
    model.enable_gradient_checkpointing()
    apply_lora(model, cfg)
    model.train()
    source, objective = build_grpo_job(cfg, model, root / "run", DistInfo())
    return Trainer(model, source, objective, cfg, root / "run", DistInfo(), model.special_ids.pad)


def _one_update_changes_only_lora(trainer: Trainer) -> dict[str, float]:
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    (metrics,) = [m for _, m in trainer.fit()]
    after = trainer.model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all(".lora_" in k and k.startswith("model.language_model.") for k in changed)
    assert metrics["policy/ratio_is_one_by_construction"] == 1.0 and math.isfinite(metrics["loss"])
    return metrics


def test_one_grpo_update_i2t_mc_lora(tmp_path):
    # one-token answers end "cap": keep their rewards (this test is about the update)
    trainer = _grpo_trainer(
        tmp_path, "i2t_mc", [{"name": "mc_exact"}], {"max_new_tokens": 1}, truncated="keep"
    )
    # Make the one-token answers letters (all mass on A-D, spread across them), so the
    # groups' rewards vary: the rows of A-D in lm_head point along the prompts' mean
    # final hidden state, plus a little noise.
    model = trainer.model
    prompts = [model.prompt_trajectory(s) for s in make_task_samples("i2t_mc", "train", 8)]
    batch = TrajectoryBatch.collate(prompts, model.tokens.pad)
    with torch.no_grad():
        hidden = model.hidden(model.prepare(batch)).hidden
        last = hidden[torch.arange(len(batch)), batch.lengths - 1].mean(0)
        weight = (
            model.lm_head.base_layer.weight
            if hasattr(model.lm_head, "base_layer")
            else model.lm_head.weight
        )
        letters = model.tokenizer.convert_tokens_to_ids(list("ABCD"))
        noise = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0))
        weight[letters] = 2.0 * last / last.norm() + 0.05 * noise
    metrics = _one_update_changes_only_lora(trainer)
    assert metrics["reward/total_std"] > 0 and metrics["adv/frac_zero_std_groups"] < 1.0
    assert metrics["reward/mc_exact/invalid_frac"] < 0.5


def test_one_grpo_update_t2i_clip_lora_exact_count_is_never_shaped(tmp_path, tiny_clip_dir):
    clip = tiny_clip_dir
    trainer = _grpo_trainer(
        tmp_path,
        "t2i",
        [{"name": "clip_score", "path": str(clip)}],
        {"max_new_tokens": 4, "length_semantics": "exact", "guidance": 3.0},
    )
    metrics = _one_update_changes_only_lora(trainer)
    assert metrics["rollout/finish_length_exact_frac"] == 1.0  # 4 of 4 tokens: exact
    assert metrics["reward/overwritten_frac"] == 0.0 and metrics["reward/truncated_frac"] == 0.0
    assert metrics["reward/clip_score/invalid_frac"] == 0.0 and metrics["reward/total_std"] > 0


# ---- bad inputs ---------------------------------------------------------------------


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ckpt, tmp_path / "ckpt"))


@pytest.mark.parametrize(
    "remove, what",
    [
        (["model.safetensors"], r"model.safetensors: missing \(weights;"),
        (["tokenizer.json", "tokenizer_config.json"], r"tokenizer.json: missing \(tokenizer;"),
        (
            ["preprocessor_config.json", "processor_config.json"],
            r"preprocessor_config.json: missing \(image processor;",
        ),
    ],
)
def test_checkpoint_missing_files_fail_naming_them(ckpt, tmp_path, remove, what):
    path = _copy(ckpt, tmp_path)
    for name in remove:
        (path / name).unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match=what):
        load_model(path)


def test_remote_code_and_mismatched_tokenizers_are_refused(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(ValueError, match="remote code"):
        load_model(path)
    (path / "config.json").write_text(json.dumps({**config, "image_token_id": 0}))
    with pytest.raises(ValueError, match="config image_token_id is 0"):
        load_model(path)
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    build_digits_tokenizer().save_pretrained(str(path))
    with pytest.raises(ValueError, match="lacks Janus-Pro special token"):
        load_model(path)


def test_bad_images_and_unfillable_t2i_requests_fail_clearly(model, tmp_path):
    wrong = Sample("w", [ImagePart(pixels=np.zeros((16, 12, 3), np.float32)), TextPart("what ?")])
    with pytest.raises(ValueError, match="'w'.*16x12 pixels; Janus-Pro reads 16x16"):
        model.prompt_trajectory(wrong)
    Image.fromarray(np.zeros((12, 16, 3), np.uint8)).save(tmp_path / "small.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    cases = (("small.png", "is 12x16; the model takes 16x16"), ("broken.png", "cannot read"))
    for name, match in cases:
        row = {"messages": [{"role": "user", "content": [{"type": "image", "path": name}]}]}
        (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
        with pytest.raises(DatasetError, match=match):
            load_rows(tmp_path / "rows.jsonl", processor_for("janus_pro", model.image_size))
    engine = RolloutEngine(model)
    short = SamplingParams(max_new_tokens=15, length_semantics="exact")
    with pytest.raises(ValueError, match="max_new_tokens == H\\*W = 16"):
        engine.generate([RolloutRequest(_t2i("s", "a dog"), 0, short)])
    exact = SamplingParams(max_new_tokens=16, length_semantics="exact")
    for grid in ((2, 8), (2, 2)):
        with pytest.raises(ValueError, match="does not fill that grid"):
            engine.generate([RolloutRequest(Sample("g", [TextPart("a dog")]), 0, exact, grid)])
    prompt = model.prompt_trajectory(_i2t("u", "what ?", 5))
    imageless = replace(prompt, images=[])
    batch = TrajectoryBatch.collate([imageless], model.tokens.pad)
    with pytest.raises(ValueError, match="carries 0 image"):
        model.embed(model.prepare(batch))


# ---- colour ---------------------------------------------------------------------------

MEAN, STD = [0.48, 0.46, 0.41], [0.27, 0.26, 0.28]  # distinct per channel (CLIP-like)


def _colour_png(path: Path, seed: int) -> np.ndarray:
    """A 16x16 colour PNG (R, G and B differ everywhere); its uint8 pixels."""
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (16, 16, 3)).astype(np.uint8)
    rgb[..., 1] = 255 - rgb[..., 0]
    rgb[..., 2] = (rgb[..., 0] // 2 + 100).astype(np.uint8)
    Image.fromarray(rgb).save(path)
    return rgb


def test_colour_images_reach_the_vision_tower_in_colour(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    (path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                **json.loads((path / "preprocessor_config.json").read_text()),
                "image_mean": MEAN,
                "image_std": STD,
            }
        )
    )
    model = JanusProModel.from_pretrained(path).eval()
    rgb = _colour_png(tmp_path / "c.png", 7)
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "path": "c.png"}, {"type": "text", "text": "a"}],
            },
            {"role": "assistant", "content": "B"},
        ]
    }
    (tmp_path / "c.jsonl").write_text(json.dumps(row) + "\n")
    (sample,) = load_rows(
        tmp_path / "c.jsonl", processor_for("janus_pro", model.image_size)
    ).samples
    grey = Sample("g", [ImagePart(pixels=rgb[..., 0].astype(np.float32) / 255), TextPart("a")])
    seen: list[torch.Tensor] = []
    hook = model.model.vision_model.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].detach().clone())
    )
    try:
        for s in (sample, grey):
            traj = model.prompt_trajectory(s)
            batch = TrajectoryBatch.collate([traj], model.tokens.pad)
            with torch.no_grad():
                model.hidden(model.prepare(batch))
    finally:
        hook.remove()
    colour, grey_in = seen[0][0].double(), seen[1][0].double()
    pixels = rgb.astype(np.float64) / 255.0
    expected = np.stack([(pixels[..., c] - MEAN[c]) / STD[c] for c in range(3)])
    # uint8 / 255, - mean, / std in fp32 against float64: 3 roundings, one path
    assert_within(
        np.abs(colour.numpy() - expected),
        elementwise_bound(np.abs(expected).max(), 3, paths=1),
        "colour",
    )
    assert colour.shape == (3, 16, 16)
    assert not torch.allclose(colour[0], colour[1]) and not torch.allclose(colour[1], colour[2])
    red = pixels[..., 0]
    expected_grey = np.stack([(red - MEAN[c]) / STD[c] for c in range(3)])
    assert_within(
        np.abs(grey_in.numpy() - expected_grey),
        elementwise_bound(np.abs(expected_grey).max(), 3, paths=1),
        "grey",
    )


def test_uniweave_eval_end_to_end_on_a_colour_dataset(ckpt, tmp_path):
    import subprocess
    import sys

    rows = []
    for i, word in enumerate(["red", "green", "blue", "red"]):
        _colour_png(tmp_path / f"{i}.png", i)
        content = [{"type": "image", "path": f"{i}.png"}, {"type": "text", "text": "a dog"}]
        rows.append(
            {
                "id": f"c{i}",
                "messages": [{"role": "user", "content": content}],
                "answer": word,
                "task": "colour_name",
                "split": "test",
            }
        )
    (tmp_path / "colours.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval"
    (tmp_path / "c.yaml").write_text(
        f"run: {{output_dir: {tmp_path / 'run'}, device: cpu}}\n"
        f"model: {{kind: janus_pro, visual_head: vq, path: {ckpt}}}\n"
        f"data: {{path: {tmp_path / 'colours.jsonl'}, tasks: [colour_name]}}\n"
        "rollout: {max_new_tokens: 3, batch_size: 4}\n"
        "reward: {plugins: [{name: text_exact}], truncated_reward: keep}\n"
        f"evaluation: {{output_dir: {out}}}\n"
    )
    cmd = [sys.executable, "-m", "uniweave", "eval", str(tmp_path / "c.yaml")]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "CI": "true"}
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").open()]
    assert sorted(r["id"] for r in records) == ["c0", "c1", "c2", "c3"]
    for r in records:
        assert r["scores"].keys() == {"text_exact"}
        assert r["total"] == float(r["response"].strip() == r["answer"])
        i = int(r["id"][1])
        with Image.open(out / r["prompt_images"][0]) as im:
            assert im.mode == "RGB"  # saved as the model saw it: in colour
            np.testing.assert_array_equal(
                np.asarray(im), np.asarray(Image.open(tmp_path / f"{i}.png"))
            )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tasks"]["colour_name"]["n_samples"] == 4.0
    assert (out / "index.html").is_file()
