"""UniAR's reading path: understanding images through Qwen3-VL's own image processor and
vision tower (patch embed, blocks, merger, DeepStack features), in colour.

Pixels are float RGB [H, W, 3] in [0, 1] (grey [H, W] is copied into R, G and B; nothing
is ever converted to grey). The Qwen image processor (`Qwen2VLImageProcessorPil`, loaded
with the checkpoint) resizes them to a multiple of patch x merge, normalises them with its
mean/std and flattens them into patches: `pixel_values` [sum(t*h*w), C*tp*p*p] and
`image_grid_thw` [n, 3] (in patches). An image fills (h/merge) x (w/merge) placeholder
positions (`<|image_pad|>`, TEXT modality) of the token stream; the tower's merged
features replace their embeddings and its DeepStack features are added to the first
decoder layers' outputs there, as `Qwen3VLModel.forward` does.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

ProcessedImages = tuple[torch.Tensor, torch.Tensor]
"""(pixel_values [sum t*h*w, C*tp*p*p], image_grid_thw long [n, 3])."""


def check_pixels(pixels: np.ndarray | torch.Tensor, where: str) -> np.ndarray:
    """float32 RGB [H, W, 3] in [0, 1] (grey [H, W] copied into three channels);
    ValueError naming `where` for anything else."""
    px = np.asarray(pixels.detach().cpu() if isinstance(pixels, torch.Tensor) else pixels)
    if px.ndim == 2:
        px = np.stack([px, px, px], axis=-1)
    if px.ndim != 3 or px.shape[2] != 3:
        raise ValueError(f"{where}: expected an image [H, W] or [H, W, 3], got {px.shape}")
    if not np.issubdtype(px.dtype, np.floating) or not np.isfinite(px).all():
        raise ValueError(f"{where}: pixels must be finite floats in [0, 1]")
    if px.size == 0 or px.min() < 0.0 or px.max() > 1.0:
        raise ValueError(f"{where}: pixels must lie in [0, 1]")
    return px.astype(np.float32, copy=False)


class VisionInputs:
    """The image processor of a checkpoint as a function of pixels, with a small cache
    keyed by the pixels' bytes (a GRPO group's members share their image)."""

    def __init__(self, processor, merge_size: int) -> None:
        self.processor = processor
        self.merge = int(merge_size)
        self._cache: dict[bytes, ProcessedImages] = {}

    def _one(self, pixels: np.ndarray | torch.Tensor) -> ProcessedImages:
        px = check_pixels(pixels, "image")
        key = hashlib.blake2b(px.tobytes() + str(px.shape).encode(), digest_size=16).digest()
        hit = self._cache.get(key)
        if hit is None:
            out = self.processor(images=[px], return_tensors="pt", do_rescale=False)
            hit = (out["pixel_values"], out["image_grid_thw"].long())
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[key] = hit
        return hit

    def grid(self, pixels: np.ndarray | torch.Tensor) -> tuple[int, int, int]:
        """(t, h, w) in patches of one image (the `image_grid_thw` row)."""
        t, h, w = self._one(pixels)[1][0].tolist()
        return int(t), int(h), int(w)

    def n_tokens(self, pixels: np.ndarray | torch.Tensor) -> int:
        """Placeholder positions the image fills: t * (h/merge) * (w/merge)."""
        t, h, w = self.grid(pixels)
        return t * (h // self.merge) * (w // self.merge)

    def __call__(self, images: list[torch.Tensor]) -> ProcessedImages:
        """(pixel_values, image_grid_thw) of `images`, in order."""
        parts = [self._one(x) for x in images]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
