"""GPU smoke test of Janus-Pro GRPO: one I2T and one T2I update on a local checkpoint.

Each update runs the real loop (`uniweave.train.methods.grpo.objective.build_grpo_job` + `Trainer`) from the
recipe in `recipes/janus_pro/` (LoRA r=16 on the language model, gradient checkpointing,
replay-anchored ratio), on synthetic prompts: I2T multiple-choice questions about
random 384x384 images (rewarded by `mc_exact`), T2I captions (576 exact-count tokens with
CFG, rewarded by `clip_score` from `--clip`; skipped without it). It prints, per update,
the wall time of the step and its phases (rollout, reward, train) and the peak device
memory (allocated / reserved). Not part of CI.

    python bench/janus_gpu_smoke.py --model /ckpt/Janus-Pro-1B --clip /ckpt/PickScore_v1
    python bench/janus_gpu_smoke.py --tiny --clip /tmp/tiny_clip   # dry run, random weights
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from transformers import JanusConfig

from uniweave.config import load_config
from uniweave.core.sample import GenerationRequest, ImagePart, Sample, TextPart
from uniweave.models.build import build_model
from uniweave.models.janus_pro import JanusProModel
from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.lora import adapter_state, apply_lora
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.grpo.job import build_grpo_job
from uniweave.train.methods.grpo.source import PromptSampler

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "janus_pro"
COLOURS = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.1, 0.2, 0.9),
    "grey": (0.5,) * 3,
}
CAPTIONS = [
    "a red apple on a wooden table",
    "a lighthouse on a cliff at sunset",
    "a blue bird sitting on a branch",
    "a bowl of ramen, studio photo",
]


def i2t_prompts(n: int, size: int, seed: int = 0) -> list[Sample]:
    """Questions about the dominant colour of noisy solid-colour images."""
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    out = []
    for k in range(n):
        answer = int(rng.integers(4))
        base = np.asarray(COLOURS[names[answer]], dtype=np.float32)
        noise = rng.normal(0.0, 0.05, (size, size, 3)).astype(np.float32)
        pixels = np.clip(base + noise, 0.0, 1.0)
        options = " ".join(f"{'ABCD'[j]}. {c}" for j, c in enumerate(names))
        question = f"Which colour fills this image? {options}. Answer with the letter only."
        parts = [ImagePart(pixels=pixels), TextPart(question)]
        out.append(Sample(f"colour-{k}", parts, answer="ABCD"[answer], task="i2t_mc"))
    return out


def t2i_prompts(n: int, grid: tuple[int, int]) -> list[Sample]:
    """Captions, each asking for one image of the model's grid (the recipe's exact count)."""
    return [
        Sample(
            f"caption-{k}",
            [TextPart(CAPTIONS[k % len(CAPTIONS)]), GenerationRequest(*grid)],
            task="t2i",
        )
        for k in range(n)
    ]


def shapes(model: torch.nn.Module) -> str:
    """The language model's sizes, the image geometry and the parameter counts."""
    t = model.config.text_config
    total = sum(p.numel() for p in model.parameters())
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (
        f"d{t.hidden_size} L{t.num_hidden_layers} H{t.num_attention_heads} "
        f"mlp{t.intermediate_size} V{t.vocab_size} grid{'x'.join(map(str, model.image_grid))} "
        f"codes{model.n_visual_outputs} {total / 1e6:.1f}M params {lora / 1e6:.2f}M LoRA"
    )


def result_row(tag: str, model, cfg, metrics: dict, device: str) -> str:
    """One `RESULT | ... |` table row (bench/gpu_check.sh collects them)."""
    t = {
        k: metrics[f"time/{k}_s"]
        for k in ("rollout", "reward", "train")
        if f"time/{k}_s" in metrics
    }
    mem = ["-", "-"]
    if device.startswith("cuda"):
        peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        mem = [f"{b / 2.0**30:.2f}" for b in peaks]
    setup = (
        f"{cfg.trainer.global_batch_size} rows G{cfg.algorithm.group_size} "
        f"mb{cfg.trainer.micro_batch_size} {cfg.trainer.precision}"
    )
    cols = [tag, shapes(model), setup, f"{metrics['step_seconds']:.2f}"]
    cols += [f"{t[k]:.2f}" if k in t else "-" for k in ("rollout", "reward", "train")] + mem
    return "RESULT | " + " | ".join(cols) + " |"


def one_update(
    recipe: str,
    overrides: list[str],
    make_prompts: Callable[[JanusProModel], list[Sample]],
    tag: str = "janus",
) -> None:
    """Load the model as the recipe says, run one GRPO update on `make_prompts(model)` and
    print its timings and peak memory."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gc.collect()  # the previous update's model, before the peak counters restart
    if device.startswith("cuda"):
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
        source, objective = build_grpo_job(cfg, model, Path(run_dir), DistInfo())
        prompts = make_prompts(model)
        source.prompt_sampler = PromptSampler({prompts[0].task: prompts}, None, cfg.data.seed)
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
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        (_, metrics), *_ = list(trainer.fit())
        task = prompts[0].task
        print(
            f"{task}: {cfg.trainer.global_batch_size} rows (G={cfg.algorithm.group_size}), "
            f"step {metrics['step_seconds']:.2f} s = rollout {metrics['time/rollout_s']:.2f} s + reward "
            f"{metrics['time/reward_s']:.2f} s + train {metrics['time/train_s']:.2f} s; "
            f"{metrics['rollout/response_len_mean']:.0f} sampled positions/row"
        )
        print(
            f"{task}: reward mean {metrics['reward/total_mean']:.4f} std "
            f"{metrics['reward/total_std']:.4f}, loss {metrics['loss']:.4g}, "
            f"grad norm {metrics['grad_norm']:.4g}"
        )
        invalid = {k: v for k, v in metrics.items() if k.endswith("/invalid_frac")}
        print(f"{task}: invalid-format fractions {invalid} (1.0 = no response parsed)")
        if device.startswith("cuda"):
            gib = 2.0**30
            print(
                f"{task}: peak memory {torch.cuda.max_memory_allocated() / gib:.2f} GiB "
                f"allocated, {torch.cuda.max_memory_reserved() / gib:.2f} GiB reserved"
            )
        print(result_row(f"{tag} {task}", model, cfg, metrics, device), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local transformers Janus-Pro checkpoint directory")
    parser.add_argument("--tiny", action="store_true", help="random tiny checkpoint (dry run)")
    parser.add_argument(
        "--tiny-grid", type=int, default=24, help="--tiny: image tokens per side (24: 576 tokens)"
    )
    parser.add_argument("--clip", help="local CLIPModel + CLIPProcessor directory (T2I reward)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per update")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per forward/backward")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None)
    parser.add_argument("--tag", default=None, help="check name in the RESULT rows")
    args = parser.parse_args()
    if bool(args.model) == args.tiny:
        parser.error("give exactly one of --model DIR and --tiny")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if args.tiny:
            spec = TinyJanusSpec(grid=args.tiny_grid, patch=16, vocab_size=102_400)
            path = str(write_tiny_checkpoint(Path(tmp) / "janus", spec, CAPTIONS))
        precision = args.precision or ("bf16" if device == "cuda" else "fp32")
        rows = args.prompts * args.group_size
        common = [
            f"model.path={path}",
            f"algorithm.group_size={args.group_size}",
            f"trainer.global_batch_size={rows}",
            f"trainer.micro_batch_size={min(args.micro_batch, rows)}",
            f"trainer.precision={precision}",
            f"rollout.batch_size={rows}",
        ]
        print(f"device {device}, precision {precision}, checkpoint {path}")
        n = args.prompts
        tag = args.tag or ("janus-tiny" if args.tiny else "janus")
        i2t = lambda m: i2t_prompts(n, m.image_size[0])  # noqa: E731
        one_update("grpo_i2t_mc_lora.yaml", common, i2t, tag)
        if args.clip is None:
            print("t2i: skipped (no --clip scorer directory)")
            return
        scorer = [f"reward.plugins.0.path={args.clip}", f"reward.plugins.0.kwargs.device={device}"]
        # the image's token count (576 at 384 px; fewer for `write-full-shape --shape small`)
        side = int(JanusConfig.from_pretrained(path).vq_config.num_patches)
        scorer.append(f"rollout.max_new_tokens={side * side}")
        t2i = lambda m: t2i_prompts(n, m.image_grid)  # noqa: E731
        one_update("grpo_t2i_pickscore_lora.yaml", [*common, *scorer], t2i, tag)


if __name__ == "__main__":
    main()
