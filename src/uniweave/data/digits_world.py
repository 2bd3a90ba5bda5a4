"""The digits world: canvases of digit cells in colour, with prompts in GenEval's schema.

A canvas is `cells` x `cells` cells of 8x8 pixels (`CELL`); a cell is empty (black) or
holds one real scan of scikit-learn's digits (`uniweave.data.digits_images`) painted in a
stroke colour: pixel = scan intensity x the colour's RGB (`WORLD_COLOURS`, a subset of
GenEval's ten with plain RGB values). A canvas has 3 channels (RGB, [H, W, 3]) or 1
(greyscale [H, W]: every stroke white). A 1 x 1 greyscale canvas is a digits image itself.

Prompts, one family per GenEval tag, each with its GenEval metadata row (`metadata`):

| tag | prompt | include | exclude |
|---|---|---|---|
| single_object | "a 3" | 3 x1 | |
| two_object | "a 3 and a 7" | 3 x1, 7 x1 | |
| counting | "three 5s" | 5 x3 | 5 x4 |
| colors | "a red 2" | 2 x1 red | |
| position | "a 4 left of a 1" | 1 x1, 4 x1 left of group 0 | |
| color_attr | "a green 6 and a blue 0" | 6 x1 green, 0 x1 blue | |

(as in GenEval, a position row's first include group is the reference object). Counts
run from 2 to the number of cells; the colours prompts name are `PROMPT_COLOURS`, and a
digit whose prompt names no colour is drawn in `PLAIN` (white). Two-object rows pair
distinct digits (and distinct colours for color_attr).

`layout(row, cells, rng)` places a row's digits: each in its own random cell; a position
row puts its two digits in one row of cells (left of / right of) or one column (above /
below), so the relation holds and no other one does. `render` paints a layout with scans
drawn from a split.

The prompt sets (`prompt_sets`): every prompt of each tag, in a fixed order, is shuffled by
a generator seeded with (seed, tag); the first `test_fraction` (at least one) are the test
prompts, the rest the train prompts, so the two sets share no prompt. Tags with more than
`max_per_tag` prompts keep the first `max_per_tag` of that shuffle (before the split).
`write_world` writes the dataset the project reads (T2I rows, docs/data.md): `world.jsonl`
(SFT) holds train rows with a target canvas (PNG under `images/`) per (prompt, copy) and
the test rows as prompts only (`generate_image`); `prompts.jsonl` (GRPO, which reads no
target) holds every train prompt once as a prompt-only row and the same test rows; every
row carries its GenEval row in `meta["geneval"]` (what the `geneval` reward reads); and
`metadata.jsonl` is GenEval's metadata file of the test prompts (what `uniweave eval
--geneval` reads). The same arguments write the same files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from uniweave.data.digits_images import DigitImages, load_split

CELL = 8
"""Pixels per side of a cell (one digits scan)."""

WORLD_COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "white": (1.0, 1.0, 1.0),
}
"""Stroke colours (GenEval's names) and their RGB."""

PROMPT_COLOURS: tuple[str, ...] = ("red", "green", "blue", "yellow")
PLAIN = "white"
DIGITS: tuple[str, ...] = tuple(str(d) for d in range(10))
"""The world's classes: the digit names, GenEval's `class` field."""
COUNT_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
TAG_ORDER = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


def _clause(digit: int, count: int = 1, colour: str | None = None, position=None) -> dict:
    out: dict[str, Any] = {"class": str(digit), "count": count}
    if colour is not None:
        out["color"] = colour
    if position is not None:
        out["position"] = list(position)
    return out


def prompts(cells: int = 2, colours: Sequence[str] = PROMPT_COLOURS) -> dict[str, list[dict]]:
    """Every GenEval metadata row of the world, per tag, in a fixed order (module
    docstring). `colours` empty: no colors / color_attr rows (a greyscale world)."""
    if cells < 1 or cells * cells > max(COUNT_WORDS) + 1:
        raise ValueError(f"cells must be 1..3, got {cells}")
    unknown = [c for c in colours if c not in WORLD_COLOURS]
    if unknown:
        raise ValueError(f"colours {unknown} are not world colours ({', '.join(WORLD_COLOURS)})")
    digits = range(10)
    pairs = [(a, b) for a in digits for b in digits if a != b]
    out: dict[str, list[dict]] = {tag: [] for tag in TAG_ORDER}
    for d in digits:
        out["single_object"].append(
            {"tag": "single_object", "include": [_clause(d)], "prompt": f"a {d}"}
        )
    if cells > 1:
        for a, b in pairs:
            out["two_object"].append(
                {
                    "tag": "two_object",
                    "include": [_clause(a), _clause(b)],
                    "prompt": f"a {a} and a {b}",
                }
            )
        for n in range(2, cells * cells + 1):
            for d in digits:
                out["counting"].append(
                    {
                        "tag": "counting",
                        "include": [_clause(d, n)],
                        "exclude": [_clause(d, n + 1)],
                        "prompt": f"{COUNT_WORDS[n]} {d}s",
                    }
                )
        for rel in RELATIONS:
            for a, b in pairs:
                row = {
                    "tag": "position",
                    "include": [_clause(b), _clause(a, position=(rel, 0))],
                    "prompt": f"a {a} {rel} a {b}",
                }
                out["position"].append(row)
    for colour in colours:
        for d in digits:
            out["colors"].append(
                {
                    "tag": "colors",
                    "include": [_clause(d, colour=colour)],
                    "prompt": f"a {colour} {d}",
                }
            )
    if cells > 1:
        for ca in colours:
            for cb in colours:
                if ca == cb:
                    continue
                for a, b in pairs:
                    out["color_attr"].append(
                        {
                            "tag": "color_attr",
                            "include": [_clause(a, colour=ca), _clause(b, colour=cb)],
                            "prompt": f"a {ca} {a} and a {cb} {b}",
                        }
                    )
    return {tag: rows for tag, rows in out.items() if rows}


def _tag_seed(seed: int, tag: str) -> int:
    return seed * 1_000_003 + sum((i + 1) * ord(ch) for i, ch in enumerate(tag))


def prompt_sets(
    cells: int = 2,
    colours: Sequence[str] = PROMPT_COLOURS,
    test_fraction: float = 0.25,
    max_per_tag: int | None = 80,
    seed: int = 0,
) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows): disjoint prompt sets, split per tag (module docstring)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    train: list[dict] = []
    test: list[dict] = []
    for tag, rows in prompts(cells, colours).items():
        order = np.random.default_rng(_tag_seed(seed, tag)).permutation(len(rows))
        if max_per_tag is not None:
            order = order[:max_per_tag]
        n_test = max(1, int(round(test_fraction * len(order))))
        test += [rows[i] for i in order[:n_test]]
        train += [rows[i] for i in order[n_test:]]
    return train, test


@dataclass(frozen=True)
class Placement:
    """One digit on a canvas: its class, cell (row, column) and stroke colour."""

    digit: int
    cell: tuple[int, int]
    colour: str = PLAIN


def layout(row: dict, cells: int, rng: np.random.Generator) -> list[Placement]:
    """Where a metadata row's digits go (module docstring)."""
    include = row["include"]
    if row["tag"] == "position":
        rel = include[1]["position"][0]
        line = int(rng.integers(cells))
        first, second = sorted(rng.choice(cells, size=2, replace=False).tolist())
        # the asked digit (group 1) and the reference (group 0) on one row or column
        a_at, b_at = (first, second) if rel in ("left of", "above") else (second, first)
        if rel in ("left of", "right of"):
            a_cell, b_cell = (line, a_at), (line, b_at)
        else:
            a_cell, b_cell = (a_at, line), (b_at, line)
        return [
            Placement(int(include[0]["class"]), b_cell),
            Placement(int(include[1]["class"]), a_cell),
        ]
    wanted = [(c, c.get("color", PLAIN)) for c in include for _ in range(c["count"])]
    if len(wanted) > cells * cells:
        raise ValueError(
            f"{row['prompt']!r} needs {len(wanted)} cells, the canvas has {cells * cells}"
        )
    spots = rng.choice(cells * cells, size=len(wanted), replace=False).tolist()
    return [
        Placement(int(c["class"]), divmod(int(s), cells), colour)
        for (c, colour), s in zip(wanted, spots)
    ]


_POOLS: dict[int, list[np.ndarray]] = {}


def _pools(digits: DigitImages) -> list[np.ndarray]:
    """Indices of each digit's scans in `digits` (kept per split object)."""
    key = id(digits.labels)
    if key not in _POOLS:
        _POOLS.clear()
        _POOLS[key] = [np.flatnonzero(digits.labels == d) for d in range(10)]
    return _POOLS[key]


def render(
    placements: Sequence[Placement],
    cells: int,
    channels: int,
    digits: DigitImages,
    rng: np.random.Generator,
) -> np.ndarray:
    """A canvas float32 [H, W, 3] (or [H, W] for one channel) in [0, 1] with each
    placement's digit drawn as a random scan of it from `digits` (module docstring)."""
    side = cells * CELL
    canvas = np.zeros((side, side, 3), dtype=np.float32)
    pools = _pools(digits)
    for p in placements:
        scan = digits.images[int(rng.choice(pools[p.digit]))]
        colour = WORLD_COLOURS[p.colour] if channels == 3 else WORLD_COLOURS[PLAIN]
        r, c = p.cell
        canvas[r * CELL : (r + 1) * CELL, c * CELL : (c + 1) * CELL] = scan[
            :, :, None
        ] * np.asarray(colour, dtype=np.float32)
    return canvas if channels == 3 else canvas[:, :, 0].copy()


def geometry_cells(image_size: int) -> int:
    """Cells per side of a canvas of `image_size` pixels; ValueError unless a multiple of 8."""
    if image_size < CELL or image_size % CELL:
        raise ValueError(f"a digits-world canvas is a multiple of {CELL} pixels, got {image_size}")
    return image_size // CELL


def fit_images(image_size: int, channels: int, n: int = 500, seed: int = 0) -> np.ndarray:
    """Images a codec of this geometry is fitted on: the digits train split itself for one
    8x8 greyscale cell, else `n` canvases of the world's train prompts (all tags), each laid
    out and painted with train-split scans from a generator seeded with `seed`."""
    cells = geometry_cells(image_size)
    digits = load_split("train")
    if cells == 1 and channels == 1:
        return digits.images
    train, _ = prompt_sets(cells, PROMPT_COLOURS if channels == 3 else ())
    rng = np.random.default_rng(seed)
    shape = (n, image_size, image_size) if channels == 1 else (n, image_size, image_size, 3)
    out = np.empty(shape, np.float32)
    for i in range(n):
        row = train[int(rng.integers(len(train)))]
        out[i] = render(layout(row, cells, rng), cells, channels, digits, rng)
    return out


def _save_png(canvas: np.ndarray, path: Path) -> None:
    mode = "RGB" if canvas.ndim == 3 else "L"
    Image.fromarray(np.clip(np.rint(canvas * 255.0), 0, 255).astype(np.uint8), mode).save(path)


TASK = "digits_world"


def _rows(
    train: list[dict],
    test: list[dict],
    copies: int,
    cells: int,
    channels: int,
    seed: int,
) -> Iterator[tuple[dict, np.ndarray | None]]:
    digits = load_split("train")
    rng = np.random.default_rng(seed)
    for i, meta in enumerate(train):
        for k in range(copies):
            rid = f"train-{i:04d}-{k}"
            canvas = render(layout(meta, cells, rng), cells, channels, digits, rng)
            row = {
                "id": rid,
                "task": TASK,
                "split": "train",
                "messages": [
                    {"role": "user", "content": meta["prompt"]},
                    {
                        "role": "assistant",
                        "content": [{"type": "image", "path": f"images/{rid}.png"}],
                    },
                ],
                "meta": {"geneval": meta},
            }
            yield row, canvas
    for i, meta in enumerate(test):
        yield prompt_row(f"test-{i:04d}", "test", meta), None


def prompt_row(rid: str, split: str, meta: dict) -> dict:
    """A prompt-only T2I row (`generate_image` on the model's grid) of a metadata row."""
    return {
        "id": rid,
        "task": TASK,
        "split": split,
        "messages": [
            {"role": "user", "content": meta["prompt"]},
            {"role": "assistant", "content": [{"type": "generate_image"}]},
        ],
        "meta": {"geneval": meta},
    }


def write_world(
    out: str | Path,
    cells: int = 2,
    channels: int = 3,
    copies: int = 2,
    test_fraction: float = 0.25,
    max_per_tag: int | None = 80,
    seed: int = 0,
) -> dict[str, int]:
    """Write `world.jsonl`, `images/` and `metadata.jsonl` under `out` (module docstring);
    returns the counts written."""
    root = Path(out)
    (root / "images").mkdir(parents=True, exist_ok=True)
    colours = PROMPT_COLOURS if channels == 3 else ()
    train, test = prompt_sets(cells, colours, test_fraction, max_per_tag, seed)
    n_images = 0
    with open(root / "world.jsonl", "w") as f:
        for row, canvas in _rows(train, test, copies, cells, channels, seed):
            if canvas is not None:
                _save_png(canvas, root / "images" / f"{row['id']}.png")
                n_images += 1
            f.write(json.dumps(row) + "\n")
    with open(root / "prompts.jsonl", "w") as f:
        for i, meta in enumerate(train):
            f.write(json.dumps(prompt_row(f"prompt-{i:04d}", "train", meta)) + "\n")
        for i, meta in enumerate(test):
            f.write(json.dumps(prompt_row(f"test-{i:04d}", "test", meta)) + "\n")
    with open(root / "metadata.jsonl", "w") as f:
        for meta in test:
            f.write(json.dumps(meta) + "\n")
    return {"train_prompts": len(train), "test_prompts": len(test), "images": n_images}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Write the digits world dataset.")
    parser.add_argument("out")
    parser.add_argument("--cells", type=int, default=2)
    parser.add_argument("--channels", type=int, choices=(1, 3), default=3)
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--test-fraction", type=float, default=0.25)
    parser.add_argument("--max-per-tag", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    counts = write_world(
        args.out,
        args.cells,
        args.channels,
        args.copies,
        args.test_fraction,
        args.max_per_tag,
        args.seed,
    )
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
