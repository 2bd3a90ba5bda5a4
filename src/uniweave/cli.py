"""The `uniweave` command line: a dispatch table of subcommands.

Each subcommand is a `Command`: a name, a one-line help, a function that adds its arguments
to its own parser, and a function `run(args) -> exit code`. To add one, write those two
functions and append a `Command` to `COMMANDS`. Keep `uniweave --help` and `uniweave inspect`
light: a `run` imports its implementation inside the function, and a `configure` imports
only light modules (tests/test_cli.py checks that they load no model package and no torch).

Exit codes (docs/cli.md): 0 success; 2 usage or input errors (argparse, `ConfigError`: a
bad config, a bad file it names, a refused resume; `DatasetError`: a dataset file or row,
named with the config key that pointed at it); 1 any other failure; 130 interrupted
(`train` names the last checkpoint it saved). Errors print one line `uniweave: error: ...` on
stderr naming the file or `<command line>` that set the culprit; `--debug` adds the
traceback. `train`, `eval`, `probe` and `generate` check what they read before writing
anything (`uniweave.train.preflight`).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from uniweave import __version__
from uniweave.config import (
    COMMAND_LINE,
    ConfigError,
    InputError,
    UniweaveConfig,
    config_hash,
    config_sources,
    key_source,
    load_config,
    to_yaml,
)
from uniweave.config.resolved import run_dir as resolved_run_dir
from uniweave.data.errors import DatasetError

PROG = "uniweave"


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


@dataclass(frozen=True)
class Command:
    """A subcommand: `configure` adds arguments to its parser; `run` returns the exit code."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """`CONFIG [key=value ...]`: a YAML config file and schema-typed dotted overrides."""
    parser.add_argument("config", metavar="CONFIG", help="YAML config file")
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. trainer.optimizer.lr=1e-4 (typed by the schema)",
    )


def load_args_config(args: argparse.Namespace) -> UniweaveConfig:
    """The validated config named by `add_config_arguments` arguments, hub ids among its
    model directories resolved to local snapshots (`uniweave.config.hub`), its `model`
    section checked against the kind's registration (creates nothing)."""
    from uniweave.config.hub import resolve_hub_ids
    from uniweave.models import check_model_config

    cfg = resolve_hub_ids(load_config(args.config, args.overrides))
    if cfg.data.tasks is None:  # read from the rows (imports the data loader: not for --help)
        from uniweave.data.rows import resolve_tasks

        cfg = resolve_tasks(cfg)
    check_model_config(cfg.model)
    return saved_sizes_of(args, cfg)  # model.path: the loaded model's sizes, not model.tiny's


def saved_sizes_of(args: argparse.Namespace, cfg: UniweaveConfig) -> UniweaveConfig:
    """`with_saved_sizes(cfg)`, its refusal of a given size naming the file (or the
    command line) that gave it."""
    from uniweave.config import key_source
    from uniweave.models.registry import with_saved_sizes

    try:
        return with_saved_sizes(cfg)
    except ConfigError as err:
        if err.key is None or err.source is not None:
            raise
        where = key_source(args.config, args.overrides, err.key)
        raise ConfigError(err.problem, key=err.key, source=where) from None


def add_random_init_argument(parser: argparse.ArgumentParser) -> None:
    """`--random-init`: allow a model without `model.path` (freshly initialised weights)."""
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="use freshly initialised weights when model.path is not set (without it, a "
        "config without model.path is refused)",
    )


def load_weights_config(args: argparse.Namespace) -> UniweaveConfig:
    """`load_args_config`, refusing a config without `model.path` unless `--random-init`:
    random weights must be asked for, never a silent default (exit 2)."""
    cfg = load_args_config(args)
    if cfg.model.path is None and not args.random_init:
        raise ConfigError(
            f"not set, so '{PROG} {args.command}' would use randomly initialised weights; "
            "set it (e.g. model.path=runs/NAME/model, a run's exported model) or pass "
            "--random-init",
            key="model.path",
            source=args.config,
        )
    return cfg


def configure_eval(parser: argparse.ArgumentParser) -> None:
    """`eval CONFIG [key=value ...]`: the data split (uniweave.eval.runner); with
    `--geneval METADATA`: GenEval's images drawn and scored (docs/geneval.md)."""
    add_config_arguments(parser)
    add_random_init_argument(parser)
    group = parser.add_argument_group(
        "GenEval (with --geneval; the other options act only with it)"
    )
    group.add_argument(
        "--geneval",
        default=None,
        metavar="METADATA",
        help="a GenEval metadata JSONL (e.g. evaluation_metadata.jsonl): draw N images per "
        "prompt into GenEval's folder layout, then score them as 'uniweave score' does",
    )
    group.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="the layout and results (default evaluation.output_dir, else "
        "<run.output_dir>/geneval); a rerun draws only the images not there yet",
    )
    group.add_argument(
        "--images-per-prompt",
        type=_positive_int,
        default=None,
        metavar="N",
        help="images drawn per prompt (default 4, GenEval's)",
    )
    add_detector_arguments(group, evaluating=True)


def add_detector_arguments(parser, evaluating: bool = False) -> None:
    """The detector, CLIP and rule options `score` and `eval --geneval` share; for eval
    every default is None (an option given without --geneval is refused), filled in by
    `_geneval_defaults`."""
    unset = evaluating
    parser.add_argument(
        "--detector",
        choices=("mask2former", "owlv2", "digits"),
        default=None if unset else "mask2former",
        help="object detector kind (default mask2former; digits: the digits world's, "
        "--detector-path a digits classifier directory)",
    )
    parser.add_argument(
        "--detector-path",
        required=not evaluating,
        default=None,
        metavar="P",
        help="the detector's model directory or hub id, e.g. "
        "facebook/mask2former-swin-small-coco-instance",
    )
    parser.add_argument(
        "--clip-path",
        default=None,
        metavar="P",
        help="CLIP model directory or hub id for colour clauses, e.g. "
        "openai/clip-vit-large-patch14 (needed when a row asks for a colour)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None if unset else "cpu",
        help="the detector's and CLIP's device (default: "
        + ("the run's device, run.device)" if evaluating else "cpu)"),
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None if unset else 8,
        help="images per detector pass (default 8)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=None if unset else 0.3,
        help="detection score threshold (GenEval: 0.3)",
    )
    parser.add_argument(
        "--counting-threshold",
        type=float,
        default=None if unset else 0.9,
        help="the threshold on counting rows (GenEval: 0.9)",
    )
    parser.add_argument(
        "--on-error",
        choices=("raise", "zero"),
        default=None if unset else "raise",
        help="a detection that fails: stop (default), or count the image as failed and incorrect",
    )


_GENEVAL_DEFAULTS = {
    "out": None,
    "images_per_prompt": 4,
    "detector": "mask2former",
    "detector_path": None,
    "clip_path": None,
    "device": None,
    "batch_size": 8,
    "threshold": 0.3,
    "counting_threshold": 0.9,
    "on_error": "raise",
}


def _geneval_defaults(args: argparse.Namespace) -> bool:
    """Whether `eval` runs GenEval; refuses a GenEval option without --geneval and
    --geneval without --detector-path; fills the unset options' defaults."""
    if args.geneval is None:
        for name in _GENEVAL_DEFAULTS:
            if getattr(args, name) is not None:
                option = "--" + name.replace("_", "-")
                raise ConfigError(
                    "acts only with --geneval METADATA", key=option, source=COMMAND_LINE
                )
        return False
    if args.detector_path is None:
        raise ConfigError(
            "--geneval needs the detector that scores the images, e.g. "
            "facebook/mask2former-swin-small-coco-instance",
            key="--detector-path",
            source=COMMAND_LINE,
        )
    for name, value in _GENEVAL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return True


def configure_inspect(parser: argparse.ArgumentParser) -> None:
    """`inspect CONFIG [key=value ...]`, `inspect --fingerprints RUN_DIR`, `inspect RUN_DIR`
    (what every entry of a run directory is), or `inspect DATA_DIR` (a folder of .jsonl
    rows, e.g. one `uniweave data convert` wrote)."""
    parser.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG",
        help="YAML config file, a run directory (what each entry is), or a folder of .jsonl "
        "rows (counts of rows and parts per type)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. trainer.optimizer.lr=1e-4 (typed by the schema)",
    )
    parser.add_argument(
        "--fingerprints",
        metavar="RUN_DIR",
        help="print the input fingerprints recorded in a run's (or a checkpoint "
        "directory's) newest checkpoint and whether each file still matches",
    )
    parser.add_argument(
        "--sources",
        action="store_true",
        help="print one line per value: dotted key, value and the file, <command line> or "
        "default that set it",
    )


def run_inspect(args: argparse.Namespace) -> int:
    """Print the resolved config as YAML (with `--sources`: `key: value  # source` lines),
    then `hash: <sha256 hex>`. Builds nothing. With `--fingerprints RUN_DIR`: the recorded
    input fingerprints instead. With a folder of .jsonl rows (or one .jsonl file): rows
    per task and split, parts per role and type, and a conversion's rejects."""
    if args.fingerprints is not None:
        if args.config is not None:
            raise ConfigError("give either CONFIG or --fingerprints RUN_DIR, not both")
        return _print_fingerprints(args.fingerprints)
    if args.config is None:
        raise ConfigError("inspect needs CONFIG (or --fingerprints RUN_DIR)")
    from pathlib import Path

    if Path(args.config).is_dir():
        from uniweave.train.layout import describe_run_dir, is_run_dir

        if is_run_dir(Path(args.config)):
            if args.overrides or args.sources:
                raise ConfigError("a run directory takes no KEY=VALUE overrides or --sources")
            entries = describe_run_dir(Path(args.config))
            width = max(len(name) for name, _ in entries)
            for name, what in entries:
                sys.stdout.write(f"{name:<{width}}  {what}\n")
            return 0
    if Path(args.config).is_dir() or args.config.endswith(".jsonl"):
        if args.overrides or args.sources:
            raise ConfigError("a data folder takes no KEY=VALUE overrides or --sources")
        from uniweave.data.convert import inspect_rows

        sys.stdout.write(inspect_rows(args.config))
        return 0
    if args.sources:
        from uniweave.config.hub import resolve_hub_ids
        from uniweave.models import check_model_config
        from uniweave.models.registry import MODEL_CONFIG, saved_sizes

        cfg, rows = config_sources(args.config, args.overrides)
        resolved = resolve_hub_ids(cfg)
        check_model_config(resolved.model)
        loaded = saved_sizes(resolved.model)  # model.path: the model's own sizes
        if loaded:
            cfg = saved_sizes_of(args, resolved)
            files = {"tiny": MODEL_CONFIG, "codec": "codec/codec.json"}
            rows = [
                (k, json.dumps(loaded[k]), f"{cfg.model.path}/{files[k.split('.')[1]]}")
                if k in loaded
                else (k, v, source)
                for k, v, source in rows
            ]
        width = min(60, max(len(f"{k}: {v}") for k, v, _ in rows))
        for key, value, source in rows:
            sys.stdout.write(f"{f'{key}: {value}':<{width}}  # {source}\n")
    else:
        cfg = load_args_config(args)
        sys.stdout.write(to_yaml(cfg))
    sys.stdout.write(f"hash: {config_hash(cfg)}\n")
    return 0


def _print_fingerprints(where: str) -> int:
    """The `fingerprints` of the newest checkpoint under `where` (a run directory, or one
    checkpoint), by name and unverified, one line per file: key, path, size, SHA-256 and
    whether the file now on disk still matches; before them its parent, the world size
    that wrote it and the execution changes its resumes met. Reads only (no torch)."""
    from pathlib import Path

    from uniweave.config.fingerprint import changed_files, fingerprint

    root = Path(where)
    states = [root / "state.json"] if (root / "state.json").is_file() else []
    if not states:
        found = sorted((root / "checkpoints").glob("update-*/state.json"))
        states = found[-1:]
    if not states:
        raise ConfigError(f"{root}: no checkpoint (no state.json)")
    state = json.loads(states[0].read_text())
    recorded = state.get("fingerprints")
    print(f"checkpoint {states[0].parent} (update {state.get('update')})")
    if "parent" in state:
        parent = state["parent"]
        print(f"parent {parent['checkpoint']} (manifest sha256 {parent['manifest_sha256']})")
    if "world_size" in state:
        print(f"written at world size {state['world_size']}")
    for change in state.get("execution_changes", []):
        before, after = change["world_size"]
        keys = ", ".join(change["config_keys"]) or "none"
        print(
            f"execution change at update {change['update']} ({change['checkpoint']}): "
            f"world size {before} -> {after}; config keys {keys}"
        )
    if recorded is None:
        print("no fingerprints recorded (a checkpoint written before they were)")
        return 0
    if not recorded:
        print("no input files (a model built from the config, the built-in digits data)")
        return 0
    for key, record in sorted(recorded.items()):
        path = Path(record["path"])
        try:
            changes = dict(changed_files(record["files"], fingerprint(path)))
        except FileNotFoundError:
            changes = {name: "missing" for name in record["files"]}
        for name, fp in sorted(record["files"].items()):
            status = changes.get(name, "ok")
            print(
                f"{key}  {path / name if path.is_dir() else path}  {fp['size']}  "
                f"{fp['sha256']}  {status}"
            )
        for name in sorted(n for n, what in changes.items() if what == "added"):
            print(f"{key}  {path / name}  -  -  added")
    return 0


def run_train(args: argparse.Namespace) -> int:
    """Validate the config (before anything is created), then train / resume the run."""
    cfg = load_args_config(args)

    from uniweave.train.distributed.spawn import check_world_size, is_spawned_worker, spawn_workers
    from uniweave.train.run import run_train as train

    if cfg.trainer.world_size > 1 and not is_spawned_worker():
        check_world_size(cfg.trainer.world_size, cfg.run.device)
        spawn_workers(cfg.trainer.world_size, "uniweave.cli:main", args.argv)
        print(
            f"{PROG} train: done ({cfg.trainer.world_size} workers); run directory "
            f"{cfg.run.output_dir}",
            file=sys.stderr,
        )
        return 0
    from uniweave.train.state.checkpoint import last_saved

    try:
        run_dir = train(cfg, stop_after=args.stop_after_updates)
    except KeyboardInterrupt:
        saved = last_saved(resolved_run_dir(cfg))
        raise KeyboardInterrupt(
            "no checkpoint was saved"
            if saved is None
            else f"last checkpoint {saved}; run the same command to resume from it"
        ) from None
    results = run_dir / "eval.json"
    if (run_dir / "DONE").is_file() and results.is_file():
        print(f"final metrics ({results}):")
        print(_metric_lines(json.loads(results.read_text())), end="", flush=True)
    print(f"{PROG} train: done; run directory {run_dir}", file=sys.stderr)
    return 0


def _metric_lines(metrics: dict) -> str:
    """`  key value` lines, sorted by key, numbers to 4 significant decimals."""
    shown = {k: f"{v:.4f}" if isinstance(v, float) else str(v) for k, v in metrics.items()}
    width = max((len(k) for k in shown), default=0)
    return "".join(f"  {k:<{width}}  {v}\n" for k, v in sorted(shown.items()))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def configure_train(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--stop-after-updates",
        type=_positive_int,
        default=None,
        metavar="N",
        help="checkpoint and exit after N new updates (re-run to continue the same schedule)",
    )


def configure_generate(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--prompt", required=True, help='user text, e.g. "draw the digit 7"')
    parser.add_argument("--n", type=_positive_int, default=8, help="samples to draw (default 8)")
    parser.add_argument(
        "--out",
        default=None,
        help="output directory for the PNGs and JSON (default <run.output_dir>/generations)",
    )
    parser.add_argument(
        "--image",
        default=None,
        metavar="PATH",
        help="an input image shown before the prompt (image-to-text questions); read at the "
        "model's image size as a dataset row's image is",
    )
    parser.add_argument(
        "--draw",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force text-to-image (default: on when the prompt starts with 'draw')",
    )
    parser.add_argument(
        "--task",
        default=None,
        help="score the samples as rows of this task, as 'uniweave eval' does (its reward "
        "plugins, else the task's default verifier)",
    )
    parser.add_argument(
        "--answer", default=None, help="the reference answer the scorer compares with (--task)"
    )
    add_random_init_argument(parser)


def run_generate(args: argparse.Namespace) -> int:
    """Validate the config (a model.path or --random-init) and the inputs, then sample and
    write generations.png / generations.json (see `uniweave.generate`)."""
    if args.answer is not None and args.task is None:
        raise ConfigError(
            "needs --task (the task whose verifier compares with it)",
            key="--answer",
            source=COMMAND_LINE,
        )
    cfg = load_weights_config(args)
    from pathlib import Path

    from uniweave.generate import generate
    from uniweave.train.preflight import GENERATIONS, preflight_inference

    preflight_inference(cfg)
    if args.image is not None and not Path(args.image).is_file():
        raise ConfigError(f"{args.image}: image file not found", key="--image", source=COMMAND_LINE)
    draw = args.prompt.lower().startswith("draw") if args.draw is None else args.draw
    out = Path(args.out) if args.out else resolved_run_dir(cfg) / GENERATIONS
    summary = generate(cfg, args.prompt, args.n, out, draw, args.image, args.task, args.answer)
    for record in summary["samples"]:
        shown = [repr(record["text"])] if record["text"] or not record["images"] else []
        shown += record["images"]
        score = f" score {record['score']:.4f}" if "score" in record else ""
        print(f"{record['id']}: {' '.join(shown)} ({record['finish_reason']}){score}")
    if summary["png"]:
        print(f"images: {summary['png']}")
    print(f"{PROG} generate: results in {out} (generations.json)", file=sys.stderr)
    return 0


def configure_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="demo directory (default runs/demo)")
    parser.add_argument(
        "--sft-updates",
        type=_positive_int,
        default=1500,
        help="SFT updates (default 1500: past the multiple-choice plateau, see sft_vq.yaml)",
    )
    parser.add_argument("--grpo-updates", type=_positive_int, default=150, help="GRPO updates")


def run_demo(args: argparse.Namespace) -> int:
    """codec -> SFT -> GRPO text-to-image -> report.md (see uniweave.demo)."""
    from pathlib import Path

    from uniweave.demo import run_demo as demo

    report = demo(Path(args.out), args.sft_updates, args.grpo_updates)
    print(f"{PROG} demo: report {report}", file=sys.stderr)
    return 0


def configure_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="one run directory, or two")
    parser.add_argument(
        "--out",
        default=None,
        help="two runs: where compare.md / compare.html go (default <first run>/compare)",
    )


def run_report(args: argparse.Namespace) -> int:
    """Rebuild a run's report.md / report.html / report.json (one RUN_DIR), or write
    compare.md / compare.html of two runs side by side (see uniweave.eval.run_report)."""
    from pathlib import Path

    if len(args.runs) > 2:
        return _fail(args, f"report takes one or two run directories, got {len(args.runs)}", 2)
    for run in args.runs:
        if not (Path(run) / "config.yaml").is_file():
            return _fail(args, f"{run}: not a uniweave run directory (no config.yaml)", 2)
    from uniweave.eval.run_report import REPORT_HTML, REPORT_MD, compare_runs, write_report

    if len(args.runs) == 1:
        run = Path(args.runs[0])
        summary = write_report(run)
        for alarm in summary["alarms"]:
            again = f"; again at updates {', '.join(map(str, alarm['again_at']))}"
            print(
                f"alarm: {alarm['name']} at update {alarm['update']}: {alarm['message']}"
                + (again if alarm["again_at"] else "")
            )
        for v in summary["verdicts"]:
            print(f"{v['split']} {v['task']} {v['metric']}: {v['verdict']}")
        print(f"report: {run / REPORT_MD} {run / REPORT_HTML}")
        return 0
    out = Path(args.out) if args.out else Path(args.runs[0]) / "compare"
    path = compare_runs(Path(args.runs[0]), Path(args.runs[1]), out)
    print(f"comparison: {path} {path.with_suffix('.html')}")
    return 0


def configure_data(parser: argparse.ArgumentParser) -> None:
    """`uniweave data export|convert|jigsaw ...` (docs/data.md)."""
    from uniweave.data import convert, export, jigsaw

    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    child = sub.add_parser(
        "export", help="write a digits task as JSONL + PNG files", description=export.__doc__
    )
    export.add_arguments(child)
    child = sub.add_parser(
        "convert",
        help="convert a Zebra-CoT, ThinkMorph or aligned web corpus (parquet) to rows "
        "(streaming, resumable, rejects counted)",
        description="Convert a public interleaved corpus to uniweave rows; see docs/data.md.",
    )
    convert.add_arguments(child)
    child = sub.add_parser(
        "jigsaw",
        help="build a Visual Jigsaw task (shuffled pieces, answer their order) from a folder "
        "of images; scored by the visual_jigsaw reward plugin",
        description="Build a Visual Jigsaw task from any folder of images; see docs/data.md.",
    )
    jigsaw.add_arguments(child)


def run_data(args: argparse.Namespace) -> int:
    if args.data_command == "convert":
        from uniweave.data import convert

        return convert.run(args)
    if args.data_command == "jigsaw":
        from uniweave.data import jigsaw

        return jigsaw.run(args)
    from uniweave.data import export

    return export.run(args)


def configure_recipes(parser: argparse.ArgumentParser) -> None:
    """`uniweave recipes`: the packaged recipes; `uniweave recipes copy NAME DIR`: one to edit."""
    sub = parser.add_subparsers(dest="recipes_command", metavar="ACTION")
    child = sub.add_parser(
        "copy",
        help="write a packaged recipe and the recipes it inherits from into DIR",
        description="write a packaged recipe and the recipes it inherits from (defaults:) "
        "into DIR, for you to edit; refuses to overwrite a file",
    )
    child.add_argument("name", metavar="NAME", help="a recipe name 'uniweave recipes' lists")
    child.add_argument("dest", metavar="DIR", help="folder to write into (created)")


def run_recipes(args: argparse.Namespace) -> int:
    from pathlib import Path

    from uniweave.config.packaged import copy_recipe, recipe_names, recipe_summary, recipes_root

    if args.recipes_command == "copy":
        for path in copy_recipe(args.name, Path(args.dest)):
            print(f"wrote {path}")
        return 0
    names = recipe_names()
    width = max(len(n) for n in names)
    print(f"{len(names)} packaged recipes ({recipes_root()}); give a name wherever a config "
          f"path goes, or 'uniweave recipes copy NAME DIR' to edit one:")  # fmt: skip
    for name in names:
        print(f"  {name:<{width}}  {recipe_summary(recipes_root() / (name + '.yaml'))}")
    return 0


def configure_plan(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--gpus", type=_positive_int, default=1, help="GPUs (ranks), default 1")
    parser.add_argument(
        "--gpu-mem", type=float, default=80.0, metavar="GIB", help="memory per GPU (GiB)"
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="plan one CPU process: peak resident memory (--gpu-mem is then the host's GiB), "
        "the interpreter and libraries' resident size included",
    )
    parser.add_argument(
        "--preset",
        choices=("janus-pro-1b", "janus-pro-7b", "qwen3-vl-2b", "qwen3-vl-8b"),
        help="published architecture sizes instead of model.path's config.json",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=_positive_int,
        default=256,
        help="prompt tokens per row (the config does not bound them), default 256",
    )


def run_plan(args: argparse.Namespace) -> int:
    from uniweave.plan import run

    return run(args)


def configure_models(parser: argparse.ArgumentParser) -> None:
    """`uniweave models write-full-shape NAME OUT [--shape full|small]`. The names and shapes
    are checked by the writer when the command runs (a one-line error listing the known
    ones), so building the parser imports nothing of `uniweave.models`."""
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    child = sub.add_parser(
        "write-full-shape",
        help="write a random-weight checkpoint at a published model's sizes in the hub's "
        "file layout (bf16 shards + index, config, tokenizer, image processor)",
    )
    child.add_argument(
        "name", metavar="NAME", help="janus-pro-1b | janus-pro-7b | qwen3-vl-2b (the writer's list)"
    )
    child.add_argument("out", metavar="OUT", help="output directory (new or empty)")
    child.add_argument(
        "--shape",
        default="full",
        help="full: the published sizes; small: the same files and keys at tiny widths",
    )
    child.add_argument("--seed", type=int, default=0, help="random weights' seed")


def run_models(args: argparse.Namespace) -> int:
    import time

    from uniweave.models.full_shape import write_full_shape

    start = time.perf_counter()
    try:
        w = write_full_shape(args.name, args.out, args.shape, args.seed)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    sys.stdout.write(
        f"wrote {args.name} ({args.shape}): {w.parameters:,} parameters, {w.shards} bf16 "
        f"shards, {w.bytes / 2**30:.2f} GiB -> {w.path} in {time.perf_counter() - start:.1f} s\n"
    )
    return 0


def configure_config(parser: argparse.ArgumentParser) -> None:
    """`uniweave config describe [KEY] [--markdown]`: the config reference (from the schema)."""
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    child = sub.add_parser(
        "describe",
        help="print each config field's dotted key, type, default and description",
        description="Print each config field's dotted key, type, default and description, "
        "from the schema: all fields, or KEY and the fields under it (algorithm variants: "
        "algorithm[grpo].clip_low, or algorithm.clip_low for every variant that has it).",
    )
    child.add_argument("key", nargs="?", metavar="KEY", help="e.g. trainer.optimizer.lr")
    child.add_argument(
        "--markdown", action="store_true", help="print tables (what docs/config.md holds)"
    )


def run_config(args: argparse.Namespace) -> int:
    from uniweave.config import reference

    docs = reference.lookup(args.key)
    sys.stdout.write(reference.markdown(docs) if args.markdown else reference.text(docs))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """Validate the config (a model.path or --random-init), then evaluate the model (see
    `uniweave.eval.runner`); with --geneval, draw and score GenEval's images (see
    `uniweave.eval.geneval.generation`)."""
    geneval = _geneval_defaults(args)
    cfg = load_weights_config(args)
    if geneval:
        from uniweave.eval.geneval.command import check_eval, eval_command
        from uniweave.train.preflight import preflight_inference

        plan = check_eval(args, cfg)
        preflight_inference(cfg)
        return eval_command(args, cfg, plan)
    from uniweave.eval import run_eval as evaluate
    from uniweave.train.preflight import preflight_inference

    e = cfg.evaluation
    preflight_inference(cfg, (e.split,))
    try:
        out = evaluate(cfg)
    except KeyboardInterrupt:
        kept = e.output_dir or f"{cfg.run.output_dir}/eval-{e.split}"
        raise KeyboardInterrupt(
            f"the records written so far are kept in {kept}; run the same command to continue"
        ) from None
    summary = json.loads((out / "summary.json").read_text())
    for task, stats in sorted(summary["tasks"].items()):
        print(f"{task}:")
        print(_metric_lines(stats), end="")
    sys.stdout.flush()
    print(f"{PROG} eval: results in {out} (summary.json, index.html)", file=sys.stderr)
    return 0


def configure_probe(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--n", type=_positive_int, default=4, help="validation rows per task (default 4)"
    )


def run_probe(args: argparse.Namespace) -> int:
    """Information Gain scores of `model.path` on val rows (CPU; writes nothing)."""
    cfg = load_args_config(args)
    from uniweave.train.methods.sft.probe import run_probe as probe
    from uniweave.train.preflight import preflight_inference

    preflight_inference(cfg, ("val",), verify=False)  # probe scores no answers
    probe(cfg, args.n)
    return 0


def configure_score(parser: argparse.ArgumentParser) -> None:
    """`uniweave score FOLDER --detector-path P --out DIR ...` (docs/geneval.md)."""
    parser.add_argument(
        "folder",
        metavar="FOLDER",
        help="images in GenEval's layout (<index>/metadata.jsonl, <index>/samples/NNNN.png)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (new or empty)")
    add_detector_arguments(parser)
    parser.add_argument(
        "--images-per-prompt",
        type=_positive_int,
        default=None,
        metavar="N",
        help="images expected per prompt (default: up to the highest sample number found)",
    )
    parser.add_argument(
        "--missing",
        choices=("wrong", "skip"),
        default="wrong",
        help="missing or unreadable images: judged incorrect (default), or left out of the "
        "figures as GenEval does; named either way",
    )


def run_score(args: argparse.Namespace) -> int:
    """Check the folder, its metadata and the options, then load the models and score
    (see `uniweave.eval.geneval.score`)."""
    from uniweave.eval.geneval.command import score_command

    return score_command(args)


COMMANDS: list[Command] = [
    Command(
        "inspect",
        "print the resolved config and its hash (--sources: who set each value), or a "
        "run's input fingerprints (CPU only, creates nothing)",
        configure_inspect,
        run_inspect,
    ),
    Command(
        "train",
        "train a model (SFT, GRPO or OPD)",
        configure_train,
        run_train,
    ),
    Command(
        "generate",
        "sample answers / images for one prompt and write a PNG grid",
        configure_generate,
        run_generate,
    ),
    Command(
        "eval",
        "evaluate a model on a data split with the reward plugins (resumable)",
        configure_eval,
        run_eval,
    ),
    Command(
        "score",
        "score a folder of images in GenEval's layout with a detector and CLIP colour: "
        "results JSONL and GenEval's summary table",
        configure_score,
        run_score,
    ),
    Command(
        "probe",
        "print Information Gain full / blind / gain scores on val rows (CPU, writes nothing)",
        configure_probe,
        run_probe,
    ),
    Command(
        "plan",
        "per-rank GPU memory of a config (DDP/FSDP2, full FT/LoRA) from a meta-device "
        "build of the model; writes nothing",
        configure_plan,
        run_plan,
    ),
    Command(
        "config",
        "the config reference: 'config describe [KEY]' (type, default, description)",
        configure_config,
        run_config,
    ),
    Command(
        "report",
        "rebuild a run's report.md/report.html (RUN_DIR), or compare two runs (A B)",
        configure_report,
        run_report,
    ),
    Command(
        "models",
        "model utilities: 'models write-full-shape NAME OUT' (random weights, hub layout)",
        configure_models,
        run_models,
    ),
    Command("demo", "digits demo: SFT -> GRPO -> report", configure_demo, run_demo),
    Command(
        "data",
        "dataset utilities: export the digits tasks, convert public corpora, jigsaw tasks",
        configure_data,
        run_data,
    ),
    Command(
        "recipes",
        "list the packaged recipes; 'recipes copy NAME DIR' writes one to edit",
        configure_recipes,
        run_recipes,
    ),
]


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command; `--debug` works before or
    after the subcommand name."""
    debug = _Parser(add_help=False)
    debug.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show tracebacks on errors",
    )
    parser = _Parser(
        prog=PROG,
        description="Post-train unified multimodal autoregressive models (SFT, GRPO, OPD).",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands:
        child = sub.add_parser(
            command.name, help=command.help, description=command.help, parents=[debug]
        )
        command.configure(child)
        child.set_defaults(handler=command.run)
    return parser


def main(argv: Sequence[str] | None = None, commands: Sequence[Command] | None = None) -> int:
    """Run the CLI on `argv` (default `sys.argv[1:]`) over `commands` (default `COMMANDS`)
    and return the exit code."""
    parser = build_parser(COMMANDS if commands is None else commands)
    try:
        args = _parse(parser, argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else 2
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = args.handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except (ConfigError, DatasetError) as exc:
        error = exc if isinstance(exc, ConfigError) else InputError(str(exc), exc.key)
        _locate(args, error)
        return _fail(args, str(error), 2)
    except KeyboardInterrupt as exc:  # a command may say what it saved
        return _fail(args, f"interrupted; {exc}" if str(exc) else "interrupted", 130)
    except BrokenPipeError:  # `uniweave inspect ... | head`: the reader has what it wanted
        _quiet_stdout()
        return 128 + 13  # as a process ended by SIGPIPE, without a traceback
    except Exception as exc:  # one line for people; --debug for the traceback
        return _fail(args, f"{type(exc).__name__}: {exc}", 1)


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parse_args`, also taking KEY=VALUE overrides after an option (`CONFIG --random-init
    a=1`: argparse would leave `a=1` unrecognised), in command-line order."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def _locate(args: argparse.Namespace, exc: ConfigError) -> None:
    """A ConfigError raised after loading (model, data, rewards) names its key but no file:
    point it at the config file or `<command line>` that set the key."""
    if exc.source is None and exc.key and getattr(args, "config", None):
        try:
            exc.source = key_source(args.config, getattr(args, "overrides", []), exc.key)
        except ConfigError:
            return


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush of what is still
    buffered for a closed pipe does not raise again at exit."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    if args.debug:
        traceback.print_exc()
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
