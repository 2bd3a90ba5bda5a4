"""GPU smoke test of UniAR training: one SFT and one GRPO text-to-image update with LoRA.

Each update runs the real loop (`Trainer`) from the recipes in `recipes/uniar/` (rsLoRA on
the Qwen3-VL language model, gradient checkpointing): SFT on synthetic interleaved rows
(a random image to read, a caption, a generated image of random target bits, a short
answer; bit CE + BitFlip), GRPO on captions (exact-count images of the codec's grid,
per-factor clipping, rewarded by `clip_score` from `--clip`; skipped without it). It
prints, per update, the step time and its phases and the peak device memory. Not CI.

    python bench/uniar_gpu_smoke.py --model /ckpt/uniar --clip /ckpt/PickScore_v1
    python bench/uniar_gpu_smoke.py --tiny        # dry run: random tiny UniAR, 1,024 bits
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch

from uniweave.codecs import BSQTokenizer, BSQTokenizerConfig
from uniweave.config import load_config
from uniweave.core.sample import GenerationRequest, ImagePart, Sample, TextPart
from uniweave.models.build import build_model
from uniweave.models.uniar import SMALL_SIZES, UniARModel, build_tiny_uniar
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.lora import adapter_state, apply_lora
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.grpo.job import build_grpo_job
from uniweave.train.methods.grpo.source import PromptSampler
from uniweave.train.methods.sft.objective import SFTObjective
from uniweave.train.methods.sft.source import DatasetSource

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "uniar"
CAPTIONS = ["draw a 3", "draw a 7", "draw a red apple", "draw a blue bird"]


def sft_rows(model: UniARModel, n: int, seed: int = 0) -> list:
    """Interleaved rows: an image to read, a caption, a generated image, an answer."""
    rng = np.random.default_rng(seed)
    gh, gw = model.image_grid
    side = 32
    rows = []
    for k in range(n):
        bits = torch.from_numpy(rng.integers(0, 2, (gh, gw, model.n_visual_outputs))).float()
        parts = [
            ImagePart(pixels=rng.random((side, side, 3)).astype(np.float32), role="user"),
            TextPart(CAPTIONS[k % len(CAPTIONS)], role="user"),
            ImagePart(codes=bits, role="assistant"),
            TextPart("done", role="assistant"),
        ]
        rows.append(model.prompt_trajectory(Sample(f"row-{k}", parts), False))
    return rows


def t2i_prompts(n: int, grid: tuple[int, int]) -> list[Sample]:
    """Captions, each asking for one image of the codec's grid."""
    return [
        Sample(
            f"caption-{k}",
            [TextPart(CAPTIONS[k % len(CAPTIONS)]), GenerationRequest(*grid)],
            task="t2i",
        )
        for k in range(n)
    ]


def shapes(model: UniARModel) -> str:
    """The language model's sizes, the image geometry and the parameter counts."""
    t = model.config.text_config
    total = sum(p.numel() for p in model.parameters())
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (
        f"d{t.hidden_size} L{t.num_hidden_layers} H{t.num_attention_heads}/"
        f"{t.num_key_value_heads} mlp{t.intermediate_size} V{t.vocab_size} "
        f"grid{'x'.join(map(str, model.image_grid))} bits{model.n_visual_outputs} "
        f"{total / 1e6:.1f}M params {lora / 1e6:.2f}M LoRA"
    )


def result_row(tag: str, model: UniARModel, cfg, metrics: dict, device: str) -> str:
    """One `RESULT | ... |` table row (bench/gpu_check.sh collects them)."""
    t = {
        k: metrics[f"time/{k}_s"]
        for k in ("rollout", "reward", "train")
        if f"time/{k}_s" in metrics
    }
    mem = ["-", "-"]
    if device == "cuda":
        peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        mem = [f"{b / 2.0**30:.2f}" for b in peaks]
    group = f" G{cfg.algorithm.group_size}" if cfg.algorithm.name == "grpo" else ""
    setup = (
        f"{cfg.trainer.global_batch_size} rows{group} "
        f"mb{cfg.trainer.micro_batch_size} {cfg.trainer.precision}"
    )
    cols = [tag, shapes(model), setup, f"{metrics['step_seconds']:.2f}"]
    cols += [f"{t[k]:.2f}" if k in t else "-" for k in ("rollout", "reward", "train")] + mem
    return "RESULT | " + " | ".join(cols) + " |"


def one_update(recipe: str, overrides: list[str], rows: int, tag: str = "uniar") -> None:
    """Load the model as the recipe says, run one update and print timings and memory."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gc.collect()  # the previous update's model, before the peak counters restart
    if device == "cuda":
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            RECIPES / recipe,
            [
                *overrides,
                f"run.output_dir={run_dir}",
                f"run.device={device}",
                "trainer.total_updates=1",
                "trainer.scheduler.warmup_steps=0",
                "checkpoint.every_updates=0",
                "logging.tensorboard=false",
                "logging.progress_bar=false",
            ],
        )
        model = build_model(cfg)
        model.enable_gradient_checkpointing()
        apply_lora(model, cfg)
        model = model.to(device).train()
        if cfg.algorithm.name == "sft":
            source = DatasetSource(sft_rows(model, rows), rows, 0, True, cfg.run.seed)
            objective = SFTObjective(cfg.algorithm)
        else:
            source, objective = build_grpo_job(cfg, model, Path(run_dir), DistInfo())
            prompts = t2i_prompts(rows // cfg.algorithm.group_size, model.image_grid)
            source.prompt_sampler = PromptSampler({"t2i": prompts}, None, cfg.data.seed)
        trainer = Trainer(
            model,
            source,
            objective,
            cfg,
            Path(run_dir),
            DistInfo(),
            model.special_ids.pad,
            trainable_state=partial(adapter_state, model),
        )
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        (_, metrics), *_ = list(trainer.fit())
        name = cfg.algorithm.name
        phases = {k: round(v, 3) for k, v in metrics.items() if k.startswith("time/")}
        print(f"{name}: {rows} rows, step {metrics['step_seconds']:.2f} s, phases {phases}")
        print(f"{name}: loss {metrics['loss']:.4g}, grad norm {metrics['grad_norm']:.4g}")
        if name == "grpo":
            print(
                f"grpo: reward mean {metrics['reward/total_mean']:.4f} std "
                f"{metrics['reward/total_std']:.4f}, exact-count rows "
                f"{metrics['rollout/finish_length_exact_frac']:.2f}"
            )
        if device == "cuda":
            gib = 2.0**30
            print(
                f"{name}: peak memory {torch.cuda.max_memory_allocated() / gib:.2f} GiB "
                f"allocated, {torch.cuda.max_memory_reserved() / gib:.2f} GiB reserved"
            )
        print(result_row(f"{tag} {name}", model, cfg, metrics, device), flush=True)


def tiny_checkpoint(path: Path) -> Path:
    """A random tiny UniAR with UniAR's geometry: a 64 px `BSQTokenizer` of 8 px cells
    grouped 4x4 x 64 bits = 1,024 factors per position (a 2x2 grid)."""
    torch.manual_seed(0)
    codec = BSQTokenizer(
        BSQTokenizerConfig(
            image_size=64,
            patch_size=8,
            hidden_size=32,
            num_layers=1,
            embed_dim=64,
            spatial_group=4,
        )  # fmt: skip
    )
    model = build_tiny_uniar(
        codec, SMALL_SIZES.model_copy(update={"hidden_size": 256, "num_layers": 4, "num_heads": 8})
    )
    model.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a UniAR directory (UniARModel.save_pretrained)")
    parser.add_argument("--tiny", action="store_true", help="random tiny UniAR (dry run)")
    parser.add_argument("--clip", help="local CLIPModel + CLIPProcessor directory (T2I reward)")
    parser.add_argument("--rows", type=int, default=8, help="rows per update")
    parser.add_argument("--group-size", type=int, default=4, help="GRPO samples per prompt")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per forward/backward")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None)
    parser.add_argument("--tag", default=None, help="check name in the RESULT rows")
    args = parser.parse_args()
    if bool(args.model) == args.tiny:
        parser.error("give exactly one of --model DIR and --tiny")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(tiny_checkpoint(Path(tmp) / "uniar"))
        model = UniARModel.from_pretrained(path)  # the loader's checks, before any update
        positions = model.image_grid[0] * model.image_grid[1]
        precision = args.precision or ("bf16" if device == "cuda" else "fp32")
        common = [
            f"model.path={path}",
            f"trainer.global_batch_size={args.rows}",
            f"trainer.micro_batch_size={min(args.micro_batch, args.rows)}",
            f"trainer.precision={precision}",
        ]
        print(
            f"device {device}, precision {precision}, checkpoint {path}: grid "
            f"{model.image_grid}, {model.n_visual_outputs} bits per position"
        )
        del model
        tag = args.tag or ("uniar-tiny" if args.tiny else "uniar")
        one_update("sft_lora.yaml", common, args.rows, tag)
        if args.clip is None:
            print("grpo: skipped (no --clip scorer directory)")
            return
        grpo = [
            *common,
            f"algorithm.group_size={args.group_size}",
            f"rollout.batch_size={args.rows}",
            f"rollout.max_new_tokens={positions}",
            f"reward.plugins.0.path={args.clip}",
            f"reward.plugins.0.kwargs.device={device}",
        ]
        one_update("grpo_lora.yaml", grpo, args.rows, tag)


if __name__ == "__main__":
    main()
