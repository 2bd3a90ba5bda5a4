"""Write examples/colour_squares/: the small dataset the README's quickstart trains on.

"Which colour is the square?" on 8x8 RGB PNGs (a red, green or blue square of random size
and position on a dark background), answer `red` / `green` / `blue`, task `colour_qa`:
18 train rows (train.jsonl) and 9 test rows (test.jsonl), each colour equally often, in
the row format `data.path` reads (README "Your own data"). Seeded, so re-running it
rewrites the same files:

    python examples/make_colour_squares.py [OUT_DIR]    # default examples/colour_squares
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (20, 40, 230)}
SPLITS = {"train": 18, "test": 9}
QUESTION = "Which colour is the square?"


def square(rng: np.random.Generator, rgb: tuple[int, int, int]) -> np.ndarray:
    """An 8x8 RGB image: a square of side 3-6 at a random offset on a dark background."""
    pixels = np.full((8, 8, 3), rng.integers(0, 40), dtype=np.uint8)
    side = int(rng.integers(3, 7))
    top, left = (int(v) for v in rng.integers(0, 8 - side + 1, size=2))
    pixels[top : top + side, left : left + side] = rgb
    return pixels


def main(out: Path) -> None:
    rng = np.random.default_rng(0)
    (out / "images").mkdir(parents=True, exist_ok=True)
    for split, n in SPLITS.items():
        rows = []
        for i in range(n):
            name = list(COLOURS)[i % len(COLOURS)]
            image = f"images/{split}-{i:02d}.png"
            Image.fromarray(square(rng, COLOURS[name])).save(out / image)
            user = [{"type": "image", "path": image}, {"type": "text", "text": QUESTION}]
            rows.append(
                {
                    "id": f"{split}-{i:02d}",
                    "task": "colour_qa",
                    "answer": name,
                    "messages": [
                        {"role": "user", "content": user},
                        {"role": "assistant", "content": name},
                    ],
                }
            )
        text = "".join(json.dumps(row) + "\n" for row in rows)
        (out / f"{split}.jsonl").write_text(text)
        print(f"{out / f'{split}.jsonl'}: {n} rows")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "colour_squares")
