"""The untrained baseline of an SFT recipe: its seed-initialised model evaluated exactly
as the run's final evaluation is (same tasks, split, prompt count, seed and classifier).

    .venv/bin/python bench/baseline_eval.py recipes/digits/sft_vq.yaml [key=value ...]

Prints one line per metric, "random-init" next to the trained run's figure when the run
directory (`run.output_dir`) holds an eval.json, so a claim of learning is read against
the model the run started from, not against a nominal chance rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from uniweave.config import load_config
from uniweave.eval.runner import evaluate, split_config, task_metrics
from uniweave.models.build import build_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--split", default="test", choices=["val", "test"])
    args = parser.parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    if cfg.model.path:
        print(f"{args.recipe}: model.path is set; the baseline is a fresh model", file=sys.stderr)
        return 2
    n = cfg.data.test_size if args.split == "test" else cfg.data.val_size
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(cfg, Path(tmp) / "codec").eval()
        summary = evaluate(
            split_config(cfg, args.split),
            model,
            Path(tmp) / "eval",
            per_task=n,
            classifier_dir=Path(tmp) / "classifier",
        )
        base = task_metrics(summary)
    trained_path = Path(cfg.run.output_dir) / "eval.json"
    trained = json.loads(trained_path.read_text()) if trained_path.is_file() else {}
    print(f"{args.recipe} {' '.join(args.overrides)}  ({args.split}, n={n} per task)")
    for key in sorted(base):
        after = f"  trained {trained[key]:.4f}" if key in trained else ""
        print(f"{key}: random-init {base[key]:.4f}{after}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
