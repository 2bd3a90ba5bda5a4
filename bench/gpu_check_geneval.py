"""Device check of GenEval scoring with the real checkpoints (not part of CI).

On a CUDA GPU with the checkpoints in the hub cache (or given as local directories), it
writes a small folder in GenEval's layout — 4 prompts x 4 images of coloured shapes on a
plain background, or `--images DIR` (a folder of your own) — and scores it with
`uniweave score`'s code twice: Mask2Former Swin-S COCO + CLIP ViT-L/14 colour, and OWLv2.
It prints GenEval's table, the seconds per image, and checks that a batched detector pass
gives the detections of one-by-one passes (same labels, boxes within 1 pixel, scores within 1e-4:
cuDNN/TF32 kernels may reorder sums between batch sizes). Each check ends with a line
`CHECK | name | PASS/FAIL | ...`.

Without a GPU, or when a checkpoint is neither a local directory nor in the hub cache, it
prints `SKIP: <why>` and exits 0.

    python bench/gpu_check_geneval.py [--images DIR] [--out DIR]
        [--mask2former facebook/mask2former-swin-small-coco-instance]
        [--owlv2 google/owlv2-base-patch16-ensemble] [--clip openai/clip-vit-large-patch14]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from uniweave.config import ConfigError
from uniweave.config.hub import resolve
from uniweave.eval.geneval.folder import load_image, read_folder
from uniweave.eval.geneval.score import score_folder
from uniweave.rewards.geneval.colour import ClipColourClassifier
from uniweave.rewards.geneval.detectors import load_detector
from uniweave.rewards.geneval.scorer import GenEvalScorer

ROWS = [
    {"tag": "single_object", "prompt": "a photo of a frisbee",
     "include": [{"class": "frisbee", "count": 1}]},
    {"tag": "colors", "prompt": "a photo of a red stop sign",
     "include": [{"class": "stop sign", "count": 1, "color": "red"}]},
    {"tag": "counting", "prompt": "a photo of two sports balls",
     "include": [{"class": "sports ball", "count": 2}],
     "exclude": [{"class": "sports ball", "count": 3}]},
    {"tag": "position", "prompt": "a photo of a clock right of a book",
     "include": [{"class": "book", "count": 1},
                 {"class": "clock", "count": 1, "position": ["right of", 0]}]},
]  # fmt: skip
SCORE_BOUND = 1e-4


def write_images(root: Path, size: int = 512, per_prompt: int = 4) -> Path:
    """Coloured discs and boxes on a light background, one prompt folder per row."""
    rng = np.random.default_rng(0)
    for index, row in enumerate(ROWS):
        folder = root / f"{index:05d}"
        (folder / "samples").mkdir(parents=True)
        (folder / "metadata.jsonl").write_text(json.dumps(row))
        for n in range(per_prompt):
            image = Image.new("RGB", (size, size), (235, 232, 225))
            draw = ImageDraw.Draw(image)
            for _ in range(1 + index % 3):
                x, y = rng.integers(40, size - 200, 2)
                w = int(rng.integers(80, 180))
                colour = tuple(int(c) for c in rng.integers(0, 256, 3))
                (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(
                    [x, y, x + w, y + w], fill=colour
                )
            image.save(folder / "samples" / f"{n:04d}.png")
    return root


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"CHECK | {name} | {'PASS' if ok else 'FAIL'} | {detail}", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", default=None, help="a GenEval-layout folder to score")
    parser.add_argument("--out", default=None, help="output folder (default: a temp dir)")
    parser.add_argument("--mask2former", default="facebook/mask2former-swin-small-coco-instance")
    parser.add_argument("--owlv2", default="google/owlv2-base-patch16-ensemble")
    parser.add_argument("--clip", default="openai/clip-vit-large-patch14")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA GPU; this check scores with the real checkpoints on a GPU")
        return 0
    try:
        paths = {k: resolve(getattr(args, k), f"--{k}") for k in ("mask2former", "owlv2", "clip")}
    except ConfigError as err:
        print(f"SKIP: a checkpoint is not available here: {err}")
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="geneval_gpu_"))
    images = Path(args.images) if args.images else write_images(out / "images")
    colours = ClipColourClassifier(paths["clip"], "cuda")
    ok = True
    for kind in ("mask2former", "owlv2"):
        detector = load_detector(kind, paths[kind], "cuda", batch_size=8)
        folder = read_folder(images, detector.classes)
        start = time.perf_counter()
        result = score_folder(folder, GenEvalScorer(detector, colours), out / f"scores_{kind}")
        seconds = (time.perf_counter() - start) / max(len(folder.samples), 1)
        print((out / f"scores_{kind}" / "summary.txt").read_text())
        ok &= check(f"{kind} scores", result.summary is not None,
                    f"{result.judged} images, {seconds:.3f} s/image")  # fmt: skip
        sample = [load_image(s.path) for s in folder.samples[:4]]
        batched = detector.detect(sample, min_score=0.3)
        single = [detector.detect([im], min_score=0.3)[0] for im in sample]
        worst, same = 0.0, True
        for a, b in zip(batched, single):
            same &= [d.label for d in a] == [d.label for d in b]
            same &= len(a) == len(b) and all(
                np.allclose(x.box, y.box, atol=1.0) for x, y in zip(a, b)
            )
            worst = max([worst, *(abs(x.score - y.score) for x, y in zip(a, b))])
        ok &= check(f"{kind} batch = one by one", same and worst <= SCORE_BOUND,
                    f"labels/boxes equal: {same}, max score diff {worst:.2e}")  # fmt: skip
    print(f"outputs in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
