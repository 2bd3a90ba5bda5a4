"""Janus-Pro images: input checks and normalisation, and the VQ-16 tokenizer as a uniweave
codec.

Pixels are float RGB [H, W, 3] in [0, 1], kept in colour (dataset images arrive so from
`uniweave.data.images.RGBProcessor`), or grey [H, W], whose value is copied into each of R, G
and B; nothing is ever converted to grey. They must have exactly the processor's size
(384 x 384 for Janus-Pro; the dataset loader resizes only under
`data.image_resize=resize`). Both the SigLIP tower and the VQ encoder read them
normalised per channel c with the processor's mean and std, x'_c = (x_c - mean_c) / std_c;
VQ decoding inverts that, x = clip(x' * std + mean, 0, 1), as
`JanusImageProcessor.postprocess` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import JanusForConditionalGeneration


class PixelSpec:
    """Size and normalisation of Janus-Pro's image inputs (from its image processor)."""

    def __init__(self, size: int, mean: Sequence[float], std: Sequence[float]) -> None:
        self.size = int(size)
        self.mean = torch.tensor([float(m) for m in mean]).view(3, 1, 1)
        self.std = torch.tensor([float(s) for s in std]).view(3, 1, 1)

    def check(self, pixels: np.ndarray, where: str) -> np.ndarray:
        """float32 RGB [S, S, 3] in [0, 1] (grey [S, S] copied into three channels);
        ValueError naming `where` for any other image."""
        px = np.asarray(pixels)
        s = self.size
        if px.ndim == 2:  # grey: the same value in R, G and B
            px = np.stack([px, px, px], axis=-1)
        if px.ndim != 3 or px.shape[2] != 3:
            raise ValueError(
                f"{where}: expected an image [H, W] or [H, W, 3], got shape {tuple(px.shape)}"
            )
        if px.shape[:2] != (s, s):
            raise ValueError(
                f"{where}: image is {px.shape[0]}x{px.shape[1]} pixels; Janus-Pro reads "
                f"{s}x{s} (resize it first)"
            )
        if not np.issubdtype(px.dtype, np.floating) or not np.isfinite(px).all():
            raise ValueError(f"{where}: pixels must be finite floats in [0, 1]")
        if px.min() < 0.0 or px.max() > 1.0:
            raise ValueError(f"{where}: pixels must lie in [0, 1]")
        return px.astype(np.float32, copy=False)

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """RGB [N, S, S, 3] (or grey [N, S, S], copied into three channels) in [0, 1]
        -> normalised [N, 3, S, S], per channel (module docstring)."""
        if pixels.dim() == 3:
            pixels = torch.stack([pixels, pixels, pixels], dim=-1)
        x = pixels.permute(0, 3, 1, 2).float()
        return (x - self.mean.to(x.device)) / self.std.to(x.device)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised [N, 3, S, S] -> pixels [N, S, S, 3] in [0, 1]."""
        x = x.float() * self.std.to(x.device) + self.mean.to(x.device)
        return x.clamp(0.0, 1.0).permute(0, 2, 3, 1)


class JanusVQCodec:
    """The VQ-16 image tokenizer of a Janus-Pro model as a uniweave codec (kind "vq").

    `encode(pixels [N, S, S(, 3)] in [0, 1]) -> codes long [N, g, g]`;
    `decode(codes [N, g, g] | [N, g*g]) -> pixels float [N, S, S, 3] in [0, 1]`
    (ValueError for codes that are not a full grid of valid indices). Both run without
    gradients on the model's device.
    """

    kind = "vq"

    def __init__(self, hf: JanusForConditionalGeneration, spec: PixelSpec) -> None:
        self._hf = hf
        self.spec = spec
        vq: Any = hf.config.vq_config  # transformers types sub-configs as dict | config | None
        self.codebook_size = int(vq.num_embeddings)
        side = int(vq.num_patches)
        self.grid = (side, side)
        self.image_size = (spec.size, spec.size)

    @property
    def _vq(self):
        return self._hf.model.vqmodel

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
        px = torch.as_tensor(np.asarray(pixels, dtype=np.float32))
        if px.dim() not in (3, 4) or tuple(px.shape[1:3]) != self.image_size:
            raise ValueError(
                f"encode: expected pixels [N, {self.spec.size}, {self.spec.size}(, 3)], "
                f"got {tuple(px.shape)}"
            )
        param = next(self._vq.parameters())
        x = self.spec.normalize(px.to(param.device)).to(param.dtype)
        tokens = self._vq.encode(x).image_tokens
        return tokens.reshape(px.shape[0], *self.grid).long()

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        n_tokens = self.grid[0] * self.grid[1]
        if codes.dim() < 2 or codes[0].numel() != n_tokens:
            raise ValueError(
                f"decode: Janus-Pro decodes {self.grid[0]}x{self.grid[1]} grids, got codes "
                f"of shape {tuple(codes.shape)}"
            )
        flat = codes.reshape(codes.shape[0], n_tokens).long()
        if (flat < 0).any() or (flat >= self.codebook_size).any():
            raise ValueError(f"decode: codes must lie in [0, {self.codebook_size})")
        param = next(self._vq.parameters())
        decoded = self._vq.decode(flat.to(param.device))
        return self.spec.denormalize(decoded).cpu()
