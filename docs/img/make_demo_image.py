"""Make docs/img/demo_before_after.png: "draw the digit d" (rows d = 0..9, 8 samples each)
from the seed-initialised tiny model (left) and from the same recipe after a 300-update
text-to-image SFT (right), through `uniweave.generate.generate` (what `uniweave generate` runs).

    uniweave train recipes/digits/sft_vq.yaml 'data.tasks=[t2i]' 'data.task_weights=null' \\
        trainer.total_updates=300 run.name=demo_image_t2i
    python docs/img/make_demo_image.py runs/demo_image_t2i

Both sides share the trained run's codec (model.codec.path), so they decode codes alike;
the random-init side is the recipe's model built from run.seed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw

from uniweave.config import load_config
from uniweave.generate import generate

RECIPE = "recipes/digits/sft_vq.yaml"
N = 8
OUT = Path(__file__).parent / "demo_before_after.png"


def column(run: Path, trained: bool, tmp: Path) -> Image.Image:
    overrides = ["data.tasks=[t2i]", "data.task_weights=null", f"model.codec.path={run}/codec"]
    if trained:
        overrides.append(f"model.path={run}/model")
    cfg = load_config(RECIPE, overrides)
    rows = []
    for digit in range(10):
        summary = generate(cfg, f"draw the digit {digit}", N, tmp / f"{trained}-{digit}", True)
        rows.append(Image.open(summary["png"]).convert("L"))
    out = Image.new("L", (rows[0].width, sum(r.height for r in rows) + 2 * 9), 255)
    y = 0
    for row in rows:
        out.paste(row, (0, y))
        y += row.height + 2
    return out


def main(run: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        before, after = column(run, False, Path(tmp)), column(run, True, Path(tmp))
    top, gap = 22, 24
    canvas = Image.new("L", (before.width * 2 + gap, before.height + top), 255)
    canvas.paste(before, (0, top))
    canvas.paste(after, (before.width + gap, top))
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 4), "random init: 'draw the digit 0..9'", fill=0)
    draw.text((before.width + gap + 4, 4), "after 300 SFT updates", fill=0)
    canvas.save(OUT)
    print(OUT)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
