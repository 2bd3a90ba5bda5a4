"""Vector-quantised codec: a k-means codebook over p x p pixel patches.

An H x W image with C channels (the codec's `image_size` and `channels`; default the 8x8
greyscale digits) is cut into (H/p) x (W/p) patches of p*p*C values (default p = 2: an 8x8
digit is a 4x4 grid of 4-pixel patches; a 16x16 RGB canvas an 8x8 grid of 12-value
patches). Each patch is replaced by the index of its nearest codeword
(squared Euclidean distance, ties to the lowest index); decoding pastes the codewords back.
The codebook is fitted by Lloyd's k-means with k-means++ initialisation (D^2 sampling),
`n_init` restarts keeping the lowest inertia, all drawn from one seeded torch.Generator.
"""

from __future__ import annotations

from typing import Any

import torch

from uniweave.codecs.base import (
    ArrayLike,
    ImageCodec,
    as_tensor,
    from_patches,
    single_thread,
    to_patches,
)

DEFAULT_CODEBOOK_SIZE = 32


DIST_ROWS = 512
"""Rows of x per block of `_sq_dists`: the [rows, K, D] differences stay in cache."""


def _sq_dists(x: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """Squared distances [N, K] between rows of x [N, D] and centers [K, D]:
    d[n, k] = sum_d (x[n, d] - centers[k, d])^2, torch's sum over d, evaluated in blocks of
    `DIST_ROWS` rows (a row's value does not depend on the blocking)."""
    out = torch.empty(x.shape[0], centers.shape[0], dtype=torch.result_type(x, centers))
    for start in range(0, x.shape[0], DIST_ROWS):
        block = x[start : start + DIST_ROWS].unsqueeze(1) - centers.unsqueeze(0)
        torch.sum(block.square_(), dim=-1, out=out[start : start + DIST_ROWS])
    return out


def kmeans_pp_init(x: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++: first centre uniform, each next one drawn with probability ~ D(x)^2."""
    n = x.shape[0]
    first = int(torch.randint(n, (1,), generator=generator))
    centers = [x[first]]
    d2 = (x - x[first]).pow(2).sum(-1)
    for _ in range(1, k):
        total = float(d2.sum())
        weights = d2 if total > 0 else torch.ones_like(d2)
        idx = int(torch.multinomial(weights, 1, generator=generator))
        centers.append(x[idx])
        d2 = torch.minimum(d2, (x - x[idx]).pow(2).sum(-1))
    return torch.stack(centers)


def kmeans(
    x: torch.Tensor, k: int, generator: torch.Generator, max_iter: int = 100
) -> tuple[torch.Tensor, float]:
    """Lloyd's algorithm from a k-means++ start; returns (centers [k, D], inertia).

    An empty cluster is re-seeded with the point farthest from its current centre.
    Stops when assignments no longer change or after `max_iter` iterations. Distances are
    computed once per distinct row of x and gathered back to every row (the same values).
    """
    centers = kmeans_pp_init(x, k, generator)
    points, inverse = torch.unique(x, dim=0, return_inverse=True)

    def nearest_d2() -> torch.Tensor:
        return _sq_dists(points, centers).min(dim=1).values[inverse]

    assign = torch.full((x.shape[0],), -1, dtype=torch.long)
    for _ in range(max_iter):
        new_assign = _sq_dists(points, centers).argmin(dim=1)[inverse]
        if torch.equal(new_assign, assign):
            break
        assign = new_assign
        counts = torch.bincount(assign, minlength=k)
        sums = torch.zeros_like(centers).index_add_(0, assign, x)
        centers = sums / counts.clamp(min=1).unsqueeze(1).to(x.dtype)
        for empty in torch.nonzero(counts == 0).flatten().tolist():
            centers[empty] = x[int(nearest_d2().argmax())]
    inertia = float(nearest_d2().sum())
    return centers, inertia


class VQCodec(ImageCodec):
    """Codebook of `codebook_size` codewords over `patch` x `patch` pixel patches.

    encode: pixels [N, H, W(, C)] -> long [N, H/p, W/p] in [0, codebook_size);
    decode: long codes -> float32 [N, H, W(, C)] in [0, 1].
    """

    kind = "vq"

    def __init__(
        self,
        codebook_size: int = DEFAULT_CODEBOOK_SIZE,
        patch: int = 2,
        n_init: int = 4,
        max_iter: int = 100,
        image_size: tuple[int, int] | list[int] = (8, 8),
        channels: int = 1,
    ) -> None:
        self._set_geometry(image_size, channels)
        if codebook_size < 2:
            raise ValueError(f"codebook_size must be >= 2, got {codebook_size}")
        if patch < 1 or self.image_size[0] % patch or self.image_size[1] % patch:
            raise ValueError(f"patch must divide the image size {self.image_size}, got {patch}")
        if n_init < 1 or max_iter < 1:
            raise ValueError(f"n_init and max_iter must be >= 1, got {n_init} and {max_iter}")
        self.codebook_size = int(codebook_size)
        self.patch = int(patch)
        self.n_init = int(n_init)
        self.max_iter = int(max_iter)
        self.codebook: torch.Tensor | None = None

    @property
    def grid(self) -> tuple[int, int]:
        return (self.image_size[0] // self.patch, self.image_size[1] // self.patch)

    @property
    def patch_dim(self) -> int:
        """Values per patch: p*p*channels."""
        return self.patch * self.patch * self.channels

    @property
    def is_fitted(self) -> bool:
        return self.codebook is not None

    @property
    def _fitted_codebook(self) -> torch.Tensor:
        """The codebook (after `fit` or loading)."""
        assert self.codebook is not None, "the VQ codec is not fitted"
        return self.codebook

    def fit(self, images: ArrayLike, seed: int = 0) -> VQCodec:
        """Fit the codebook on every patch of `images` (float64 k-means, stored float32)."""
        pixels = self._pixels(images)
        x = to_patches(pixels, self.patch).reshape(-1, self.patch_dim).double()
        if x.shape[0] < self.codebook_size:
            raise ValueError(
                f"need at least codebook_size={self.codebook_size} patches to fit, "
                f"got {x.shape[0]} from {pixels.shape[0]} images"
            )
        generator = torch.Generator().manual_seed(seed)
        best, best_inertia = None, float("inf")
        with single_thread():
            for _ in range(self.n_init):
                centers, inertia = kmeans(x, self.codebook_size, generator, self.max_iter)
                if inertia < best_inertia:
                    best, best_inertia = centers, inertia
        assert best is not None, "n_init >= 1 k-means runs"
        self.codebook = best.float().clamp(0.0, 1.0)
        return self

    def encode(self, pixels: ArrayLike) -> torch.Tensor:
        """Nearest codeword per patch: long [N, gh, gw]."""
        self._check_fitted()
        x = to_patches(self._pixels(pixels), self.patch)
        n, gh, gw, d = x.shape
        return _sq_dists(x.reshape(-1, d), self._fitted_codebook).argmin(dim=1).reshape(n, gh, gw)

    def decode(self, codes: ArrayLike) -> torch.Tensor:
        """Codewords pasted back into images: float32 [N, H, W(, C)]."""
        self._check_fitted()
        codes = as_tensor(codes)
        gh, gw = self.grid
        if codes.dim() != 3 or tuple(codes.shape[1:]) != (gh, gw) or codes.shape[0] == 0:
            raise ValueError(
                f"VQ codes must have shape [N, {gh}, {gw}] with N >= 1, got {list(codes.shape)}"
            )
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise ValueError(f"VQ codes must be an integer tensor, got dtype {codes.dtype}")
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= self.codebook_size:
            raise ValueError(
                f"VQ codes must lie in [0, {self.codebook_size}), got min {lo} and max {hi}"
            )
        patches = self._fitted_codebook[codes.long()]
        return from_patches(patches, self.patch, self.channels)

    def config(self) -> dict[str, Any]:
        return {
            "codebook_size": self.codebook_size,
            "patch": self.patch,
            "n_init": self.n_init,
            "max_iter": self.max_iter,
            **self.geometry_config(),
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        self._check_fitted()
        return {"codebook": self._fitted_codebook}

    @classmethod
    def _from_state(cls, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> VQCodec:
        codec = cls(**config)
        codebook = tensors.get("codebook")
        expected = (codec.codebook_size, codec.patch_dim)
        if codebook is None or tuple(codebook.shape) != expected:
            got = None if codebook is None else list(codebook.shape)
            raise ValueError(
                f"VQ codec tensors need 'codebook' of shape {list(expected)}, got {got}"
            )
        codec.codebook = codebook.float()
        return codec
