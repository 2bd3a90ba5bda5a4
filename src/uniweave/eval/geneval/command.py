"""`uniweave score FOLDER`: score images in GenEval's layout, made by anything.

Order of work, so that a mistake costs no model load:

1. the options: thresholds (`GenEvalThresholds`), the output folder (new or empty), the
   model paths (a hub id is resolved to its cached snapshot, `uniweave.config.hub`; each
   must be a directory with a config.json, or for `--detector digits` a digits
   classifier's directory with its classifier.json — that detector gives each object's
   stroke colour, so `--clip-path` with it is refused as acting on nothing);
2. the folder (`read_folder`): every prompt's metadata checked against the detector's
   vocabulary, read from its config.json (a bad row exits 2 naming `FILE:LINE` and the
   field), missing / unreadable / unexpected images found and named; a row that asks for
   a colour without `--clip-path` (and a detector that gives no colours) exits 2 naming
   the row;
3. then the detector (and CLIP) load, and `score_folder` judges and writes
   `results.jsonl`, `summary.txt` and `summary.json` to `--out`.

Prints the problems (one line each, counted per kind) and GenEval's summary table.

`uniweave eval CONFIG --geneval METADATA` (`check_eval`, then `eval_command`) checks the
same options, every row of the metadata file (against the detector's vocabulary, and a
colour row without `--clip-path`) and the output folder (`generation.check_out`) before
the CLI preflights the model; then it builds the model, draws the absent images
(`uniweave.eval.geneval.generation`), loads the detector and scores the folder with
`score_folder` (missing policy "wrong"), writing results.jsonl, summary.txt and
summary.json beside the images: the files `uniweave score` writes for that folder.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from uniweave.config import COMMAND_LINE, ConfigError, UniweaveConfig
from uniweave.config.hub import resolve
from uniweave.config.resolved import run_dir
from uniweave.eval.geneval.folder import read_folder
from uniweave.eval.geneval.score import score_folder
from uniweave.rewards.geneval.colour import ClipColourClassifier
from uniweave.rewards.geneval.detectors import DETECTORS
from uniweave.rewards.geneval.metadata import MetadataRow, read_metadata
from uniweave.rewards.geneval.rules import GenEvalThresholds
from uniweave.rewards.geneval.scorer import GenEvalScorer, needs_colour


def _option_error(message: str, option: str) -> ConfigError:
    return ConfigError(message, key=option, source=COMMAND_LINE)


def _model_dir(value: str, option: str, marker: str = "config.json") -> Path:
    path = Path(resolve(value, option))
    if not (path / marker).is_file():
        raise _option_error(f"{value}: not a model directory (no {marker})", option)
    return path


def _scoring_options(args: argparse.Namespace):
    """The checked thresholds, detector kind and directories and the detector's classes
    (step 1 of the module docstring); loads no model."""
    try:
        thresholds = GenEvalThresholds(
            threshold=args.threshold, counting_threshold=args.counting_threshold
        )
    except ValueError as err:
        raise _option_error(str(err), "--threshold") from None
    kind = DETECTORS[args.detector]
    detector_dir = _model_dir(args.detector_path, "--detector-path", kind.model_file)
    if args.clip_path and kind.colours_objects:
        raise _option_error(
            f"acts on nothing: the {args.detector} detector gives each object's colour",
            "--clip-path",
        )
    clip_dir = _model_dir(args.clip_path, "--clip-path") if args.clip_path else None
    try:
        classes = kind.vocabulary(detector_dir)
    except (OSError, ValueError) as err:
        raise _option_error(str(err), "--detector-path") from None
    return thresholds, kind, detector_dir, clip_dir, classes


def _check_colour(rows: Iterable[MetadataRow], clip_dir: Path | None, kind=None) -> None:
    if clip_dir is not None or (kind is not None and kind.colours_objects):
        return
    for row in rows:
        if needs_colour(row):
            raise _option_error(
                f"{row.source}: include asks for a colour; pass --clip-path "
                "(e.g. openai/clip-vit-large-patch14)",
                "--clip-path",
            )


def _scorer(args, kind, detector_dir, clip_dir, thresholds, device: str) -> GenEvalScorer:
    try:
        detector = kind(detector_dir, device=device, batch_size=args.batch_size)
        colours = ClipColourClassifier(clip_dir, device) if clip_dir else None
    except ValueError as err:
        raise _option_error(str(err), "--device") from None
    return GenEvalScorer(detector, colours, thresholds)


def score_command(args: argparse.Namespace) -> int:
    """Run `uniweave score` (module docstring); returns the exit code."""
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise _option_error(f"{out} is not empty; choose a new directory", "--out")
    thresholds, kind, detector_dir, clip_dir, classes = _scoring_options(args)
    folder = read_folder(args.folder, classes, args.images_per_prompt)
    _check_colour((s.row for s in folder.samples), clip_dir, kind)
    scorer = _scorer(args, kind, detector_dir, clip_dir, thresholds, args.device)
    out.mkdir(parents=True, exist_ok=True)
    result = score_folder(folder, scorer, out, args.missing, args.on_error)
    text = (out / "summary.txt").read_text(encoding="utf-8")
    sys.stdout.write(text)
    print(f"uniweave score: results in {out} (results.jsonl, summary.txt, summary.json)",
          file=sys.stderr)  # fmt: skip
    return 0 if result.summary is not None else 1


@dataclass(frozen=True)
class GenEvalPlan:
    """What `uniweave eval --geneval` checked before any model: the options, the rows and
    the output folder."""

    out: Path
    rows: list[MetadataRow]
    thresholds: GenEvalThresholds
    kind: type
    detector_dir: Path
    clip_dir: Path | None
    classes: tuple[str, ...]


def check_eval(args: argparse.Namespace, cfg: UniweaveConfig) -> GenEvalPlan:
    """Step one of `uniweave eval CONFIG --geneval METADATA`: the options, every metadata
    row against the detector's classes (exit 2 naming FILE:LINE and the field) and the
    output folder (`check_out`); builds no model and writes nothing."""
    from uniweave.eval.geneval.generation import check_out

    default = cfg.evaluation.output_dir or str(run_dir(cfg) / "geneval")
    out = Path(args.out or default)
    thresholds, kind, detector_dir, clip_dir, classes = _scoring_options(args)
    rows = read_metadata(args.geneval, classes)
    _check_colour(rows, clip_dir, kind)
    check_out(out)
    return GenEvalPlan(out, rows, thresholds, kind, detector_dir, clip_dir, classes)


def eval_command(args: argparse.Namespace, cfg: UniweaveConfig, plan: GenEvalPlan) -> int:
    """Step two (after the CLI's preflight of the model): build the model, draw the absent
    images (`uniweave.eval.geneval.generation`), then score the folder exactly as
    `uniweave score` does, writing its results beside the images."""
    from uniweave.eval.geneval.generation import generate_folder
    from uniweave.models.build import build_model, resolve_device

    out = plan.out
    device = resolve_device(cfg.run.device)
    model = build_model(cfg).to(device).eval()
    generated = generate_folder(cfg, model, plan.rows, out, args.images_per_prompt, args.geneval)
    del model
    print(f"uniweave eval: drew {generated.drawn} images, kept {generated.kept} already drawn "
          f"({out / 'generation.json'})", file=sys.stderr)  # fmt: skip
    folder = read_folder(out, plan.classes, args.images_per_prompt)
    detector_device = args.device or ("cuda" if device.type == "cuda" else "cpu")
    scorer = _scorer(
        args, plan.kind, plan.detector_dir, plan.clip_dir, plan.thresholds, detector_device
    )
    result = score_folder(folder, scorer, out, "wrong", args.on_error)
    sys.stdout.write((out / "summary.txt").read_text(encoding="utf-8"))
    print(f"uniweave eval: results in {out} (generation.json, results.jsonl, summary.txt, "
          "summary.json)", file=sys.stderr)  # fmt: skip
    return 0 if result.summary is not None else 1
