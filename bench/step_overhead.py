"""What the host allocator setting (`run.host_mmap_threshold`) costs a small run: the tiny
SFT (and GRPO) recipe trained for a few updates under the config's default and under
glibc's own behaviour, alternating, one `uniweave train` child per run, all children of
this process.

Each child is the same command a user types (`uniweave train RECIPE`), with evaluation and
checkpoints off so that the updates dominate; the variants differ only in the allocator:

- `default`: the config's default `run.host_mmap_threshold` (no override);
- `glibc`: `run.host_mmap_threshold=null`, glibc's dynamic mmap threshold (the baseline);
- `fixed_1mib`: `run.host_mmap_threshold=1048576` (predictable host memory; the default
  of the previous milestone);
- `trim`: glibc's dynamic threshold plus `malloc_trim(0)` after every update (gives the
  retained heap back between steps; it cannot lower a step's own peak);
- `trim_threshold` / `top_pad`: glibc's dynamic threshold tuned by the environment
  (`MALLOC_TRIM_THRESHOLD_` = 64 MiB / `MALLOC_TOP_PAD_` = 64 MiB). Setting either one
  also stops glibc's dynamic adjustment, which leaves the mmap threshold at 128 KiB.

Per child: wall seconds, user and system CPU seconds and the peak resident set
(`os.wait4`'s rusage of that child alone). Per variant: the median and the minimum over
--pairs runs, measured in this process tree in interleaved order (so a slow period of
the machine hits every variant). The result ratio is the minimum wall of a variant over
the minimum wall of `glibc`: the run the machine disturbed least estimates what the
setting itself costs (another process's work only ever adds time), where a median of a
few runs moves by several percent with the machine's load; the table prints both.

    .venv/bin/python bench/step_overhead.py                      # SFT, default vs glibc
    .venv/bin/python bench/step_overhead.py --recipes sft grpo --variants default glibc fixed_1mib trim

Ends with one `result:` line: `sft_default_vs_glibc=R` (and `grpo_default_vs_glibc=R`,
`<recipe>_<variant>_vs_glibc=R` for the other variants).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "sft": ROOT / "recipes" / "digits" / "sft_vq.yaml",
    "grpo": ROOT / "recipes" / "examples" / "grpo_tiny.yaml",  # from the seed: needs no run
}
# evaluation and checkpoints off: the updates are what the allocator setting touches
QUIET = [
    "trainer.eval_every=0",
    "checkpoint.every_updates=0",
    "health.baseline_eval=false",
    "data.val_size=0",
    "data.test_size=0",
]
MiB = 1024 * 1024
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "default": ([], {}),
    "glibc": (["run.host_mmap_threshold=null"], {}),
    "fixed_1mib": ([f"run.host_mmap_threshold={MiB}"], {}),
    "trim": (["run.host_mmap_threshold=null"], {"BENCH_TRIM_EVERY_UPDATE": "1"}),
    "trim_threshold": (["run.host_mmap_threshold=null"], {"MALLOC_TRIM_THRESHOLD_": str(64 * MiB)}),
    "top_pad": (["run.host_mmap_threshold=null"], {"MALLOC_TOP_PAD_": str(64 * MiB)}),
}

# The child: `uniweave train ARGV`, with malloc_trim(0) after every update when asked. The
# trim is wrapped around the trainer's own update (Trainer.step) so that it runs where a
# built-in step-boundary trim would.
CHILD = """
import ctypes, os, sys
if os.environ.get("BENCH_TRIM_EVERY_UPDATE"):
    from uniweave.train.engine import trainer as _t
    _libc = ctypes.CDLL(None)
    _step = _t.Trainer.step
    def step(self):
        out = _step(self)
        _libc.malloc_trim(0)
        return out
    _t.Trainer.step = step
from uniweave.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


def run_child(recipe: Path, updates: int, variant: str, out: Path) -> dict[str, float]:
    overrides, env_extra = VARIANTS[variant]
    argv = [
        str(recipe),
        f"trainer.total_updates={updates}",
        *QUIET,
        f"run.output_dir={out}",
        *overrides,
    ]
    env = {**os.environ, **env_extra}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    text = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"step_overhead: {variant} child failed (exit {proc.returncode}):\n{text[-2000:]}")
    return {
        "wall": wall,
        "user": usage.ru_utime,
        "sys": usage.ru_stime,
        "peak_mib": usage.ru_maxrss / 1024,  # Linux: KiB
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=["sft"])
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=["default", "glibc"]
    )
    parser.add_argument("--updates", type=int, default=60, help="updates per child (default 60)")
    parser.add_argument("--pairs", type=int, default=5, help="runs of each variant (default 5)")
    args = parser.parse_args(argv)
    variants = list(dict.fromkeys(["glibc", *args.variants]))  # the baseline always runs
    results: list[str] = []
    with tempfile.TemporaryDirectory(prefix="step_overhead_") as tmp:
        for recipe in args.recipes:
            runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
            for i in range(args.pairs):
                # interleaved, the order rotated each round: no variant always goes first
                order = variants[i % len(variants) :] + variants[: i % len(variants)]
                for v in order:
                    r = run_child(RECIPES[recipe], args.updates, v, Path(tmp) / f"{recipe}_{v}_{i}")
                    runs[v].append(r)
                    print(f"{recipe} {v:15s} run {i}: wall {r['wall']:6.2f} s  user {r['user']:6.2f} s"
                          f"  sys {r['sys']:6.2f} s  peak {r['peak_mib']:7.1f} MiB", flush=True)  # fmt: skip
            base_min = min(r["wall"] for r in runs["glibc"])
            base_med = statistics.median(r["wall"] for r in runs["glibc"])
            print(f"\n{recipe}: {args.updates} updates, {args.pairs} runs each, medians but "
                  f"for the min wall ({RECIPES[recipe].relative_to(ROOT)})")  # fmt: skip
            print("| variant | min wall s | wall s | user s | sys s | peak MiB | min wall / glibc "
                  "| median wall / glibc |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|")
            for v in variants:
                med = {k: statistics.median(r[k] for r in runs[v]) for k in runs[v][0]}
                fastest = min(r["wall"] for r in runs[v])
                ratio = fastest / base_min
                print(f"| {v} | {fastest:.2f} | {med['wall']:.2f} | {med['user']:.2f} | "
                      f"{med['sys']:.2f} | {med['peak_mib']:.0f} | {ratio:.3f} | "
                      f"{med['wall'] / base_med:.3f} |")  # fmt: skip
                if v != "glibc":
                    results.append(f"{recipe}_{v}_vs_glibc={ratio:.3f}")
            print()
    print("result: " + " ".join(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
