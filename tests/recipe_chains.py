"""`make recipes-check`: every recipe, after the recipes its header names, for 2 updates.

Each recipe starts with `# needs:` lines (the recipes that must run first, with the
KEY=VALUE overrides their commands take, in order; or `nothing`) and an `# input:` line
(what it reads; `external: ...` for checkpoints and data that do not ship). For every
recipe the check copies recipes/ and examples/ (the tracked and new files, as a fresh
clone has them) into a temporary directory and, from there, runs its chain in process
with `uniweave.cli.main`: each needed command (its own needs first), then
`uniweave train RECIPE` (after an SFT run, `uniweave eval` of its model on the test split must
reproduce the run's `eval.json`: the same metric names and values), every one with the tiny overrides of `tiny_overrides` (2 updates,
batches of at most two GRPO groups, 16 digits train rows and 2 val/test rows per task). A
command shared by two chains runs once (the same directory), and a codec an earlier
step fitted with the same settings and seed is loaded (`model.codec.path`) instead of
fitted again: the fit is seeded, so it is the same codec. A recipe whose input is
external is checked with `uniweave inspect` (its config resolves and validates; nothing
runs).

    python tests/recipe_chains.py [RECIPE ...]     # exit 0 when every chain passed
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
SHIPPED = ("recipes", "examples")


@dataclass(frozen=True)
class Step:
    """One `uniweave train` command: a recipe (relative to the repository root) and overrides."""

    recipe: str
    overrides: tuple[str, ...] = ()

    def __str__(self) -> str:
        return shlex.join(["uniweave", "train", self.recipe, *self.overrides])


@dataclass(frozen=True)
class Header:
    needs: tuple[Step, ...]
    input: str

    @property
    def external(self) -> bool:
        return self.input.startswith("external")


def all_recipes() -> list[str]:
    """Every recipe file, relative to the repository root, sorted."""
    return sorted(str(p.relative_to(ROOT)) for p in RECIPES.rglob("*.yaml"))


def header(recipe: str) -> Header:
    """The `# needs:` and `# input:` lines of `recipe` (ValueError when missing)."""
    needs: list[Step] = []
    inputs: list[str] = []
    for line in (ROOT / recipe).read_text().splitlines():
        if not line.startswith("#"):
            break
        body = line[1:].strip()
        if body.startswith("needs:"):
            words = shlex.split(body[len("needs:") :])
            if words != ["nothing"]:
                needs.append(Step(words[0], tuple(words[1:])))
        elif body.startswith("input:"):
            inputs.append(body[len("input:") :].strip())
    if not inputs or (not needs and "# needs: nothing" not in (ROOT / recipe).read_text()):
        raise ValueError(f"{recipe}: the header needs '# needs:' and '# input:' lines")
    return Header(tuple(needs), inputs[0])


def placeholders(text: str) -> list[str]:
    """`KEY=<what>` of an external input line as `KEY=/external/<what>` overrides: the
    paths `uniweave inspect` needs set (it reads none of them)."""
    out = []
    for key, what in re.findall(r"([\w.]+)=<([^>]*)>", text):
        name = re.sub(r"[^\w.-]+", "_", what)
        out.append(f"{key}=/external/{name}")
    return out


def chain(recipe: str) -> list[Step]:
    """The commands that train `recipe` from a fresh clone, in order (needs first)."""
    steps: list[Step] = []
    for need in header(recipe).needs:
        for step in [*chain(need.recipe)[:-1], need]:
            if step not in steps:
                steps.append(step)
    return [*steps, Step(recipe)]


def codec_key(cfg) -> tuple | None:
    """What a codec fitted from scratch depends on (kind, head, codec settings, run.seed;
    always on the whole digits train split), or None when the run loads one."""
    m = cfg.model
    if m.kind not in ("tiny", "uniar") or m.path is not None or m.codec.path is not None:
        return None
    return (m.kind, m.visual_head, m.codec.model_dump_json(), cfg.run.seed)


def tiny_overrides(step: Step, codecs: dict[tuple, str] | None = None) -> list[str]:
    """KEY=VALUE overrides that make `step` a 2-update trial of itself. `codecs` maps a
    `codec_key` to a codec an earlier step fitted with the same settings and seed: the
    same codec, loaded through model.codec.path instead of fitted again."""
    from uniweave.config import load_config

    cfg = load_config(step.recipe, list(step.overrides))
    key = codec_key(cfg)
    out = [f"model.codec.path={codecs[key]}"] if codecs and key in codecs else []
    out += ["trainer.total_updates=2", "checkpoint.every_updates=1", "logging.every=1"]
    if cfg.trainer.scheduler.warmup_steps:
        out.append("trainer.scheduler.warmup_steps=1")
    group = getattr(cfg.algorithm, "group_size", 1)
    batch = min(cfg.trainer.global_batch_size, max(2 * group, 4))
    out += [f"trainer.global_batch_size={batch}", f"trainer.micro_batch_size={batch}"]
    if cfg.trainer.micro_token_budget:
        out.append("trainer.micro_token_budget=null")
    if cfg.data.path is None and cfg.model.kind != "janus_pro":
        out.append("data.train_size=16")  # digits rows per task (an SFT run serialises them all)
    for split in ("val", "test"):
        if getattr(cfg.data, f"{split}_size"):
            out.append(f"data.{split}_size=2")
    if cfg.trainer.eval_every:
        out.append("trainer.eval_every=1")
    return out


def copy_shipped(dest: Path) -> None:
    """recipes/ and examples/ as a fresh clone holds them (tracked and new, not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *SHIPPED],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for rel in listed:
        if (ROOT / rel).is_symlink() and (ROOT / rel).is_dir():
            # recipes/ and examples/<data>/ link into the package's assets: their files
            shutil.copytree(ROOT / rel, dest / rel)
        elif (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """`uniweave ARGV` in this process; (exit code, its stdout and stderr)."""
    from uniweave.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        code = main(argv)
    return code, buffer.getvalue()


def recheck_eval(step: Step, extra: list[str], run_dir: Path) -> str | None:
    """`uniweave eval` of an SFT step's model on its test split with the step's own config
    and overrides: None when its per-task summary has exactly the metric names and
    values of the run's end-of-run `eval.json` (one evaluator, issue 30), else what
    differs."""
    results_path = run_dir / "eval.json"
    if not results_path.is_file():
        return "the run wrote no eval.json"
    out = run_dir / "recheck-eval"
    # what a user types: the step's recipe and overrides, plus the model it trained (its
    # sizes and codec are the recipe's, so they are accepted next to model.path)
    argv = ["eval", step.recipe, *step.overrides, *extra, f"model.path={run_dir / 'model'}"]
    argv += ["evaluation.split=test", f"evaluation.output_dir={out}"]
    code, text = run_cli(argv)
    if code:
        return f"exit {code}: {text.strip()[-300:]}"
    summary = json.loads((out / "summary.json").read_text())
    flat = {f"{t}/{k}": v for t, stats in summary["tasks"].items() for k, v in stats.items()}
    results = json.loads(results_path.read_text())
    if flat != results:
        keys = sorted(set(flat) ^ set(results)) or sorted(k for k in flat if flat[k] != results[k])
        return f"differs from eval.json at {', '.join(keys[:5])}"
    return None


def check(recipes: list[str], work: Path, log=print) -> list[str]:
    """Run every chain of `recipes` in `work`; the failures (one line each)."""
    from uniweave.config import ConfigError, load_config

    copy_shipped(work)
    done: set[Step] = set()
    codecs: dict[tuple, str] = {}
    failures: list[str] = []
    cwd = Path.cwd()
    os.chdir(work)
    try:
        for recipe in recipes:
            head = header(recipe)
            if head.external:
                code, text = run_cli(["inspect", recipe, *placeholders(head.input)])
                log(f"{'ok ' if code == 0 else 'FAIL'} uniweave inspect {recipe}  ({head.input})")
                if code:
                    failures.append(
                        f"uniweave inspect {recipe}: exit {code}: {text.strip()[-300:]}"
                    )
                continue
            for step in chain(recipe):
                if step in done:
                    continue
                start = time.perf_counter()
                try:
                    extra = tiny_overrides(step, codecs)
                    argv = ["train", step.recipe, *step.overrides, *extra]
                except ConfigError as exc:
                    code, text = 2, f"the step's own config: {exc}"
                else:
                    code, text = run_cli(argv)
                seconds = time.perf_counter() - start
                log(f"{'ok ' if code == 0 else 'FAIL'} {step}  ({seconds:.1f} s)")
                if code:
                    failures.append(f"{step}: exit {code}: {text.strip()[-300:]}")
                    break
                done.add(step)
                cfg = load_config(step.recipe, list(step.overrides))
                if cfg.algorithm.name == "sft":
                    problem = recheck_eval(step, extra, work / cfg.run.output_dir)
                    log(f"{'ok ' if problem is None else 'FAIL'} uniweave eval {step.recipe}")
                    if problem is not None:
                        failures.append(f"uniweave eval {step.recipe}: {problem}")
                        break
                key, own = codec_key(cfg), work / cfg.run.output_dir / "codec"
                if key in codecs and not own.exists():
                    # a run that fits its codec saves it there (a later step may read it)
                    shutil.copytree(codecs[key], own)
                if key is not None and own.is_dir():
                    codecs.setdefault(key, str(own))
    finally:
        os.chdir(cwd)
    return failures


def main(argv: list[str]) -> int:
    recipes = argv or all_recipes()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="recipes-check-") as tmp:
        failures = check(recipes, Path(tmp))
    print(f"{len(recipes)} recipes, {len(failures)} failed, {time.perf_counter() - start:.0f} s")
    for line in failures:
        print("FAILED", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
