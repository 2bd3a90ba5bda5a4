"""How much a codec's round trip costs a digits classifier.

`codec_report(codec, classifier, split)` on the split's images x and labels y:
    mse                = mean over pixels of (decode(encode(x)) - x)^2
    acc_original       = accuracy of the classifier on x
    acc_reconstruction = accuracy of the classifier on decode(encode(x))
    acc_ratio          = acc_reconstruction / acc_original
    n                  = number of images

`python -m uniweave.rewards.codec_report` fits the classifier, a VQ and a BSQ codec on the train
split and prints the table for the test split with each fit's wall-clock seconds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from uniweave.codecs.base import ImageCodec
from uniweave.codecs.bsq import BSQCodec
from uniweave.codecs.vq import VQCodec
from uniweave.data.digits_images import Split, load_split
from uniweave.rewards.digit_classifier import DigitClassifier


def codec_report(codec: ImageCodec, classifier: DigitClassifier, split: Split = "test") -> dict:
    """Reconstruction MSE and classifier accuracy on originals vs reconstructions."""
    data = load_split(split)
    original = torch.from_numpy(data.images)
    recon = codec.reconstruct(original)
    acc_original = classifier.accuracy(original, data.labels)
    acc_reconstruction = classifier.accuracy(recon, data.labels)
    return {
        "mse": float((recon - original).pow(2).mean()),
        "acc_original": acc_original,
        "acc_reconstruction": acc_reconstruction,
        "acc_ratio": acc_reconstruction / acc_original if acc_original > 0 else float("nan"),
        "n": len(data),
    }


def _timed(fit: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fit()
    return result, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m uniweave.rewards.codec_report",
        description="Fit the digits classifier, a VQ and a BSQ codec on the train split "
        "and report reconstruction MSE and classifier accuracy on the test split.",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for every fit")
    parser.add_argument(
        "--save", type=Path, default=None, help="directory to save classifier/, vq/ and bsq/ into"
    )
    args = parser.parse_args(argv)

    train = load_split("train")
    classifier, clf_s = _timed(
        lambda: DigitClassifier().fit(train.images, train.labels, seed=args.seed)
    )
    codecs: dict[str, tuple[ImageCodec, float]] = {
        "vq": _timed(lambda: VQCodec().fit(train.images, seed=args.seed)),
        "bsq": _timed(lambda: BSQCodec().fit(train.images, seed=args.seed)),
    }
    print(f"classifier fit {clf_s:.1f}s on {len(train)} train images")
    header = f"{'codec':<6}{'detail':<22}{'mse':>9}{'acc_orig':>10}{'acc_rec':>9}{'ratio':>8}{'n':>6}{'fit_s':>8}"
    print(header)
    for name, (codec, seconds) in codecs.items():
        if isinstance(codec, VQCodec):
            detail = f"K={codec.codebook_size} grid={codec.grid[0]}x{codec.grid[1]}"
        else:
            assert isinstance(codec, BSQCodec), "the report compares a VQ and a BSQ codec"
            detail = f"L={codec.bits_per_position} grid={codec.grid[0]}x{codec.grid[1]}"
        r = codec_report(codec, classifier)
        print(
            f"{name:<6}{detail:<22}{r['mse']:>9.4f}{r['acc_original']:>10.3f}"
            f"{r['acc_reconstruction']:>9.3f}{r['acc_ratio']:>8.3f}{r['n']:>6}{seconds:>8.1f}"
        )
    if args.save is not None:
        classifier.save_pretrained(args.save / "classifier")
        for name, (codec, _) in codecs.items():
            codec.save_pretrained(args.save / name)
        print(f"saved classifier/, vq/ and bsq/ under {args.save}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
