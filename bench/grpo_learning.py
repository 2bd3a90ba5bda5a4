"""Does a GRPO recipe learn? Held-out evaluation before and after, and the drift-to-noise
ratio of its per-update task reward (docs/numerics.md §12), in one process.

    .venv/bin/python bench/grpo_learning.py recipes/digits/grpo_i2t.yaml [key=value ...]

Steps: evaluate the recipe's starting model (`model.path`) on the test split (the same
`data.test_size` prompts and seed the run's final evaluation uses), train the recipe in
this process (timed; a fresh run directory: an existing one is refused unless --fresh
deletes it), then fit the least-squares line to the per-update metric (default
`reward/total_mean`, the task reward on the training prompts) and print first-10 /
last-10 means, drift, noise, their ratio (baseline: a claim needs >= 3), the held-out
metrics before -> after and the wall time. The numbers are also written to
<run dir>/learning.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from uniweave.config import load_config
from uniweave.eval.drift import drift_to_noise
from uniweave.models.build import build_model
from uniweave.train.engine.metrics import read_metrics
from uniweave.train.run import evaluate_split, run_train

HELD_OUT = ("accuracy", "score", "exact_match")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--metric", default="reward/total_mean")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--fresh", action="store_true", help="delete an existing run dir")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.recipe, args.overrides)
    run_dir = Path(cfg.run.output_dir)
    if run_dir.exists():
        if not args.fresh:
            print(f"{run_dir} exists; pass --fresh to replace it", file=sys.stderr)
            return 2
        shutil.rmtree(run_dir)
    n = cfg.data.test_size
    run_dir.mkdir(parents=True)
    before = evaluate_split(cfg, build_model(cfg).eval(), run_dir, "test", 0)  # update 0
    t0 = time.perf_counter()
    run_train(cfg)
    wall = time.perf_counter() - t0
    after = json.loads((run_dir / "eval.json").read_text())
    curve = [r[args.metric] for r in read_metrics(run_dir / "metrics.jsonl")]
    fit = drift_to_noise(curve, args.window)
    held = {k: (before[k], after[k]) for k in sorted(before) if k.endswith(HELD_OUT)}
    result = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "metric": args.metric,
        **fit.as_dict(),
        "held_out_before_after": held,
        "wall_seconds": wall,
        "torch_threads": torch.get_num_threads(),
    }
    (run_dir / "learning.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.recipe} {' '.join(args.overrides)}")
    print(
        f"{args.metric}: first-{args.window} {fit.first_mean:.4f}  last-{args.window} "
        f"{fit.last_mean:.4f}  drift {fit.drift:+.4f}  noise {fit.noise:.4f}  "
        f"drift/noise {fit.ratio:.2f} (baseline: >= 3)  over {fit.n} updates"
    )
    for key, (b, a) in held.items():
        print(f"held-out test {key}: {b:.4f} -> {a:.4f}  (n={n})")
    print(f"wall {wall:.1f} s for training + final evaluation, {torch.get_num_threads()} threads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
