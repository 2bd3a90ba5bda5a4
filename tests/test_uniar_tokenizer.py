"""The real-scale BSQ image tokenizer (`uniweave.codecs.bsq_tokenizer`) with UniAR's geometry
(4x4 cells x 64 bits = 1,024 factors per position): save/load, encode/decode against an
independent computation, refusals, and a UniAR directory built with it running one SFT and
one GRPO update of `recipes/uniar/sft_lora.yaml` / `grpo_lora.yaml`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from trainer_helpers import LORA_REGEX, one_update_changes_only_lora
from transformers import Qwen3VLForConditionalGeneration

from uniweave.codecs import BSQTokenizer, BSQTokenizerConfig, codec_geometry, load_codec
from uniweave.codecs.base import single_thread
from uniweave.config import load_config
from uniweave.models.build import build_model
from uniweave.models.uniar import SMALL_SIZES, UniARModel, build_tiny_uniar
from uniweave.models.uniar.convert import main as convert
from uniweave.models.uniar.template import add_special_tokens
from uniweave.models.uniar.tiny import image_processor, tiny_qwen3_vl_config, uniar_tokenizer
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.lora import apply_lora
from uniweave.train.engine.trainer import Trainer
from uniweave.train.preflight import preflight
from uniweave.train.run import JOBS

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "uniar"
# 64 px, 8 px cells -> 8x8 cells -> 2x2 composite positions of 4*4*64 = 1,024 bits
GEOMETRY = {"image_size": 64, "patch_size": 8, "embed_dim": 64, "spatial_group": 4}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def tiny_tokenizer(seed: int = 0, **overrides) -> BSQTokenizer:
    cfg = BSQTokenizerConfig(**{**GEOMETRY, "hidden_size": 16, "num_layers": 1, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BSQTokenizer(cfg)


def test_geometry_and_bitwise_save_load(tmp_path):
    tok = tiny_tokenizer()
    assert tok.grid == (2, 2) and tok.bits_per_position == 1024 and tok.latent_dim == 64
    tok.save_pretrained(tmp_path / "tok")
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    assert codec_geometry(tmp_path / "tok") == ("bsq_tokenizer", (2, 2), 1024)
    again = load_codec(tmp_path / "tok")
    assert isinstance(again, BSQTokenizer) and again.cfg == tok.cfg
    a, b = tok.net.state_dict(), again.net.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.rand(3, 64, 64, 3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(tok.encode(x), again.encode(x))
    bits = tok.encode(x)
    assert torch.equal(tok.decode(bits), again.decode(bits))


def test_encode_decode_against_an_independent_computation():
    tok = tiny_tokenizer()
    x = torch.rand(2, 64, 64, 3, generator=torch.Generator().manual_seed(2))
    bits = tok.encode(x)
    assert bits.shape == (2, 2, 2, 1024) and bits.dtype == torch.float32
    assert set(bits.unique().tolist()) == {0.0, 1.0}
    net = tok.net
    with torch.no_grad():  # the same layers applied by hand, cell by cell
        v = net.patch_embed(2.0 * x.permute(0, 3, 1, 2) - 1.0)
        for block in net.encoder:
            v = v + block.conv2(torch.nn.functional.gelu(block.conv1(torch.nn.functional.gelu(v))))
        z = net.quant_embed(torch.nn.functional.gelu(v))  # [N, 64, 8, 8], before normalising
    for n, gi, gj, dy, dx in [(0, 0, 0, 0, 0), (1, 1, 0, 3, 2), (0, 1, 1, 2, 3), (1, 0, 1, 1, 0)]:
        cell = z[n, :, 4 * gi + dy, 4 * gj + dx]
        start = (dy * 4 + dx) * 64
        assert torch.equal(bits[n, gi, gj, start : start + 64], (cell > 0).float())
    # decode: the code of each cell is (2b - 1)/sqrt(64), a unit vector, then the decoder
    vec = tok.bits_to_vectors(bits).reshape(2, 2, 2, 16, 64)
    assert torch.allclose(vec.norm(dim=-1), torch.ones(2, 2, 2, 16))
    c = torch.zeros(2, 64, 8, 8)
    for gi in range(2):
        for gj in range(2):
            for k in range(16):
                c[:, :, 4 * gi + k // 4, 4 * gj + k % 4] = vec[:, gi, gj, k]
    with torch.no_grad():
        expected = net.decode(c).permute(0, 2, 3, 1)
    pixels = tok.decode(bits)
    assert pixels.shape == (2, 64, 64, 3) and torch.equal(pixels, expected)
    assert float(pixels.min()) >= 0.0 and float(pixels.max()) <= 1.0
    grey = tok.encode(x[..., 0])  # grey [N, S, S] is copied into R, G and B
    assert torch.equal(grey, tok.encode(x[..., :1].expand(-1, -1, -1, 3)))
    with pytest.raises(ValueError, match=r"pixels must have shape \[N, 64, 64, 3\]"):
        tok.encode(torch.rand(1, 32, 32, 3))
    with pytest.raises(ValueError, match=r"BSQ codes must have shape \[N, 2, 2, 1024\]"):
        tok.decode(torch.zeros(1, 4, 4, 1024))


def _edit(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    for key in [k for k, v in fields.items() if v is None]:
        del data[key]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "bsq"}, r"config\.json: field kind is 'bsq', not 'bsq_tokenizer'"),
        ({"embed_dim": None}, r"config\.json: field embed_dim is missing"),
        ({"codebook_size": 4096}, r"config\.json: field codebook_size is unknown"),
        ({"patch_size": 7}, r"config\.json: field patch_size 7 does not divide image_size 64"),
        ({"spatial_group": 3}, r"config\.json: field spatial_group 3 does not divide"),
        (
            {"embed_dim": 32},
            r"config\.json: field embed_dim/hidden_size gives tensor post_quant_embed",
        ),
        ({"num_layers": 2}, r"config\.json: field num_layers does not match the weights"),
    ],
)
def test_a_bad_or_mismatched_config_is_refused_naming_file_and_field(tmp_path, fields, message):
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    _edit(tmp_path / "tok" / "config.json", **fields)
    with pytest.raises(ValueError, match=message) as info:
        load_codec(tmp_path / "tok")
    assert "\n" not in str(info.value)


def _write_png(path: Path, seed: int) -> str:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    return path.name


def _rows(root: Path) -> tuple[Path, Path]:
    """SFT rows (an image to read, a caption, a generated image, an answer) and T2I prompts."""
    root.mkdir(parents=True)
    sft, t2i = [], []
    for k in range(4):
        user = [{"type": "image", "path": _write_png(root / f"in{k}.png", k)}]
        user.append({"type": "text", "text": f"draw {k}"})
        answer = [{"type": "image", "path": _write_png(root / f"out{k}.png", 10 + k)}]
        answer.append({"type": "text", "text": str(k)})
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        sft.append({"id": f"s{k}", "messages": messages, "task": "t2i"})
        gen = [{"role": "user", "content": f"draw {k}"}]
        gen.append({"role": "assistant", "content": [{"type": "generate_image"}]})
        t2i.append({"id": f"p{k}", "messages": gen, "task": "t2i"})
    for name, rows in (("sft.jsonl", sft), ("t2i.jsonl", t2i)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "sft.jsonl", root / "t2i.jsonl"


def _converted_uniar(tmp_path: Path) -> Path:
    """`python -m uniweave.models.uniar.convert` on a tiny random Qwen3-VL + the tokenizer."""
    tiny_tokenizer().save_pretrained(tmp_path / "bsq")
    tok = uniar_tokenizer()
    add_special_tokens(tok)
    qwen = tmp_path / "qwen"
    config = tiny_qwen3_vl_config(SMALL_SIZES, tok)
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(config).save_pretrained(str(qwen))
    tok.save_pretrained(str(qwen))
    image_processor().save_pretrained(str(qwen))
    assert convert([str(qwen), str(tmp_path / "bsq"), str(tmp_path / "uniar")]) == 0
    return tmp_path / "uniar"


def test_uniar_directory_with_it_loads_and_runs_the_lora_recipes(tmp_path, tiny_clip_dir):
    path = _converted_uniar(tmp_path)
    model = UniARModel.from_pretrained(path)
    assert isinstance(model.codec, BSQTokenizer)
    assert model.image_grid == (2, 2) and model.n_visual_outputs == 1024
    assert model.visual_decoder.proj_out.out_features == 1024
    built = build_tiny_uniar(tiny_tokenizer(), SMALL_SIZES)
    assert built.record()["bits_per_position"] == 1024
    sft_rows, t2i_rows = _rows(tmp_path / "data")
    common = [
        f"model.path={path}",
        "run.device=cpu",
        "trainer.total_updates=1",
        "data.train_size=4",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2",
        "trainer.precision=fp32",
        "trainer.scheduler.warmup_steps=0",
        "trainer.lora.r=4",
        "checkpoint.every_updates=0",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
    ]
    sft = load_config(
        RECIPES / "sft_lora.yaml",
        [*common, f"run.output_dir={tmp_path / 'sft'}", f"data.path={sft_rows}"],
    )
    assert sft.trainer.lora.rslora and sft.trainer.lora.target_modules == LORA_REGEX
    clip = tiny_clip_dir
    grpo = load_config(
        RECIPES / "grpo_lora.yaml",
        [
            *common,
            f"run.output_dir={tmp_path / 'grpo'}",
            f"data.path={t2i_rows}",
            "algorithm.group_size=2",
            "rollout.batch_size=4",
            "rollout.max_new_tokens=4",
            f"reward.plugins.0.path={clip}",
            "reward.plugins.0.kwargs.device=cpu",
        ],
    )
    for cfg in (sft, grpo):  # what `uniweave train` does, up to the first update
        preflight(cfg, JOBS)
        model = build_model(cfg)
        assert isinstance(model.codec, BSQTokenizer) and model.n_visual_outputs == 1024
        model.enable_gradient_checkpointing()
        apply_lora(model, cfg)
        run_dir = Path(cfg.run.output_dir)
        source, objective = JOBS[cfg.algorithm.name](cfg, model.train(), run_dir, DistInfo())
        pad = model.special_ids.pad
        trainer = Trainer(model, source, objective, cfg, run_dir, DistInfo(), pad)
        metrics = one_update_changes_only_lora(trainer)  # LoRA tensors only, finite loss
        assert metrics["grad_norm"] > 0 and math.isfinite(metrics["grad_norm"])
    assert metrics["rollout/finish_length_exact_frac"] == 1.0
    assert metrics["reward/total_std"] > 0


def test_uniar_loader_refuses_a_tokenizer_that_makes_another_grid_or_width(tmp_path):
    model = build_tiny_uniar(tiny_tokenizer(), SMALL_SIZES)
    for name, fields, message in [
        ("grid", {"spatial_group": 2}, r"codec/config\.json: field image_size/patch_size/"
         r"spatial_group: the codec makes a 4x4 grid but uniweave_model\.json field image_grid"),
        ("bits", {"embed_dim": 32}, r"codec/config\.json: field embed_dim/spatial_group: the "
         r"codec gives 512 bits per position but uniweave_model\.json field bits_per_position"),
        ("kind", {"kind": "vq"}, r"codec/config\.json: field kind is 'vq'; UniAR needs one of"),
    ]:  # fmt: skip
        model.save_pretrained(tmp_path / name)
        _edit(tmp_path / name / "codec" / "config.json", **fields)
        with pytest.raises(ValueError, match=message) as info:
            UniARModel.from_pretrained(tmp_path / name)
        assert "\n" not in str(info.value)
