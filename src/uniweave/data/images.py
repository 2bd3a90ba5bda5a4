"""Dataset images as a model sees them: read in colour, then each model's own processor.

`read_rgb(path)` reads any image PIL opens as float32 RGB [H, W, 3] in [0, 1]
(value / 255). Single-channel and palette images are expanded to RGB exactly; an alpha
channel is dropped (PIL's RGBA -> RGB); CMYK goes through PIL's conversion. 16-bit
greyscale (PIL modes I;16*, I) is value / 65535 and float greyscale (F) must lie in
[0, 1] (PIL's own conversion would clip the first at 255 and truncate the second).
Nothing else is converted here.

A processor turns those RGB pixels into the pixels a model's codec / vision tower takes:

- `GreyscaleProcessor(size)` (the tiny model, whose codec is fitted on 8x8 greyscale
  digits): luma Y = 0.299 R + 0.587 G + 0.114 B (ITU-R BT.601, PIL's "L" weights),
  float32 [H, W]. It counts the colour images it converted (an image whose three
  channels are not all equal) and the loader logs that count.
- `RGBProcessor(size)` (Janus-Pro and other colour models): float32 [H, W, 3] in [0, 1];
  the model's own processor normalises (e.g. SigLIP's mean/std) when it embeds them.

Both check the size first: with `resize="error"` an image of another size is a
`ValueError` naming it; with `resize="resize"` it is resized (bicubic, per channel, in
float, clipped to [0, 1]) and counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from uniweave.core.status import log_once

logger = logging.getLogger(__name__)

Resize = Literal["resize", "error"]
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def read_rgb(path: str | Path) -> np.ndarray:
    """float32 [H, W, 3] in [0, 1] (module docstring); PIL's errors propagate."""
    with Image.open(path) as image:
        if image.mode.startswith("I") or image.mode == "F":
            return _wide_grey(image, str(path))
        rgb = image.convert("RGB")
    return np.asarray(rgb, dtype=np.float32) / np.float32(255.0)


def _wide_grey(image: Image.Image, name: str) -> np.ndarray:
    """A 16/32-bit integer or float greyscale image as RGB in [0, 1]: integers are read
    as 16-bit (value / 65535; PIL's own conversion to RGB clips them at 255), floats
    must already lie in [0, 1]; anything else is a ValueError naming the image."""
    values = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        if values.size and not (values.min() >= 0.0 and values.max() <= 1.0):
            raise ValueError(
                f"image {name!r}: float pixels outside [0, 1] ({values.min()}..{values.max()})"
            )
        grey = values
    else:
        if values.size and not (values.min() >= 0 and values.max() <= 65535):
            raise ValueError(f"image {name!r}: {image.mode} pixels outside 0..65535")
        grey = values / 65535.0
    return np.repeat(grey.astype(np.float32)[..., None], 3, axis=-1)


def _resize(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    h, w = size
    channels = [
        np.asarray(
            Image.fromarray(pixels[..., c], mode="F").resize((w, h), Image.Resampling.BICUBIC)
        )
        for c in range(pixels.shape[-1])
    ]
    return np.clip(np.stack(channels, axis=-1), 0.0, 1.0).astype(np.float32)


@dataclass
class _Sized:
    """Size check / resize shared by the processors, with counts."""

    size: tuple[int, int]
    resize: Resize = "error"
    n_images: int = field(default=0, init=False)
    n_resized: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.resize not in ("resize", "error"):
            raise ValueError(f"resize must be 'resize' or 'error', got {self.resize!r}")

    def counts(self) -> dict[str, int]:
        """The counts so far (`n_*` fields): a read's own counts are the difference of
        two of these (`log_summary`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name.startswith("n_")}

    def fit(self, rgb: np.ndarray, name: str) -> np.ndarray:
        """`rgb` [H, W, 3] at `size`: as is, resized, or ValueError (data.image_resize)."""
        if rgb.ndim != 3 or rgb.shape[-1] != 3:
            raise ValueError(f"image {name!r} must be RGB [H, W, 3], got {list(rgb.shape)}")
        self.n_images += 1
        h, w = self.size
        if rgb.shape[:2] == (h, w):
            return rgb
        if self.resize == "error":
            raise ValueError(
                f"image {name!r} is {rgb.shape[0]}x{rgb.shape[1]}; the model takes {h}x{w} "
                "pixels (height x width); set data.image_resize=resize to resize it"
            )
        self.n_resized += 1
        return _resize(rgb, self.size)


@dataclass
class GreyscaleProcessor(_Sized):
    """RGB -> luma [H, W] at `size` (the tiny model's documented conversion)."""

    n_colour: int = field(default=0, init=False)

    def __call__(self, rgb: np.ndarray, name: str = "image") -> np.ndarray:
        rgb = self.fit(rgb, name)
        if not (
            np.array_equal(rgb[..., 0], rgb[..., 1]) and np.array_equal(rgb[..., 1], rgb[..., 2])
        ):
            self.n_colour += 1
        return np.clip(rgb @ LUMA, 0.0, 1.0).astype(np.float32)

    def summary(self, n: dict[str, int]) -> str:
        """The line of counts `n` (`counts()`, or a read's share of them)."""
        return (
            f"{n['n_images']} images for a greyscale {self.size[0]}x{self.size[1]} model: "
            f"{n['n_colour']} colour images converted to greyscale (BT.601 luma), "
            f"{n['n_resized']} resized"
        )


@dataclass
class RGBProcessor(_Sized):
    """RGB [H, W, 3] at `size`, unchanged otherwise (colour models)."""

    def __call__(self, rgb: np.ndarray, name: str = "image") -> np.ndarray:
        return self.fit(rgb, name)

    def summary(self, n: dict[str, int]) -> str:
        """The line of counts `n` (`counts()`, or a read's share of them)."""
        return (
            f"{n['n_images']} RGB images at {self.size[0]}x{self.size[1]}: {n['n_resized']} resized"
        )


ImageProcessor = GreyscaleProcessor | RGBProcessor


def processor_for(
    model_kind: str, size: tuple[int, int], resize: Resize = "error", channels: int = 1
) -> ImageProcessor:
    """The processor of a model kind: greyscale for `tiny` with a one-channel codec (the
    digits), RGB for a tiny model whose codec has `channels` 3 and every other model."""
    size = (int(size[0]), int(size[1]))
    if model_kind == "tiny" and channels == 1:
        return GreyscaleProcessor(size, resize)
    return RGBProcessor(size, resize)


def log_summary(
    processor: ImageProcessor, dataset: str, before: dict[str, int] | None = None
) -> None:
    """Log the counts (colour images converted, images resized) of one read of `dataset`
    (the processor's counts less `before`, its `counts()` when the read began), once per
    run (`uniweave.core.status.log_once`): a run reads the same rows for preflight,
    training, the baseline and each evaluation, with one processor whose counts add up,
    and the same counts said again are noise."""
    n = {k: v - (before or {}).get(k, 0) for k, v in processor.counts().items()}
    if n["n_images"]:
        level = logging.WARNING if n.get("n_colour", 0) else logging.INFO
        log_once(logger, level, f"{dataset}: {processor.summary(n)}")
