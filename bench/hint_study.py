"""Tabulate the hint study (README "Does the model look at the image?").

Each run directory `ROOT/hint_<arm>_s<seed>` holds a training run of
`recipes/digits/hint/<arm>.yaml` (its `eval.json`: the i2t_hint test split, hint right 70%
of the time) and `eval_wrong/`, a `uniweave eval` of the same model on `i2t_hint_wrong`
(the hint always names a wrong digit):

    uniweave train recipes/digits/hint/sft.yaml run.seed=0 run.output_dir=ROOT/hint_sft_s0
    uniweave eval recipes/digits/hint/sft.yaml model.path=ROOT/hint_sft_s0/model \\
        data.tasks=[i2t_hint_wrong] evaluation.output_dir=ROOT/hint_sft_s0/eval_wrong

Prints per arm the mean ± standard error over seeds of the i2t_hint accuracy, the
hint-wrong accuracy and the share of hint-wrong answers that copy the hint, then each arm's
hint-wrong accuracy minus plain SFT's, paired by seed (`sft_u60` is the baseline of arms
ending in `_u60`). Usage: python bench/hint_study.py ROOT
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

HINT = re.compile(r"The digit is (\d)\.")
RUN = re.compile(r"hint_(.+)_s(\d+)$")


def mean_se(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.3f} (1 seed)"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) / len(xs) ** 0.5:.3f}"


def one_run(run: Path) -> tuple[float, float, float]:
    """(i2t_hint accuracy, hint-wrong accuracy, hint-wrong copy share) of one run."""
    acc = json.loads((run / "eval.json").read_text())["i2t_hint/accuracy"]
    lines = (run / "eval_wrong" / "results.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines if line.strip()]
    if not recs:
        raise SystemExit(f"{run}/eval_wrong/results.jsonl: no records")
    right = copied = 0
    for r in recs:
        hint = HINT.search(r["prompt"])
        if hint is None:
            raise SystemExit(f"{run}: record {r['id']} has no hint in its prompt")
        answer = r["response"].strip()
        right += answer == r["answer"]
        copied += answer == hint.group(1)
    logged = json.loads((run / "eval_wrong" / "summary.json").read_text())["all"]["mean@n"]
    if abs(logged - right / len(recs)) > 1e-9:
        raise SystemExit(f"{run}: recount {right / len(recs)} != logged mean@n {logged}")
    return acc, right / len(recs), copied / len(recs)


def main(root: Path) -> None:
    arms: dict[str, dict[str, tuple[float, float, float]]] = {}
    for run in sorted(p for p in root.iterdir() if p.is_dir() and RUN.search(p.name)):
        arm, seed = RUN.search(run.name).groups()  # type: ignore[union-attr]
        arms.setdefault(arm, {})[seed] = one_run(run)
    if not arms:
        raise SystemExit(f"{root}: no hint_<arm>_s<seed> run directories")
    print("| arm | seeds | i2t_hint acc | hint-wrong acc | hint-wrong: copies the hint |")
    print("|---|---|---|---|---|")
    for arm, runs in arms.items():
        cols = [mean_se([v[k] for v in runs.values()]) for k in range(3)]
        print(f"| {arm} | {len(runs)} | {' | '.join(cols)} |")
    print()
    for arm, runs in arms.items():
        base = "sft_u60" if arm.endswith("_u60") else "sft"
        if arm == base or base not in arms:
            continue
        diffs = [v[1] - arms[base][s][1] for s, v in runs.items() if s in arms[base]]
        print(f"{arm} - {base}, hint-wrong acc paired by seed: {mean_se(diffs)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/hint_study.py ROOT")
    main(Path(sys.argv[1]))
