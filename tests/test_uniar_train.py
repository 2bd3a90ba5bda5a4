"""UniAR in the training paths: `model.kind: uniar` built from the config, one SFT update
(bit CE + BitFlip on draw-then-answer rows) and one GRPO update (text-to-image bits with
CFG, bit temperature, per-factor clipping against rollout log-probs, factor-averaged JSD)
with LoRA change only adapter weights; the recipes validate; the README's custom loss
on `forward_interleaved` runs."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from trainer_helpers import LORA_REGEX, one_update_changes_only_lora
from transformers import Qwen3VLForConditionalGeneration

from uniweave.codecs.base import single_thread
from uniweave.config import load_config, validate_config
from uniweave.core.sample import GenerationRequest, Sample, TextPart
from uniweave.models.build import build_model
from uniweave.models.uniar import SMALL_SIZES, UniARModel
from uniweave.models.uniar.convert import main as convert
from uniweave.models.uniar.template import add_special_tokens
from uniweave.models.uniar.tiny import image_processor, tiny_qwen3_vl_config
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.lora import apply_lora
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.grpo.job import build_grpo_job
from uniweave.train.methods.sft.job import build_sft_job
from uniweave.train.preflight import InputError, preflight
from uniweave.train.run import JOBS

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "uniar"
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def codec_dir(uniar_codec_dir) -> Path:
    return uniar_codec_dir


def _config(root: Path, codec_dir: Path, algorithm: dict, data: dict, **extra) -> dict:
    return {
        "run": {"name": "u", "seed": 0, "output_dir": str(root / "run"), "device": "cpu"},
        "model": {
            "kind": "uniar",
            "visual_head": "bsq",
            "tiny": {**TINY, "mixer_kernel": 0},
            "codec": {"path": str(codec_dir), "bits": 16, "patch_size": 2},
        },
        "data": {"train_size": 8, "val_size": 0, "test_size": 0, **data},
        "algorithm": algorithm,
        "trainer": {
            "total_updates": 1,
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "gradient_checkpointing": True,
            "lora": {"enabled": True, "r": 4, "rslora": True, "target_modules": LORA_REGEX},
        },
        "checkpoint": {"every_updates": 0},
        "logging": {"tensorboard": False, "progress_bar": False},
        **extra,
    }


def _trainer(cfg, root: Path, job) -> Trainer:
    model = build_model(cfg)
    assert isinstance(model, UniARModel) and model.n_visual_outputs == 16
    model.enable_gradient_checkpointing()
    targets = apply_lora(model, cfg)
    assert targets and all(t.startswith("model.language_model.layers.") for t in targets)
    model.train()
    assert not model.model.visual.training  # the frozen tower stays in eval
    source, objective = job(cfg, model, root / "run", DistInfo())
    return Trainer(model, source, objective, cfg, root / "run", DistInfo(), model.special_ids.pad)


def test_config_refuses_a_mixer_for_uniar(codec_dir, tmp_path):
    data = _config(tmp_path, codec_dir, {"name": "sft"}, {"tasks": ["t2i"]})
    data["model"]["tiny"]["mixer_kernel"] = 4
    with pytest.raises(Exception, match="model.tiny.mixer_kernel"):
        build_model(validate_config(data))


def test_one_sft_update_with_bitflip_and_lora(codec_dir, tmp_path):
    algo = {"name": "sft", "bitflip": {"probability": 0.1}}
    cfg = validate_config(_config(tmp_path, codec_dir, algo, {"tasks": ["draw_then_answer"]}))
    metrics = one_update_changes_only_lora(_trainer(cfg, tmp_path, build_sft_job))
    bits = [k for k in metrics if "bit" in k or "visual" in k]
    assert bits and all(math.isfinite(metrics[k]) for k in bits), metrics


def test_one_grpo_t2i_update_with_cfg_per_factor_clip_and_jsd(codec_dir, tiny_clip_dir, tmp_path):
    clip = tiny_clip_dir
    algo = {
        "name": "grpo",
        "group_size": 4,
        "scope": "group",
        "kl": {"type": "jsd", "coef": 0.05},
        "old_logp_source": "rollout",
    }
    extra = {
        "rollout": {
            "batch_size": 8,
            "max_new_tokens": 16,
            "length_semantics": "exact",
            "guidance": 3.0,
            "bit_temperature": 0.9,
        },
        "reward": {"plugins": [{"name": "clip_score", "path": str(clip)}]},
    }
    cfg = validate_config(_config(tmp_path, codec_dir, algo, {"tasks": ["t2i"]}, **extra))
    metrics = one_update_changes_only_lora(_trainer(cfg, tmp_path, build_grpo_job))
    assert metrics["rollout/finish_length_exact_frac"] == 1.0
    assert metrics["reward/total_std"] > 0


def test_recipes_validate_and_real_scale_ones_need_the_checkpoint_path():
    for name in ("digits_sft", "digits_grpo_t2i"):
        cfg = load_config(RECIPES / f"{name}.yaml")
        assert cfg.model.kind == "uniar" and cfg.model.visual_head == "bsq"
    for name in ("sft_lora", "grpo_lora"):
        with pytest.raises(InputError, match="/path/to/uniar: not found") as info:
            preflight(load_config(RECIPES / f"{name}.yaml"), JOBS)
        assert info.value.key == "model.path"
        cfg = load_config(RECIPES / f"{name}.yaml", ["model.path=/ckpt/uniar"])
        assert cfg.trainer.lora.enabled and cfg.trainer.lora.target_modules == LORA_REGEX


def test_readme_custom_loss_on_forward_interleaved_runs():
    text = (RECIPES / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    scope: dict = {}
    exec(compile(code, str(RECIPES / "README.md"), "exec"), scope)
    # the signature (the block is formatted by `ruff format`, which may wrap it)
    assert re.search(r'vision\["image_grid_thw"\],\s*batch\.visual_codes', code)
    out, batch = scope["out"], scope["batch"]
    assert torch.equal(out.visual_mask, batch.modality == 1) and int(out.visual_mask.sum()) == 16
    assert out.position_ids.shape == (3, *batch.token_ids.shape)
    loss = scope["loss"]
    assert loss.dim() == 0 and math.isfinite(float(loss))
    grads = [p.grad for p in scope["model"].parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)


def _qwen_like_tokenizer():
    """A WordLevel tokenizer with Qwen-VL's special tokens but not UniAR's."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>"]
    specials += ["<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    words = ["<unk>", *specials, "\n", "user", "assistant", "draw", "generate", "image", "3"]
    words += [str(k) for k in range(31)]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(r"\n|\w+|[^\w\s]", behavior="isolated")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def test_convert_a_qwen3_vl_checkpoint_adds_tokens_and_reloads(codec_dir, tmp_path):
    tok = _qwen_like_tokenizer()
    n_before = len(tok)
    probe = _qwen_like_tokenizer()
    ids = add_special_tokens(probe)  # what conversion does to the checkpoint's tokenizer
    assert {ids["image_gen"], ids["pad"]} == {n_before, n_before + 1}  # appended, in order
    qwen = tmp_path / "qwen"
    Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(SMALL_SIZES, probe)).save_pretrained(
        str(qwen)
    )
    tok.save_pretrained(str(qwen))  # the checkpoint's own tokenizer, without UniAR's tokens
    image_processor().save_pretrained(str(qwen))
    assert convert([str(qwen), str(codec_dir), str(tmp_path / "uniar")]) == 0
    model = UniARModel.from_pretrained(tmp_path / "uniar")
    assert model.tokenizer.convert_tokens_to_ids("<image_gen>") == ids["image_gen"]
    assert model.special_ids.image_pad == tok.convert_tokens_to_ids("<|image_pad|>")
    prompt = model.prompt_trajectory(Sample("t", [TextPart("draw 3"), GenerationRequest(4, 4)]))
    assert prompt.token_ids[-1] == model.special_ids.vision_start
