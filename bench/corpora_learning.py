"""Do converted corpora train? The two learning checks of issue 50, end to end on a CPU.

Both arms go through the commands a user runs (`uniweave data convert`, `uniweave data
jigsaw`, `uniweave train`), on the embedded tiny model, and read the verdicts of each
run's own report (`report.json`: the held-out test split at update 0 and at the end, the
same rows with the same seeds, paired per prompt, diff ± SE; `uniweave.eval.paired`).

- `zebra`: a Zebra-CoT-shaped parquet file per split written from scikit-learn's digits
  (the question shows a digit d inline, `<image_start>[problem_image_1]<image_end>`; the
  trace is `THOUGHT 1:` text and the reasoning image `reasoning_image_1`, a scan of the
  digit after d from the same split; the final answer is that digit), converted with
  `--answer-format {answer}` so the answer is the text after the drawn image. SFT from
  the seed-initialised model; the reward is `exact_answer` with `require_image_class`
  (the stated digit is right and the digits classifier reads the drawn image as it):
  the draw-then-answer metric.
- `jigsaw`: every digits scan written as a PNG into one folder, `uniweave data jigsaw
  --grid 2` (its own image-level train/val/test split), a short SFT to teach the answer
  format, then GRPO from that checkpoint with the `visual_jigsaw` reward; the GRPO run's
  held-out accuracy (pass@1: exact order) at its update 0 (the SFT model) and at its end,
  and the training reward's drift/noise.

Usage: python bench/corpora_learning.py OUT [zebra] [jigsaw]
       [--sft-updates N] [--jigsaw-sft-updates N] [--grpo-updates N] [--grpo-batch N]
Prints one table per arm (held-out verdicts, the training curves' drift/noise) and
writes OUT/corpora_learning.json (an arm run later keeps the other arms' entries).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from PIL import Image

from uniweave.data.digits_images import load_split

QUESTION = (
    "<image_start>[problem_image_1]<image_end>\n"
    "Draw the digit that comes after this one (9 is followed by 0), then state it."
)
TRACE = "THOUGHT 1: The next digit is drawn below.\n<image_start>[reasoning_image_1]<image_end>"
TINY = {
    "kind": "tiny",
    "visual_head": "vq",
    "tiny": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 512},
    "codec": {"patch_size": 2, "codebook_size": 64},
}


def png(image: np.ndarray) -> bytes:
    """An 8x8 scan in [0, 1] as 8-bit greyscale PNG bytes (round(255 p))."""
    buf = io.BytesIO()
    Image.fromarray(np.rint(image * 255).astype(np.uint8), mode="L").save(buf, format="PNG")
    return buf.getvalue()


def zebra_parquet(path: Path, split: str, seed: int) -> int:
    """Write the Zebra-CoT-shaped rows of one digits split; returns their number."""
    data = load_split(split)
    rng = np.random.default_rng(seed)
    by_digit = {d: np.flatnonzero(data.labels == d) for d in range(10)}
    cols: dict[str, list] = {
        k: []
        for k in (
            "Question",
            "Text Reasoning Trace",
            "Final Answer",
            "problem_image_1",
            "reasoning_image_1",
        )
    }
    for k in range(len(data)):
        nxt = (int(data.labels[k]) + 1) % 10
        j = int(rng.choice(by_digit[nxt]))
        cols["Question"].append(QUESTION)
        cols["Text Reasoning Trace"].append(TRACE)
        cols["Final Answer"].append(str(nxt))
        cols["problem_image_1"].append({"bytes": png(data.images[k]), "path": f"q{k}.png"})
        cols["reasoning_image_1"].append({"bytes": png(data.images[j]), "path": f"r{k}.png"})
    pq.write_table(pa.table(cols), path, row_group_size=256)
    return len(data)


def digits_folder(folder: Path) -> int:
    """Every digits scan (all splits) as OUT/NNNN.png; the jigsaw command splits them."""
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for split in ("train", "val", "test"):
        data = load_split(split)
        for k in range(len(data)):
            (folder / f"{int(data.indices[k]):04d}.png").write_bytes(png(data.images[k]))
            n += 1
    return n


def uniweave(*args: str) -> None:
    cmd = [sys.executable, "-m", "uniweave", *args]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)


def train(config: dict, path: Path) -> dict:
    """`uniweave train` on `config` (written to `path`); the run's report.json."""
    run = Path(config["run"]["output_dir"])
    if (run / "DONE").exists():  # an earlier invocation finished it: its figures stand
        print(f"{run}: done earlier; its report.json is read as it is", flush=True)
        return json.loads((run / "report.json").read_text()) | {"wall_s": float("nan")}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    t0 = time.perf_counter()
    uniweave("train", str(path))
    wall = time.perf_counter() - t0
    report = json.loads((run / "report.json").read_text())
    report["wall_s"] = wall
    return report


def verdicts(report: dict, metric: str) -> list[dict]:
    return [v for v in report["verdicts"] if v["metric"] == metric and v["task"] != "all"]


def zebra(out: Path, updates: int) -> dict:
    src = out / "zebra_src"
    src.mkdir(parents=True, exist_ok=True)
    counts = {
        s: zebra_parquet(src / f"{s}.parquet", s, seed=i) for i, s in enumerate(("train", "test"))
    }
    for split in ("train", "test"):
        dst = out / f"zebra_{split}"
        if not (dst / "convert" / "summary.json").exists():
            uniweave(
                "data", "convert", "--from", "zebra-cot", "--answer-format", "{answer}",
                str(src / f"{split}.parquet"), str(dst),
            )  # fmt: skip
    config = {
        "run": {"name": "zebra_digits_sft", "seed": 0, "output_dir": str(out / "zebra_sft")},
        "model": TINY,
        "data": {
            "path": str(out / "zebra_train"),
            "test_path": str(out / "zebra_test"),
            "tasks": ["zebra_cot"],
            "image_resize": "error",
            "val_size": 0,
            "test_size": 1000,  # every test row (269)
        },
        "reward": {
            "plugins": [
                {
                    "name": "exact_answer",
                    "tasks": ["zebra_cot"],
                    "kwargs": {"require_image_class": True},
                }
            ]
        },
        "algorithm": {"name": "sft"},
        "trainer": {
            "optimizer": {"lr": 2.0e-3, "weight_decay": 0.01},
            "scheduler": {"name": "warmup_constant", "warmup_steps": min(20, updates)},
            "total_updates": updates,
            "global_batch_size": 32,
            "micro_batch_size": 32,
            "grad_clip": 1.0,
            "packing": True,
        },
        "checkpoint": {"every_updates": updates, "keep_last": 1},
        "evaluation": {"split": "test"},
    }
    report = train(config, out / "zebra_sft.yaml")
    return {"rows": counts, "report": report}


def jigsaw(out: Path, sft_updates: int, grpo_updates: int, grpo_batch: int) -> dict:
    images = out / "digits_png"
    n_images = digits_folder(images)
    data = out / "jigsaw"
    if not (data / "jigsaw.jsonl").exists():
        uniweave("data", "jigsaw", str(images), str(data), "--grid", "2", "--seed", "0",
                 "--val-fraction", "0", "--test-fraction", "0.15")  # fmt: skip
    rows = data / "jigsaw.jsonl"
    sft_dir = out / f"jigsaw_sft_u{sft_updates}"
    common = {
        "model": TINY,
        "data": {
            "path": str(rows),
            "tasks": ["visual_jigsaw"],
            "image_resize": "error",
            "val_size": 0,
            "test_size": 1000,  # every test row
        },
        "reward": {"plugins": [{"name": "visual_jigsaw", "tasks": ["visual_jigsaw"]}]},
        "evaluation": {"split": "test"},
        "rollout": {"max_new_tokens": 16},
    }
    sft = {
        **common,
        "run": {"name": "jigsaw_sft", "seed": 0, "output_dir": str(sft_dir)},
        "algorithm": {"name": "sft"},
        "trainer": {
            "optimizer": {"lr": 2.0e-3, "weight_decay": 0.01},
            "scheduler": {"name": "warmup_constant", "warmup_steps": min(20, sft_updates)},
            "total_updates": sft_updates,
            "global_batch_size": 32,
            "micro_batch_size": 32,
            "grad_clip": 1.0,
            "packing": True,
        },
        "checkpoint": {"every_updates": sft_updates, "keep_last": 1},
    }
    sft_report = train(sft, out / "jigsaw_sft.yaml")
    grpo = {
        **common,
        "run": {
            "name": "jigsaw_grpo",
            "seed": 0,
            "output_dir": str(out / f"jigsaw_grpo_s{sft_updates}_u{grpo_updates}_b{grpo_batch}"),
        },
        "model": {**TINY, "path": str(sft_dir / "model")},
        "rollout": {"max_new_tokens": 16, "temperature": 1.0, "batch_size": 128},
        "algorithm": {
            "name": "grpo",
            "group_size": 8,
            "clip_low": 0.2,
            "clip_high": 0.28,
            "kl": {"type": "k3", "coef": 0.01},
        },
        "trainer": {
            "optimizer": {"lr": 3.0e-4, "weight_decay": 0.0},
            "scheduler": {"name": "constant"},
            "total_updates": grpo_updates,
            "global_batch_size": grpo_batch,  # grpo_batch / 8 prompts per update
            "micro_batch_size": 128,
            "grad_clip": 1.0,
        },
        "checkpoint": {"every_updates": grpo_updates, "keep_last": 1},
    }
    grpo_report = train(grpo, out / "jigsaw_grpo.yaml")
    return {"images": n_images, "sft": sft_report, "grpo": grpo_report}


def table(title: str, report: dict, metric: str) -> None:
    print(f"\n{title} (wall {report['wall_s']:.0f} s)")
    for v in verdicts(report, metric):
        print(
            f"  {v['split']} {v['task']} {metric}: {v['before']:.3f} -> {v['after']:.3f}"
            f"  diff {v['diff']:+.3f} ± {v['se']:.3f} (n={v['n']}): {v['verdict']}"
        )
    for key in ("loss", "reward/total_mean"):
        fit = report["curves"].get(key)
        if fit:
            print(
                f"  training {key}: {fit['first_mean']:.3f} -> {fit['last_mean']:.3f}, "
                f"drift/noise {fit['ratio']:+.2f} over {fit['n']} updates"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("arms", nargs="*", default=["zebra", "jigsaw"], choices=["zebra", "jigsaw"])
    p.add_argument("--sft-updates", type=int, default=400)
    p.add_argument("--jigsaw-sft-updates", type=int, default=300)
    p.add_argument("--grpo-updates", type=int, default=60)
    p.add_argument("--grpo-batch", type=int, default=128, help="rows per GRPO update (G = 8)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    where = args.out / "corpora_learning.json"
    results: dict = json.loads(where.read_text()) if where.exists() else {}  # other arms kept
    if "zebra" in args.arms:
        results["zebra"] = zebra(args.out, args.sft_updates)
        table("zebra-cot-shaped digits, SFT", results["zebra"]["report"], "pass@n")
    if "jigsaw" in args.arms:
        results["jigsaw"] = jigsaw(
            args.out, args.jigsaw_sft_updates, args.grpo_updates, args.grpo_batch
        )
        table("visual jigsaw, SFT", results["jigsaw"]["sft"], "pass@n")
        table("visual jigsaw, GRPO from the SFT model", results["jigsaw"]["grpo"], "pass@n")
    where.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
