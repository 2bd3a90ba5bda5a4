"""Visual Jigsaw: a self-supervised ordering task built from any folder of images.

`make_jigsaw(image_dir, out, grid)` reads every image under `image_dir` (recursively,
files ending .png .jpg .jpeg .webp .bmp .gif, in sorted path order), crops it centrally
to a multiple of `grid` in each side, cuts it into grid x grid pieces numbered 0..n-1
left to right, top to bottom, and shows them shuffled: position p of the shown image
holds the original's piece `permutation[p]` (a uniform non-identity permutation, drawn
from a generator seeded by (seed, image number)). The answer lists, for each position
q of the original image in order, the shown piece that belongs there: `solution` =
the inverse of `permutation`, written "2 0 3 1". Reassembling the shown image with the
solution gives back the cropped original exactly.

It writes OUT/jigsaw.jsonl (loader rows: user = [shown image, prompt], assistant = the
answer text; `answer`, task `visual_jigsaw`, `split`, meta {grid, solution, source})
and OUT/images/jigsaw-NNNNNN.png, atomically (a failure leaves OUT as it was). Images
are split by a seeded permutation of their numbers: the first round(val_fraction * N)
are val, the next round(test_fraction * N) test, the rest train.

An image that cannot be used is skipped and counted by reason: `unreadable` (PIL
cannot decode it), `too_small` (a side shorter than `grid` pixels), `identical_pieces`
(two pieces with equal pixels: the order would be ambiguous). The reward plugin
`visual_jigsaw` (`uniweave.rewards.plugins.VisualJigsaw`) scores answers: 1 exact,
gamma x the fraction of positions right for another valid order, 0 for an invalid one.

Importing this module is light (numpy and PIL are imported when the task is built).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from uniweave.data.errors import DatasetError

TASK = "visual_jigsaw"
GRIDS = (2, 3)
SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
PROMPT = (
    "The image is cut into a {g}x{g} grid of pieces, numbered 0 to {last} left to right, "
    "top to bottom, and the pieces are shuffled. For each position of the original image, "
    "in the same order, which piece of the shown image belongs there? Answer with {n} "
    "numbers separated by spaces."
)


def prompt(grid: int) -> str:
    return PROMPT.format(g=grid, last=grid * grid - 1, n=grid * grid)


def pieces(image, grid: int) -> list:
    """The grid x grid pieces of `image` [H, W, ...] (H, W multiples of grid), row-major."""
    h, w = image.shape[0] // grid, image.shape[1] // grid
    return [
        image[r * h : (r + 1) * h, c * w : (c + 1) * w] for r in range(grid) for c in range(grid)
    ]


def assemble(parts: list, grid: int):
    """The image whose piece at position p is `parts[p]` (inverse of `pieces`)."""
    import numpy as np

    rows = [np.concatenate(parts[r * grid : (r + 1) * grid], axis=1) for r in range(grid)]
    return np.concatenate(rows, axis=0)


def crop(image, grid: int):
    """`image` centrally cropped so both sides are multiples of `grid`."""
    h, w = image.shape[0] - image.shape[0] % grid, image.shape[1] - image.shape[1] % grid
    top, left = (image.shape[0] - h) // 2, (image.shape[1] - w) // 2
    return image[top : top + h, left : left + w]


def inverse(permutation: list[int]) -> list[int]:
    out = [0] * len(permutation)
    for p, q in enumerate(permutation):
        out[q] = p
    return out


def image_files(image_dir: Path) -> list[Path]:
    return sorted(p for p in image_dir.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)


def make_jigsaw(
    image_dir: str | Path,
    out: str | Path,
    grid: int,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = 0.0,
) -> dict:
    """Build the task (module docstring); the summary (also OUT/summary.json)."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    from uniweave.core.atomic import write_dir_atomic  # uniweave.core imports torch

    image_dir, out = Path(image_dir), Path(out)
    if grid not in GRIDS:
        raise DatasetError(f"grid must be one of {GRIDS}, got {grid}")
    if not image_dir.is_dir():
        raise DatasetError(f"{image_dir}: image folder not found")
    if not (0 <= val_fraction and 0 <= test_fraction and val_fraction + test_fraction <= 1):
        raise DatasetError("val and test fractions must be >= 0 and sum to at most 1")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DatasetError(f"{out}: exists and is not empty; choose a new output folder")
    files = image_files(image_dir)
    if not files:
        raise DatasetError(f"{image_dir}: no image files ({', '.join(SUFFIXES)})")
    n = grid * grid
    order = np.random.default_rng([seed, 1]).permutation(len(files))
    n_val, n_test = round(val_fraction * len(files)), round(test_fraction * len(files))
    split_of = {}
    for rank, k in enumerate(order):
        split_of[int(k)] = "val" if rank < n_val else "test" if rank < n_val + n_test else "train"
    skipped: Counter = Counter()
    splits: Counter = Counter()

    def fill(tmp: Path) -> None:
        (tmp / "images").mkdir()
        lines = []
        for k, path in enumerate(files):
            try:
                with Image.open(path) as opened:
                    image = np.asarray(opened.convert("RGB"))
            except (UnidentifiedImageError, OSError, ValueError):
                skipped["unreadable"] += 1
                continue
            if min(image.shape[:2]) < grid:
                skipped["too_small"] += 1
                continue
            original = pieces(crop(image, grid), grid)
            flat = [p.tobytes() for p in original]
            if len(set(flat)) < n:
                skipped["identical_pieces"] += 1
                continue
            rng = np.random.default_rng([seed, k])
            permutation = list(range(n))
            while permutation == list(range(n)):
                permutation = [int(i) for i in rng.permutation(n)]
            shown = assemble([original[q] for q in permutation], grid)
            name = f"images/jigsaw-{k:06d}.png"
            Image.fromarray(shown).save(tmp / name, format="PNG")
            solution = inverse(permutation)
            answer = " ".join(map(str, solution))
            row = {
                "id": f"jigsaw-{k:06d}",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "path": name},
                            {"type": "text", "text": prompt(grid)},
                        ],
                    },
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ],
                "answer": answer,
                "task": TASK,
                "split": split_of[k],
                "meta": {
                    "grid": grid,
                    "solution": solution,
                    "source": str(path.relative_to(image_dir)),
                },
            }
            splits[split_of[k]] += 1
            lines.append(json.dumps(row, ensure_ascii=False) + "\n")
        if not lines:
            raise DatasetError(f"{image_dir}: no usable image ({dict(skipped)})")
        (tmp / "jigsaw.jsonl").write_text("".join(lines), encoding="utf-8")
        summary.update(
            rows=len(lines),
            splits={s: splits.get(s, 0) for s in ("train", "val", "test")},
            skipped=dict(sorted(skipped.items())),
        )
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    summary: dict = {"grid": grid, "images": len(files), "seed": seed}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_dir_atomic(out.parent, out.name, fill, unique=True)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `uniweave data jigsaw`."""
    parser.add_argument("image_dir", metavar="IMAGE_DIR", help="a folder of images (recursive)")
    parser.add_argument("out", metavar="OUT", help="output folder (new or empty)")
    parser.add_argument("--grid", type=int, choices=GRIDS, required=True, help="pieces per side")
    parser.add_argument("--seed", type=int, default=0, help="shuffle and split seed (default 0)")
    parser.add_argument(
        "--val-fraction", type=float, default=0.1, help="images held out as val (default 0.1)"
    )
    parser.add_argument(
        "--test-fraction", type=float, default=0.0, help="images held out as test (default 0)"
    )


def run(args: argparse.Namespace) -> int:
    summary = make_jigsaw(
        args.image_dir, args.out, args.grid, args.seed, args.val_fraction, args.test_fraction
    )
    splits = ", ".join(f"{s} {n}" for s, n in summary["splits"].items())
    skipped = ", ".join(f"{r} {n}" for r, n in summary["skipped"].items()) or "none"
    print(
        f"wrote {summary['rows']} visual_jigsaw rows ({splits}; grid {args.grid}) of "
        f"{summary['images']} images to {Path(args.out) / 'jigsaw.jsonl'}; skipped: {skipped}"
    )
    return 0
