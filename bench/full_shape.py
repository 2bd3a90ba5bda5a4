"""Full-shape CPU bench: one step of each method on a random-weight Janus-Pro checkpoint at
its published sizes, with the memory `uniweave plan --host` predicts next to the measured one.

The checkpoint is `uniweave models write-full-shape janus-pro-1b` (written to --model DIR when
that directory does not exist yet; default /tmp/uniweave_full_shape/janus-pro-1b). Every
step runs the project's own code: the model is prepared as `uniweave train` prepares it
(`uniweave.train.run._prepare_model`: LoRA from the recipe, gradient checkpointing), the job
is the method's job builder (`build_grpo_job`, `build_opd_job`; SFT: the `DatasetSource`
+ `SFTObjective` that `build_sft_job` assembles) and one update is `Trainer.fit`. The
phases, each with the Janus-Pro recipe of `recipes/janus_pro/` (LoRA r=16 on the
language model, KL k3 for GRPO), in fp32 and in bf16 (`trainer.precision` and
`rollout.precision` both bf16: autocast over fp32 weights):

- `t2i`: GRPO text-to-image, one caption, G = 2 samples of 576 image tokens (24x24,
  exact), CFG w = 5 (so 4 decoded rows), rewarded by a tiny random CLIP scorer
  (`tests/model_fixtures.write_tiny_clip`: the reward is not what is measured);
- `i2t`: GRPO image-to-text, one 384 px image + a 4-option question, G = 2, answers
  capped at --i2t-tokens new tokens (default 8: the letter, not a long rationale),
  `mc_exact` reward;
- `opd`: OPD on the same I2T question (recipe `opd_i2t_mc_lora.yaml`), the teacher being
  the same checkpoint (a second full model in memory), 2 student rows;
- `sft`: SFT on one caption -> 384 px image row (576 VQ target tokens).

Each (precision, phase) runs in a fresh Python process (the RSS high-water mark is a
per-process quantity): after the model and the job are built the child resets the
kernel's high-water mark (`/proc/self/clear_refs` <- 5), runs the update, and reads
`VmHWM` (the step's peak RSS, the resident weights included). It also reports the
setup's peak (VmHWM read just before the reset: loading the checkpoint included; not
`ru_maxrss`, which the reset lowers too). For the GRPO phases the
rollout-vs-replay log-prob gap is the trainer's own diagnostic (`mismatch/abs_dlogp_max`
and `_mean`: |logp_rollout - logp_replay| over every sampled position, the replay being
the update's teacher-forced forward at trainer precision).

The table puts each phase's measured step peak next to `uniweave plan`'s host prediction for
the same config (`uniweave.plan.account` with `Setup.host`: the `--host` mode of the CLI,
docs/plan.md), with the prompt length the child measured, and their ratio.

    python bench/full_shape.py                              # Janus-Pro-1B, everything
    python bench/full_shape.py --precisions fp32 --phases t2i
    python bench/full_shape.py --table-only RESULTS.json    # re-plan saved measurements
    python bench/full_shape.py --tiny                        # small shapes (tests/, seconds)

Ends with one `result: name=value ...` line.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "janus_pro"
PHASES = ("t2i", "i2t", "opd", "sft")
PRECISIONS = ("fp32", "bf16")
DEFAULT_MODEL = Path(tempfile.gettempdir()) / "uniweave_full_shape" / "janus-pro-1b"
CAPTION = "a red apple on a wooden table"
GIB = 1024**3


# ---- the child: one phase in one precision ------------------------------------------------


def rss_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, bytes (Linux /proc)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_high_water() -> None:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0, proc(5) clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def recipe_config(phase: str, precision: str, model: str, run_dir: str, args) -> object:
    """The phase's config: its Janus-Pro recipe, shortened to one update of 2 rows."""
    import yaml

    from uniweave.config import load_config

    name = {
        "t2i": "grpo_t2i_pickscore_lora.yaml",
        "i2t": "grpo_i2t_mc_lora.yaml",
        "opd": "opd_i2t_mc_lora.yaml",
        "sft": "grpo_t2i_pickscore_lora.yaml",
    }[phase]
    raw = yaml.safe_load((RECIPES / name).read_text())
    raw["model"]["path"] = model
    raw["trainer"].update(
        total_updates=1,
        global_batch_size=2,
        micro_batch_size=2,
        precision=precision,
        scheduler={"name": "warmup_constant", "warmup_steps": 0},
    )
    raw["checkpoint"] = {"every_updates": 0}
    raw["logging"] = {"every": 1, "tensorboard": False, "progress_bar": False}
    raw["run"].update(output_dir=run_dir, device="cpu")
    if args.host_mmap_threshold is not None:  # "none": glibc's dynamic threshold
        value = args.host_mmap_threshold
        raw["run"]["host_mmap_threshold"] = None if value == "none" else int(value)
    if phase == "sft":  # caption -> image rows; no rollout, no reward
        raw["algorithm"] = {"name": "sft"}
        raw.pop("rollout")
        raw.pop("reward")
    else:
        raw["rollout"].update(batch_size=2, precision=precision)
        if phase != "opd":
            raw["algorithm"]["group_size"] = 2
    if phase == "t2i":
        raw["rollout"]["max_new_tokens"] = args.image_tokens
        raw["reward"]["plugins"][0].update(path=args.clip, kwargs={"mode": "pickscore",
                                                                   "device": "cpu"})  # fmt: skip
    if phase in ("i2t", "opd"):
        raw["rollout"]["max_new_tokens"] = args.i2t_tokens
    if phase == "opd":
        raw["algorithm"]["teacher"]["path"] = model
        raw["algorithm"]["gt_replay"] = {"mode": "failure", "budget": 1}
    path = Path(run_dir) / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


def bench_samples(phase: str, image_size: int, grid: tuple[int, int]):
    """The phase's one prompt (GRPO/OPD) or one training row (SFT)."""
    import numpy as np

    from uniweave.core.sample import GenerationRequest, ImagePart, Sample, TextPart

    rng = np.random.default_rng(0)
    pixels = rng.uniform(0.0, 1.0, (image_size, image_size, 3)).astype(np.float32)
    if phase == "t2i":
        return [Sample("caption-0", [TextPart(CAPTION), GenerationRequest(*grid)], task="t2i")]
    if phase == "sft":
        parts = [TextPart(CAPTION, "user"), ImagePart(pixels=pixels, role="assistant")]
        return [Sample("sft-0", parts, answer=None, task="t2i")]
    question = "Which colour fills this image? A. red B. green C. blue D. grey. Answer A-D."
    parts = [ImagePart(pixels=pixels), TextPart(question)]
    return [Sample("mc-0", parts, answer="C", task="i2t_mc")]


def run_phase(phase: str, precision: str, args) -> dict:
    """Build, reset the high-water mark, run one update; what the parent tabulates."""
    import torch

    torch.set_num_threads(args.threads)
    from uniweave.core.host_memory import apply_mmap_threshold
    from uniweave.train.distributed.comm import DistInfo
    from uniweave.train.engine.lora import adapter_state
    from uniweave.train.engine.trainer import Trainer
    from uniweave.train.methods.grpo.job import build_grpo_job
    from uniweave.train.methods.opd.job import build_opd_job
    from uniweave.train.methods.sft.objective import SFTObjective
    from uniweave.train.methods.sft.source import DatasetSource
    from uniweave.train.onpolicy.prompts import PromptSampler
    from uniweave.train.run import _prepare_model

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = recipe_config(phase, precision, args.model, run_dir, args)
        apply_mmap_threshold(cfg.run.host_mmap_threshold)  # as `uniweave train` does
        model = _prepare_model(cfg, Path(run_dir), torch.device("cpu"))
        samples = bench_samples(phase, model.image_size[0], model.image_grid)
        prompt = model.prompt_trajectory(samples[0], add_generation_prompt=phase != "sft")
        info = DistInfo()
        if phase == "sft":
            trajs = [model.prompt_trajectory(s, add_generation_prompt=False) for s in samples]
            trajs = trajs * cfg.trainer.global_batch_size
            source = DatasetSource(trajs, cfg.trainer.global_batch_size, 0, False, 0)
            objective = SFTObjective(cfg.algorithm, model)
        else:
            build = build_grpo_job if phase in ("t2i", "i2t") else build_opd_job
            source, objective = build(cfg, model, Path(run_dir), info)
            source.prompt_sampler = PromptSampler({samples[0].task: samples}, None, 0)
        trainer = Trainer(
            model,
            source,
            objective,
            cfg,
            Path(run_dir),
            info,
            model.special_ids.pad,
            trainable_state=lambda: adapter_state(model),
        )
        setup_s = time.perf_counter() - t0
        gc.collect()
        status = rss_status()  # VmHWM so far: the setup's peak (loading included)
        before, setup_peak = status["VmRSS"], status["VmHWM"]
        reset_high_water()
        t1 = time.perf_counter()
        (_, metrics), *_ = list(trainer.fit())
        step_s = time.perf_counter() - t1
        hwm = rss_status()["VmHWM"]
        source.close()
    new = int(cfg.rollout.max_new_tokens) if phase != "sft" else 0
    return {
        "phase": phase,
        "precision": precision,
        "setup_s": setup_s,
        "step_s": step_s,
        "rollout_s": metrics.get("time/rollout_s", 0.0),
        "reward_s": metrics.get("time/reward_s", 0.0),
        "train_s": metrics.get("time/train_s", step_s),
        "rss_before": before,
        "step_peak": hwm,
        "setup_peak": setup_peak,
        "gap_max": metrics.get("mismatch/abs_dlogp_max"),
        "gap_mean": metrics.get("mismatch/abs_dlogp_mean"),
        "prompt_tokens": len(prompt),  # SFT: the whole row (caption + image)
        "new_tokens": new,
        "image_tokens": model.image_grid[0] * model.image_grid[1],
        "loss": float(metrics["loss"]),
        "params": sum(p.numel() for p in model.parameters()),
        "config": str(Path(args.model)),
        "host_mmap_threshold": cfg.run.host_mmap_threshold,
    }


# ---- the parent: children, the plan, the table --------------------------------------------


def plan_prompt(row: dict, image_tokens: int) -> int:
    """`--prompt-tokens` for the row: its measured prompt (SFT: the row less the image)."""
    return row["prompt_tokens"] - (image_tokens if row["phase"] == "sft" else 0)


def cli_plan(config: Path, prompt: int) -> tuple[int, float]:
    """`uniweave plan CONFIG --host` in a fresh process: its runtime line (bytes) and the
    starred row's peak (GiB, as printed)."""
    cmd = [sys.executable, "-m", "uniweave", "plan", str(config), "--host", "--gpu-mem", "64",
           "--prompt-tokens", str(prompt)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    runtime = float(out.split("torch, transformers) ")[1].split(" MiB")[0]) * 2**20
    starred = next(ln for ln in out.splitlines() if ln.startswith("host LoRA *"))
    return int(runtime), float(starred.split()[-2])


def planned(row: dict, model: str, runtime: int) -> tuple[int, object]:
    """The host plan's peak for the phase's config (`uniweave.plan.account`, what `uniweave plan
    --host` prints), the prompt length the child measured, `runtime` resident bytes."""
    from uniweave.plan import account, path_shapes, setup_from_config

    ns = argparse.Namespace(
        model=model, clip="unused", image_tokens=row["image_tokens"],
        i2t_tokens=row["new_tokens"] or 8, host_mmap_threshold=None,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cfg = recipe_config(row["phase"], row["precision"], model, tmp, ns)
    s = path_shapes("janus_pro", model, cfg.trainer.lora)
    st = setup_from_config(cfg, 1, 64.0, plan_prompt(row, s.image_tokens), s, host=True)
    st.runtime_bytes = runtime
    return account(s, st, "ddp", True)["peak"], st


def table(rows: list[dict], model: str) -> tuple[str, dict]:
    from uniweave.plan import GLIBC_RETENTION

    # the runtime line comes from the CLI itself (a fresh `uniweave plan --host` process), which
    # also checks that the in-process accounting below prints what the CLI prints
    r0 = rows[0]
    with tempfile.TemporaryDirectory() as tmp:
        ns = argparse.Namespace(model=model, clip="unused", image_tokens=r0["image_tokens"],
                                i2t_tokens=r0["new_tokens"] or 8, host_mmap_threshold=None)  # fmt: skip
        recipe_config(r0["phase"], r0["precision"], model, tmp, ns)
        runtime, cli_peak = cli_plan(Path(tmp) / "config.yaml", plan_prompt(r0, r0["image_tokens"]))
    own, _ = planned(r0, model, runtime)
    if abs(own / GIB - cli_peak) > 0.006:
        raise SystemExit(f"plan mismatch: CLI {cli_peak} GiB, in-process {own / GIB:.3f} GiB")
    head = (
        f"{'phase':<5} {'prec':<5} {'step s':>7} {'rollout':>8} {'train':>7} {'setup s':>8} "
        f"{'peak GiB':>9} {'plan GiB':>9} {'plan/meas':>9} {'setup GiB':>9} "
        f"{'gap max':>9} {'gap mean':>9} {'mmap thr':>9} {'in range':>8}"
    )
    lines, result = (
        [f"plan runtime line (uniweave plan --host): {runtime / 2**20:.1f} MiB", head],
        {},
    )
    for r in rows:
        plan, _ = planned(r, model, runtime)
        ratio = plan / r["step_peak"]
        # run.host_mmap_threshold of the child (rows saved before the knob: glibc's dynamic)
        value = r.get("host_mmap_threshold")
        thr = "dynamic" if value is None else f"{value / 2**20:g}MiB"
        # under glibc's dynamic threshold `plan --host` prints a range, GLIBC_RETENTION x its
        # peak, instead of a figure: does the measured peak fall inside it?
        lo, hi = GLIBC_RETENTION
        inside = "-" if value is not None else ("yes" if lo <= 1 / ratio <= hi else "NO")
        gap = (
            (f"{r['gap_max']:9.2e} {r['gap_mean']:9.2e}")
            if r["gap_max"] is not None
            else f"{'-':>9} {'-':>9}"
        )
        lines.append(
            f"{r['phase']:<5} {r['precision']:<5} {r['step_s']:7.1f} {r['rollout_s']:8.1f} "
            f"{r['train_s']:7.1f} {r['setup_s']:8.1f} {r['step_peak'] / GIB:9.2f} "
            f"{plan / GIB:9.2f} {ratio:9.3f} {r['setup_peak'] / GIB:9.2f} {gap} {thr:>9} "
            f"{inside:>8}"
        )
        key = f"{r['phase']}_{r['precision']}"
        result[f"{key}_s"] = f"{r['step_s']:.1f}"
        result[f"{key}_peak_gib"] = f"{r['step_peak'] / GIB:.2f}"
        result[f"{key}_plan_ratio"] = f"{ratio:.3f}"
        if value is None:
            result[f"{key}_in_glibc_range"] = inside
        if r["gap_max"] is not None:
            result[f"{key}_gap_max"] = f"{r['gap_max']:.3g}"
            result[f"{key}_gap_mean"] = f"{r['gap_mean']:.3g}"
    return "\n".join(lines), result


def ensure_model(args) -> None:
    if Path(args.model).is_dir():
        return
    shape = "small" if args.tiny else "full"
    cmd = [sys.executable, "-m", "uniweave", "models", "write-full-shape", "janus-pro-1b",
           args.model, "--shape", shape]  # fmt: skip
    print("writing", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=f"checkpoint dir (default {DEFAULT_MODEL})")
    parser.add_argument("--tiny", action="store_true",
                        help="`write-full-shape --shape small` (64 px, 4x4 grid) in a temp dir")  # fmt: skip
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--i2t-tokens", type=int, default=8, help="I2T/OPD max_new_tokens")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per child")
    parser.add_argument("--timeout", type=int, default=1500, help="seconds per child")
    parser.add_argument("--one-process", action="store_true",
                        help="all phases of a precision in one child (VmHWM reset per phase; "
                        "later phases start from the earlier ones' heap): for --tiny's test")  # fmt: skip
    parser.add_argument("--host-mmap-threshold", metavar="BYTES|none",
                        help="run.host_mmap_threshold of every phase (default: the config's, "
                        "null: glibc's dynamic threshold; none: the same, said explicitly)")  # fmt: skip
    parser.add_argument("--json", help="write the measured rows here")
    parser.add_argument("--table-only", help="re-plan and print the rows of a --json file")
    parser.add_argument("--child", nargs=2, metavar=("PHASE", "PRECISION"), help=argparse.SUPPRESS)
    parser.add_argument("--clip", help=argparse.SUPPRESS)
    parser.add_argument("--image-tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        phases, precision = args.child
        for phase in phases.split(","):  # --one-process: the high-water mark reset per phase
            row = run_phase(phase, precision, args)
            print("phase-json " + json.dumps(row), flush=True)
        return
    if args.table_only:
        saved = json.loads(Path(args.table_only).read_text())
        from transformers import JanusConfig

        side = int(JanusConfig.from_pretrained(saved["model"]).vq_config.num_patches)
        for row in saved["rows"]:  # rows saved before the field existed
            row.setdefault("image_tokens", side * side)
            row.setdefault("setup_peak", float("nan"))  # (rows of the first version)
        text, result = table(saved["rows"], saved["model"])
        print(text)
        print("result: " + " ".join(f"{k}={v}" for k, v in result.items()))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = str(Path(tmp) / "janus-small") if args.tiny else str(DEFAULT_MODEL)
        ensure_model(args)
        sys.path.insert(0, str(ROOT / "tests"))
        from model_fixtures import write_tiny_clip
        from transformers import JanusConfig

        clip = str(write_tiny_clip(Path(tmp) / "clip"))
        side = int(JanusConfig.from_pretrained(args.model).vq_config.num_patches)
        rows = []
        groups = [",".join(args.phases)] if args.one_process else args.phases
        for precision in args.precisions:
            for phase in groups:
                cmd = [sys.executable, __file__, "--child", phase, precision, "--model",
                       args.model, "--clip", clip, "--image-tokens", str(side * side),
                       "--i2t-tokens", str(args.i2t_tokens), "--threads", str(args.threads)]  # fmt: skip
                if args.host_mmap_threshold is not None:
                    cmd += ["--host-mmap-threshold", args.host_mmap_threshold]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                found = [ln for ln in proc.stdout.splitlines() if ln.startswith("phase-json ")]
                if proc.returncode != 0 or not found:
                    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
                    raise SystemExit(f"{phase} {precision}: child failed (rc {proc.returncode})")
                wall = time.perf_counter() - t0
                for line in found:
                    row = json.loads(line[len("phase-json ") :])
                    rows.append(row)
                    print(f"{row['phase']} {precision}: step {row['step_s']:.1f} s, peak "
                          f"{row['step_peak'] / GIB:.2f} GiB (child {wall:.1f} s wall)", flush=True)  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
        text, result = table(rows, args.model)
    print(f"checkpoint {args.model}; {rows[0]['params']:,} parameters; threads {args.threads}")
    print(text)
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
