"""scikit-learn's real 8x8 handwritten digits, split deterministically by image.

The 1,797 scans ship inside scikit-learn (no download). Pixels are scaled from the
original 0..16 range to [0, 1]. The split is a fixed permutation (seed 0) of the image
indices: 70% train, 15% val, 15% test, so no image appears in two splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from uniweave.config.schema import SPLITS, Split

IMAGE_SIZE = 8
_FRACTIONS = (0.70, 0.15)


@dataclass(frozen=True)
class DigitImages:
    """Images of one split: `images` float32 [N, 8, 8] in [0, 1], `labels` int64 [N],
    `indices` int64 [N] (row numbers in scikit-learn's dataset)."""

    images: np.ndarray
    labels: np.ndarray
    indices: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@lru_cache(maxsize=1)
def _all_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images.astype(np.float32) / 16.0).clip(0.0, 1.0)
    return images, bunch.target.astype(np.int64)


def split_indices(split: Split) -> np.ndarray:
    """Row indices of `split` in scikit-learn's digits dataset (deterministic)."""
    if split not in SPLITS:
        raise ValueError(f"unknown digits split {split!r}; expected one of {', '.join(SPLITS)}")
    images, _ = _all_digits()
    n = images.shape[0]
    order = np.random.default_rng(0).permutation(n)
    n_train = int(round(_FRACTIONS[0] * n))
    n_val = int(round(_FRACTIONS[1] * n))
    bounds = {
        "train": (0, n_train),
        "val": (n_train, n_train + n_val),
        "test": (n_train + n_val, n),
    }[split]
    return np.sort(order[bounds[0] : bounds[1]])


def load_split(split: Split) -> DigitImages:
    """The images and labels of one split."""
    images, labels = _all_digits()
    idx = split_indices(split)
    return DigitImages(images=images[idx].copy(), labels=labels[idx].copy(), indices=idx)
