"""Export digits tasks as a JSONL + PNG dataset that `uniweave.data.loader` reads back.

`export_task("t2i", "train", 100, "DIR")` writes

    DIR/t2i-train.jsonl          one row per sample (loader format, with answer/task/meta)
    DIR/images/<id>-<k>.png      image k of sample <id>, 8-bit grayscale

Pixels are stored as round(255 * p), so reading back (value / 255) is exact to 0.5/255.
The export is atomic (`uniweave.core.atomic.write_dir_atomic`): everything is written (and
fsynced) into a temporary sibling directory which is then renamed to DIR, so a failure
leaves DIR as it was. DIR must not exist or be empty, unless `overwrite` replaces it.

CLI (`uniweave data export`): `add_arguments(parser)` + `run(args) -> int`; `main(argv)`
runs them standalone. Importing this module is light (no numpy, PIL or torch: they are
imported by the export itself), so `uniweave --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from uniweave.config.errors import COMMAND_LINE, ConfigError
from uniweave.config.schema import DIGITS_TASKS as TASKS
from uniweave.config.schema import SPLITS, Split

if TYPE_CHECKING:
    import numpy as np

    from uniweave.core.sample import Sample


IMAGE_DIR = "images"


def _file_stem(sample_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", sample_id)


def _write_png(path: Path, pixels: np.ndarray) -> None:
    import numpy as np
    from PIL import Image

    if pixels.ndim != 2:
        raise ValueError(f"only grayscale [H, W] images can be exported, got {pixels.shape}")
    levels = np.round(np.clip(pixels, 0.0, 1.0) * 255.0).astype(np.uint8)
    Image.fromarray(levels).save(path, format="PNG")


def sample_to_row(sample: Sample, root: Path) -> dict:
    """The loader row of `sample`; its images are written under root/images/."""
    from uniweave.core.sample import ImagePart, TextPart

    messages: list[dict] = []
    n_images = 0
    for k, part in enumerate(sample.parts):
        if not messages or messages[-1]["role"] != part.role:
            messages.append({"role": part.role, "content": []})
        if isinstance(part, TextPart):
            messages[-1]["content"].append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart) and part.pixels is not None:
            rel = f"{IMAGE_DIR}/{_file_stem(sample.id)}-{n_images}.png"
            _write_png(root / rel, part.pixels)
            messages[-1]["content"].append({"type": "image", "path": rel})
            n_images += 1
        else:
            raise ValueError(
                f"sample {sample.id!r} parts[{k}]: only text and images with pixels export"
            )
    row: dict = {"id": sample.id, "messages": messages}
    for key in ("answer", "task"):
        if getattr(sample, key) is not None:
            row[key] = getattr(sample, key)
    if sample.meta:
        row["meta"] = sample.meta
    return row


def export_samples(
    samples: Sequence[Sample], out_dir: str | Path, name: str, overwrite: bool = False
) -> Path:
    """Write `samples` as out_dir/<name>.jsonl + out_dir/images/ atomically; the JSONL path."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; choose a new directory or overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)

    def fill(tmp: Path) -> None:
        (tmp / IMAGE_DIR).mkdir()
        lines = [json.dumps(sample_to_row(s, tmp), ensure_ascii=False) for s in samples]
        (tmp / f"{name}.jsonl").write_text("".join(line + "\n" for line in lines), "utf-8")

    from uniweave.core.atomic import write_dir_atomic  # uniweave.core imports torch

    write_dir_atomic(out.parent, out.name, fill, unique=True)
    return out / f"{name}.jsonl"


def export_task(
    task: str, split: Split, n: int, out_dir: str | Path, seed: int = 0, overwrite: bool = False
) -> Path:
    """Export `make_task_samples(task, split, n, seed)` to out_dir/<task>-<split>.jsonl."""
    from uniweave.data.digits import make_task_samples

    samples = make_task_samples(task, split, n, seed)
    return export_samples(samples, out_dir, f"{task}-{split}", overwrite=overwrite)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `uniweave data export`."""
    parser.add_argument("--task", required=True, choices=TASKS, help="digits task to export")
    parser.add_argument("--split", required=True, choices=SPLITS, help="image split")
    parser.add_argument(
        "--n", type=_positive_int, default=100, help="number of samples (default 100)"
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory (new/empty)")
    parser.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty output directory"
    )


def run(args: argparse.Namespace) -> int:
    """Run the export; 0 on success. A bad `--out` (a file, a non-empty directory, one
    that cannot be created) is a `ConfigError` naming `--out` on the command line (exit 2
    under `uniweave`), checked before anything is written."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory", key="--out", source=COMMAND_LINE)
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise ConfigError(
            f"{out} is not empty; choose a new directory or pass --overwrite",
            key="--out",
            source=COMMAND_LINE,
        )
    try:
        path = export_task(args.task, args.split, args.n, args.out, args.seed, args.overwrite)
    except OSError as err:
        raise ConfigError(f"{out}: {err}", key="--out", source=COMMAND_LINE) from None
    print(f"wrote {args.n} {args.task} samples ({args.split}) to {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`uniweave data export ...` as a standalone entry point."""
    parser = argparse.ArgumentParser(
        prog="uniweave data export", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ConfigError as err:
        print(f"uniweave: error: {err}", file=sys.stderr)
        return 2
