"""Does GRPO with the `geneval` reward raise the digits world's held-out GenEval score?

    .venv/bin/python bench/world_learning.py --sft-updates 300 --grpo-updates 60 --threads 1

Steps, in one process: SFT (recipes/digits/world/sft.yaml) for --sft-updates, then GRPO
(recipes/digits/world/grpo.yaml) from that model for --grpo-updates, each into a fresh
directory under --out. The GRPO run evaluates its starting model on the test prompts
(update 0) and its final model with the same rows and stateless seeds (common random
numbers), `--images` images per prompt; both are scored by the `geneval` reward with the
digits detector. Then:

- per prompt i, d_i = its mean reward (share of its images GenEval judges correct) after
  minus before; per tag t, diff_t = mean of d_i over t's prompts, se_t = std(d, ddof=1) /
  sqrt(n_t); overall (GenEval's figure: the mean of the six tag accuracies)
  diff = mean_t diff_t, se = sqrt(sum_t se_t^2) / 6;
- drift/noise of the GRPO run's per-update training reward (`reward/total_mean`;
  `uniweave.eval.drift`, baseline >= 3);
- wall and process CPU seconds (user + system) of each run.

Everything is printed and written to <out>/world_learning.json.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from uniweave.config import load_config
from uniweave.config.packaged import assets_root
from uniweave.eval.drift import drift_to_noise
from uniweave.eval.paired import read_records
from uniweave.train.engine.metrics import read_metrics
from uniweave.train.run import run_train

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_run(recipe: str, overrides: list[str]) -> tuple[Path, float, float]:
    cfg = load_config(recipe, overrides)
    run_dir = Path(cfg.run.output_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    wall, cpu = time.perf_counter(), cpu_seconds()
    run_train(cfg)
    return run_dir, time.perf_counter() - wall, cpu_seconds() - cpu


def prompt_tags() -> dict[str, str]:
    rows = assets_root() / "examples" / "digits_world" / "world.jsonl"
    out = {}
    for line in rows.read_text().splitlines():
        row = json.loads(line)
        out[row["id"]] = row["meta"]["geneval"]["tag"]
    return out


def per_prompt(eval_dir: Path) -> dict[str, float]:
    scores: dict[str, list[float]] = defaultdict(list)
    for record in read_records(eval_dir):
        scores[record["id"]].append(float(record["total"]))
    return {k: sum(v) / len(v) for k, v in scores.items()}


def overall(values: dict[str, float], tags: dict[str, str]) -> tuple[float, dict[str, float]]:
    by_tag: dict[str, list[float]] = defaultdict(list)
    for pid, value in values.items():
        by_tag[tags[pid]].append(value)
    per_tag = {t: sum(by_tag[t]) / len(by_tag[t]) for t in TAGS if by_tag[t]}
    return sum(per_tag.values()) / len(per_tag), per_tag


def paired_overall(before: dict[str, float], after: dict[str, float], tags: dict[str, str]):
    d: dict[str, list[float]] = defaultdict(list)
    for pid in sorted(set(before) & set(after)):
        d[tags[pid]].append(after[pid] - before[pid])
    diffs, ses = {}, {}
    for t in TAGS:
        x = d[t]
        diffs[t] = sum(x) / len(x)
        var = sum((v - diffs[t]) ** 2 for v in x) / (len(x) - 1) if len(x) > 1 else 0.0
        ses[t] = math.sqrt(var / len(x))
    diff = sum(diffs.values()) / len(TAGS)
    se = math.sqrt(sum(s * s for s in ses.values())) / len(TAGS)
    return diff, se, diffs, ses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-updates", type=int, default=300)
    parser.add_argument("--grpo-updates", type=int, default=60)
    parser.add_argument("--images", type=int, default=4, help="images per test prompt")
    parser.add_argument("--out", default="runs/world_learning")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--sft", nargs="*", default=[], help="extra SFT overrides")
    parser.add_argument(
        "--sft-dir", default=None, help="start GRPO from this finished SFT run (no SFT here)"
    )
    parser.add_argument("--grpo", nargs="*", default=[], help="extra GRPO overrides")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    ev = [f"evaluation.rollouts_per_sample={args.images}", "evaluation.greedy=false"]
    if args.sft_dir is None:
        sft_dir, sft_wall, sft_cpu = timed_run(
            "digits/world/sft",
            [f"run.output_dir={out}/sft", f"trainer.total_updates={args.sft_updates}"]
            + ["checkpoint.every_updates=0", *args.sft],
        )
    else:
        sft_dir, sft_wall, sft_cpu = Path(args.sft_dir), float("nan"), float("nan")
    grpo_dir, grpo_wall, grpo_cpu = timed_run(
        "digits/world/grpo",
        [f"run.output_dir={out}/grpo", f"model.path={sft_dir}/model"]
        + [f"trainer.total_updates={args.grpo_updates}", "checkpoint.every_updates=0"]
        + ["logging.every=1", *ev, *args.grpo],
    )
    tags = prompt_tags()
    evals = sorted((grpo_dir / "evals").glob("test-update-*"))
    before, after = per_prompt(evals[0]), per_prompt(evals[-1])
    ob, tb = overall(before, tags)
    oa, ta = overall(after, tags)
    diff, se, diffs, ses = paired_overall(before, after, tags)
    curve = [r["reward/total_mean"] for r in read_metrics(grpo_dir / "metrics.jsonl")]
    fit = drift_to_noise(curve, args.window)
    result = {
        "args": vars(args),
        "held_out_overall": {"before": ob, "after": oa, "diff": diff, "se": se},
        "held_out_tags_before": tb,
        "held_out_tags_after": ta,
        "tag_diffs": diffs,
        "tag_ses": ses,
        "n_prompts": len(set(before) & set(after)),
        "eval_dirs": [str(evals[0]), str(evals[-1])],
        "train_reward": fit.as_dict(),
        "sft": {"wall_s": sft_wall, "cpu_s": sft_cpu},
        "grpo": {"wall_s": grpo_wall, "cpu_s": grpo_cpu},
        "torch_threads": torch.get_num_threads(),
    }
    (out / "world_learning.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
