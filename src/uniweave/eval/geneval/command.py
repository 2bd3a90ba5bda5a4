"""`uniweave score FOLDER`: score images in GenEval's layout, made by anything.

Order of work, so that a mistake costs no model load:

1. the options: thresholds (`GenEvalThresholds`), the output folder (new or empty), the
   model paths (a hub id is resolved to its cached snapshot, `uniweave.config.hub`; each
   must be a directory with a config.json);
2. the folder (`read_folder`): every prompt's metadata checked against the detector's
   vocabulary, read from its config.json (a bad row exits 2 naming `FILE:LINE` and the
   field), missing / unreadable / unexpected images found and named; a row that asks for
   a colour without `--clip-path` exits 2 naming the row;
3. then the detector (and CLIP) load, and `score_folder` judges and writes
   `results.jsonl`, `summary.txt` and `summary.json` to `--out`.

Prints the problems (one line each, counted per kind) and GenEval's summary table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from uniweave.config import COMMAND_LINE, ConfigError
from uniweave.config.hub import resolve
from uniweave.eval.geneval.folder import read_folder
from uniweave.eval.geneval.score import score_folder
from uniweave.rewards.geneval.colour import ClipColourClassifier
from uniweave.rewards.geneval.detectors import DETECTORS
from uniweave.rewards.geneval.rules import GenEvalThresholds
from uniweave.rewards.geneval.scorer import GenEvalScorer, needs_colour


def _option_error(message: str, option: str) -> ConfigError:
    return ConfigError(message, key=option, source=COMMAND_LINE)


def _model_dir(value: str, option: str) -> Path:
    path = Path(resolve(value, option))
    if not (path / "config.json").is_file():
        raise _option_error(f"{value}: not a model directory (no config.json)", option)
    return path


def score_command(args: argparse.Namespace) -> int:
    """Run `uniweave score` (module docstring); returns the exit code."""
    try:
        thresholds = GenEvalThresholds(
            threshold=args.threshold, counting_threshold=args.counting_threshold
        )
    except ValueError as err:
        raise _option_error(str(err), "--threshold") from None
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise _option_error(f"{out} is not empty; choose a new directory", "--out")
    detector_dir = _model_dir(args.detector_path, "--detector-path")
    clip_dir = _model_dir(args.clip_path, "--clip-path") if args.clip_path else None
    kind = DETECTORS[args.detector]
    try:
        classes = kind.vocabulary(detector_dir)
    except (OSError, ValueError) as err:
        raise _option_error(str(err), "--detector-path") from None
    folder = read_folder(args.folder, classes, args.images_per_prompt)
    if clip_dir is None:
        for sample in folder.samples:
            if needs_colour(sample.row):
                raise _option_error(
                    f"{sample.row.source}: include asks for a colour; pass --clip-path "
                    "(e.g. openai/clip-vit-large-patch14)",
                    "--clip-path",
                )
    try:
        detector = kind(detector_dir, device=args.device, batch_size=args.batch_size)
        colours = ClipColourClassifier(clip_dir, args.device) if clip_dir else None
    except ValueError as err:
        raise _option_error(str(err), "--device") from None
    out.mkdir(parents=True, exist_ok=True)
    scorer = GenEvalScorer(detector, colours, thresholds)
    result = score_folder(folder, scorer, out, args.missing, args.on_error)
    text = (out / "summary.txt").read_text(encoding="utf-8")
    sys.stdout.write(text)
    print(f"uniweave score: results in {out} (results.jsonl, summary.txt, summary.json)",
          file=sys.stderr)  # fmt: skip
    return 0 if result.summary is not None else 1
