"""Write the `shape_name` example dataset: 8x8 colour PNGs of one shape each and the
question "Which shape is drawn?" (answers circle / square / triangle / cross: words
outside the digits vocabulary, a task no built-in knows).

    python examples/make_shapes.py examples/shapes   # shipped; recipes/examples/shapes_*.yaml read it

One JSONL file `shapes.jsonl` holds every split (`split`: 40 train, 12 val, 20 test rows,
shapes balanced within each split); images are `images/<id>.png`. Each shape is drawn in
a random saturated colour (hue uniform, brightness 0.6-1) on black, at a random offset;
the rows are a pure function of `--seed`.
"""

from __future__ import annotations

import argparse
import colorsys
import json
from pathlib import Path

import numpy as np
from PIL import Image

SHAPES = ("circle", "square", "triangle", "cross")
SPLITS = {"train": 40, "val": 12, "test": 20}
QUESTION = "Which shape is drawn?"


def mask(shape: str, size: int) -> np.ndarray:
    """bool [size, size]: the shape filling its box."""
    yy, xx = np.mgrid[:size, :size]
    c = (size - 1) / 2
    if shape == "circle":
        r = np.hypot(yy - c, xx - c)
        return (r <= c + 0.3) & (r >= c - 1.2)
    if shape == "square":
        return np.ones((size, size), dtype=bool)
    if shape == "triangle":
        return np.abs(xx - c) <= (yy + 0.5) / 2
    return (np.abs(yy - c) < 1) | (np.abs(xx - c) < 1)


def draw(shape: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 RGB [8, 8, 3]: `shape` of side 5 or 6, random colour and offset."""
    size = int(rng.integers(5, 7))
    y, x = rng.integers(0, 8 - size + 1, size=2)
    colour = np.array(colorsys.hsv_to_rgb(rng.random(), 1.0, rng.uniform(0.6, 1.0)))
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    image[y : y + size, x : x + size][mask(shape, size)] = np.round(colour * 255)
    return image


def write(root: Path, seed: int = 0) -> Path:
    """The dataset under `root`; returns the JSONL path."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for split, n in SPLITS.items():
        for i in range(n):
            shape = SHAPES[i % len(SHAPES)]
            sid = f"{split}-{i:02d}"
            Image.fromarray(draw(shape, rng)).save(root / "images" / f"{sid}.png")
            user = [
                {"type": "image", "path": f"images/{sid}.png"},
                {"type": "text", "text": QUESTION},
            ]
            rows.append(
                {
                    "id": sid,
                    "task": "shape_name",
                    "split": split,
                    "answer": shape,
                    "messages": [
                        {"role": "user", "content": user},
                        {"role": "assistant", "content": shape},
                    ],
                }
            )
    path = root / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write(args.root, args.seed))
