"""Off-target image statistics of the images a policy draws (issue 52 item 6): numbers an
image reward does not ask for, logged per update as `images/...`, so a reward that is
being hacked (paying for dark pixels, blank canvases, noise or copies of the input) shows
as a drift of what the images look like while the reward rises (the `off_target` alarm of
`uniweave.eval.health`; docs/reports.md).

The reward service (`uniweave.rewards.service`) measures every response image it decoded
for its plugins (so pixels are decoded once, and only when a plugin reads images); images
that could not be decoded are left out (they are counted in `reward/n_undecodable_images`).
Pixels are float in [0, 1], [H, W] (greyscale) or [H, W, C]. Per image:

- luminance Y [H, W]: the pixels of a greyscale image ([H, W] or C = 1); for C = 3 the
  Rec. 601 luma 0.299 R + 0.587 G + 0.114 B; for another C the mean over channels.
- `brightness`: the mean of Y.
- `edge_density`: with forward differences gx[i, j] = Y[i, j+1] − Y[i, j] and
  gy[i, j] = Y[i+1, j] − Y[i, j] on the (H−1) x (W−1) positions i < H−1, j < W−1, the
  share of those positions whose gradient magnitude sqrt(gx² + gy²) exceeds
  `EDGE_THRESHOLD` (0.1, a tenth of the intensity range). 0 for an image with H or W < 2.
- `colour_entropy`: the Shannon entropy (bits) of the image's colour histogram, divided by
  its maximum so it lies in [0, 1]. Greyscale (and C other than 3): Y in `GREY_BINS` (16)
  equal bins of [0, 1] (bin min(floor(16 Y), 15)), divided by log2(16) = 4. C = 3: each
  channel in `COLOUR_LEVELS` (4) equal bins, 4³ = 64 colours, divided by log2(64) = 6.
- near-`blank`: the population std of Y is below `BLANK_STD` (0.05): an almost uniform
  image (all black, all white, one flat tone). The embedded digits have Y std >= 0.31.
- `grey` (C = 3 only): the mean chroma max(R, G, B) − min(R, G, B) over the pixels is
  below `GREY_CHROMA` (0.05): a colour image with (almost) no colour.
- `noise`: edge density > `NOISE_EDGE` (0.5) and the neighbour correlation of Y below
  `NOISE_CORR` (0.25): many edges and no structure. The neighbour correlation is the
  Pearson correlation of the pairs (Y[i, j], Y[i, j+1]) and (Y[i, j], Y[i+1, j]) pooled
  (horizontal and vertical neighbours); an image whose pairs have zero variance is not
  noise. Measured on 8x8 images: uniform noise has correlation 0 ± 0.1 (at most 0.22 in
  200 draws) and edge density 0.97; the real digits 0.32 to 0.76 (mean 0.53) with edge
  density 0.74, so the bound sits between the two.
- `source_copy` (rows whose prompt holds an input image given as pixels; images given only
  as codes are not decoded for this and do not count): the drawn image copies an input
  image of its own row when their mean absolute pixel difference is below
  `SOURCE_COPY_MAE` (0.12) for one input of the same shape (height, width, channels;
  inputs of another shape never match). A drawn copy passes through the codec, so the
  bound must exceed the codec's reconstruction error: the embedded 16-code VQ codec
  reconstructs held-out digits to a mean absolute error of 0.08 (at most 0.112 over 200),
  while two different digit images differ by 0.24 on average.

Per update (`image_metrics`, from the summable counts of `image_counts`, so shards of a
batch add up before dividing): `images/n` (images measured), `images/brightness`,
`images/edge_density`, `images/colour_entropy` (means over the images), `images/blank_frac`
and `images/noise_frac` (shares of the images), `images/grey_frac` (share of the colour
images; logged only when there are some) and `images/source_copy_frac` (share of the
images drawn in rows with an input image; logged only when there are some). Every
statistic lies in [0, 1]; `OFF_TARGET` lists the ones the alarm watches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from uniweave.core.sample import ImagePart, Sample

EDGE_THRESHOLD = 0.1
GREY_BINS = 16
COLOUR_LEVELS = 4
BLANK_STD = 0.05
GREY_CHROMA = 0.05
NOISE_EDGE = 0.5
NOISE_CORR = 0.25
SOURCE_COPY_MAE = 0.12

PREFIX = "images/"
OFF_TARGET: tuple[str, ...] = (
    "images/brightness",
    "images/edge_density",
    "images/colour_entropy",
    "images/blank_frac",
    "images/grey_frac",
    "images/noise_frac",
    "images/source_copy_frac",
)
"""The per-update statistics the `off_target` health alarm watches (all in [0, 1])."""

Pixels = np.ndarray | torch.Tensor


def _array(pixels: Pixels) -> np.ndarray:
    if isinstance(pixels, torch.Tensor):
        pixels = pixels.detach().cpu().numpy()
    x = np.asarray(pixels, dtype=np.float64)
    if x.ndim not in (2, 3):
        raise ValueError(f"image pixels must be [H, W] or [H, W, C], got shape {list(x.shape)}")
    return x


def _is_colour(x: np.ndarray) -> bool:
    return x.ndim == 3 and x.shape[2] == 3


def luminance(pixels: Pixels) -> np.ndarray:
    """Y [H, W] float64 of an image (module docstring)."""
    x = _array(pixels)
    if x.ndim == 2:
        return x
    if _is_colour(x):
        return x @ np.array([0.299, 0.587, 0.114])
    return x.mean(axis=2)


def edge_density(y: np.ndarray) -> float:
    """Share of the (H−1) x (W−1) forward-difference positions of Y whose gradient
    magnitude exceeds `EDGE_THRESHOLD` (0 when H or W < 2)."""
    if y.shape[0] < 2 or y.shape[1] < 2:
        return 0.0
    gx = y[:-1, 1:] - y[:-1, :-1]
    gy = y[1:, :-1] - y[:-1, :-1]
    return float((np.sqrt(gx * gx + gy * gy) > EDGE_THRESHOLD).mean())


def _entropy(labels: np.ndarray, cells: int) -> float:
    counts = np.bincount(labels.ravel(), minlength=cells).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum() / math.log2(cells))


def colour_entropy(pixels: Pixels) -> float:
    """Normalised entropy of the colour histogram (module docstring), in [0, 1]."""
    x = _array(pixels)
    if _is_colour(x):
        q = np.minimum((x * COLOUR_LEVELS).astype(np.int64), COLOUR_LEVELS - 1)
        labels = (q[..., 0] * COLOUR_LEVELS + q[..., 1]) * COLOUR_LEVELS + q[..., 2]
        return _entropy(labels, COLOUR_LEVELS**3)
    y = luminance(x)
    return _entropy(np.minimum((y * GREY_BINS).astype(np.int64), GREY_BINS - 1), GREY_BINS)


def neighbour_correlation(y: np.ndarray) -> float | None:
    """Pearson correlation of the horizontal and vertical neighbour pairs of Y pooled;
    None without pairs or when either side of the pairs has zero variance."""
    a = np.concatenate([y[:, :-1].ravel(), y[:-1, :].ravel()])
    b = np.concatenate([y[:, 1:].ravel(), y[1:, :].ravel()])
    if a.size < 2:
        return None
    a, b = a - a.mean(), b - b.mean()
    denom = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    if denom <= 0.0:
        return None
    return float((a * b).sum()) / denom


def is_noise(y: np.ndarray) -> bool:
    """Edge density > `NOISE_EDGE` and neighbour correlation < `NOISE_CORR`."""
    corr = neighbour_correlation(y)
    return corr is not None and corr < NOISE_CORR and edge_density(y) > NOISE_EDGE


def is_grey(pixels: Pixels) -> bool | None:
    """Mean chroma (max − min over R, G, B) < `GREY_CHROMA`; None for a non-RGB image."""
    x = _array(pixels)
    if not _is_colour(x):
        return None
    return float((x.max(axis=2) - x.min(axis=2)).mean()) < GREY_CHROMA


def copy_distance(a: Pixels, b: Pixels) -> float | None:
    """Mean absolute pixel difference of two images of the same shape, else None."""
    x, z = _array(a), _array(b)
    if x.shape != z.shape:
        return None
    return float(np.abs(x - z).mean())


def input_pixels(sample: Sample) -> list[np.ndarray]:
    """The pixels of the input images of a row: its prompt's `ImagePart`s that carry
    pixels (code-only inputs are left out)."""
    return [
        p.pixels for p in sample.prompt_parts if isinstance(p, ImagePart) and p.pixels is not None
    ]


def image_counts(
    samples: Sequence[Sample], images: Sequence[Sequence[Pixels | None]]
) -> dict[str, float]:
    """Summable counts of the drawn images of a batch: row i is `samples[i]` and the
    decoded response images `images[i]` (None: not decodable, left out). Keys: n_images,
    sum_brightness, sum_edge_density, sum_colour_entropy, n_blank, n_noise, n_colour,
    n_grey, n_with_source, n_source_copy; {} when no image was measured."""
    if len(samples) != len(images):
        raise ValueError(f"image_counts: {len(samples)} samples, {len(images)} image lists")
    out = dict.fromkeys(
        ("n_images", "sum_brightness", "sum_edge_density", "sum_colour_entropy", "n_blank",
         "n_noise", "n_colour", "n_grey", "n_with_source", "n_source_copy"),
        0.0,
    )  # fmt: skip
    for sample, row_images in zip(samples, images):
        drawn = [px for px in row_images if px is not None]
        sources = input_pixels(sample) if drawn else []
        for px in drawn:
            x = _array(px)
            y = luminance(x)
            out["n_images"] += 1
            out["sum_brightness"] += float(y.mean())
            out["sum_edge_density"] += edge_density(y)
            out["sum_colour_entropy"] += colour_entropy(x)
            out["n_blank"] += float(y.std() < BLANK_STD)
            out["n_noise"] += float(is_noise(y))
            grey = is_grey(x)
            if grey is not None:
                out["n_colour"] += 1
                out["n_grey"] += float(grey)
            if sources:
                out["n_with_source"] += 1
                dists = [d for d in (copy_distance(x, s) for s in sources) if d is not None]
                out["n_source_copy"] += float(any(d < SOURCE_COPY_MAE for d in dists))
    return out if out["n_images"] else {}


def merge_counts(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The counts of a batch from those of its shards (summed key by key)."""
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def image_metrics(counts: Mapping[str, float]) -> dict[str, float]:
    """The `images/...` metrics of a batch's `image_counts` (module docstring); {} when no
    image was measured."""
    n = counts.get("n_images", 0.0)
    if not n:
        return {}
    out = {
        "images/n": float(n),
        "images/brightness": counts["sum_brightness"] / n,
        "images/edge_density": counts["sum_edge_density"] / n,
        "images/colour_entropy": counts["sum_colour_entropy"] / n,
        "images/blank_frac": counts["n_blank"] / n,
        "images/noise_frac": counts["n_noise"] / n,
    }
    if counts.get("n_colour", 0.0):
        out["images/grey_frac"] = counts["n_grey"] / counts["n_colour"]
    if counts.get("n_with_source", 0.0):
        out["images/source_copy_frac"] = counts["n_source_copy"] / counts["n_with_source"]
    return out
