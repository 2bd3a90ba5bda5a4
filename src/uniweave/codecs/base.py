"""The image codec contract shared by the VQ and BSQ tokenizers.

A codec maps pixels float in [0, 1] to discrete codes on a (gh, gw) grid of visual
positions and back. Its images are `image_size` = (H, W) pixels with `channels` colour
channels, both from its config: one channel is a greyscale image [N, H, W] (the digits'
8x8 default), three an RGB image [N, H, W, 3]. A fitted codec is stored as a directory
holding `codec.safetensors` (its tensors) and `codec.json` (its config, including "kind";
`image_size` and `channels` are written only when they differ from the 8x8 greyscale
default, so the files of a digits codec are what they were before codecs had a geometry).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from uniweave.core.atomic import apply_umask

ArrayLike = np.ndarray | torch.Tensor
CONFIG_NAME = "codec.json"
WEIGHTS_NAME = "codec.safetensors"


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch CPU ops on one intra-op thread, restoring the previous count after.

    The codecs' and classifier's fits are thousands of tiny ops: a second thread only adds
    synchronisation (and stalls badly when the other core is busy), and one thread makes
    the fitted weights independent of the machine's thread count.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train_minibatches(
    params: Iterable[torch.nn.Parameter],
    batch_loss: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    seed: int,
) -> None:
    """Minimise `batch_loss(indices)` with AdamW and a one-cycle schedule peaking at `lr`.

    Each epoch visits the n rows in a permutation drawn from torch.Generator(seed), in
    minibatches of `batch_size`; everything runs under `single_thread()`.
    """
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    steps = epochs * -(-n // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    with single_thread():
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator)
            for start in range(0, n, batch_size):
                loss = batch_loss(order[start : start + batch_size])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()


DEFAULT_IMAGE_SIZE = (8, 8)
DEFAULT_CHANNELS = 1
CHANNELS = (1, 3)
"""Colour channels a digits codec takes: greyscale or RGB."""


def check_geometry(image_size: Any, channels: Any) -> tuple[tuple[int, int], int]:
    """(image_size as (H, W), channels) validated; ValueError (one line) otherwise."""
    try:
        h, w = (int(v) for v in image_size)
    except (TypeError, ValueError):
        raise ValueError(f"image_size must be (height, width), got {image_size!r}") from None
    if h < 1 or w < 1 or [h, w] != list(image_size):
        raise ValueError(f"image_size must be two integers >= 1, got {image_size!r}")
    if isinstance(channels, bool) or channels not in CHANNELS:
        raise ValueError(f"channels must be one of {CHANNELS}, got {channels!r}")
    return (h, w), int(channels)


def as_pixels(
    pixels: ArrayLike,
    size: tuple[int, int] = DEFAULT_IMAGE_SIZE,
    name: str = "pixels",
    channels: int = DEFAULT_CHANNELS,
) -> torch.Tensor:
    """Validate images and return them as a float32 CPU tensor [N, H, W] (one channel) or
    [N, H, W, C] (`channels` C > 1).

    Raises ValueError (one line) unless `pixels` is a numeric array of that shape with
    N >= 1, (H, W) == `size` and every value finite and in [0, 1].
    """
    if isinstance(pixels, np.ndarray):
        if not np.issubdtype(pixels.dtype, np.number) and pixels.dtype != np.bool_:
            raise ValueError(f"{name} must be numeric, got dtype {pixels.dtype}")
        tensor = torch.from_numpy(np.asarray(pixels, dtype=np.float32))
    elif isinstance(pixels, torch.Tensor):
        if pixels.is_complex():
            raise ValueError(f"{name} must be real, got dtype {pixels.dtype}")
        tensor = pixels.detach().to(device="cpu", dtype=torch.float32)
    else:
        raise ValueError(
            f"{name} must be a numpy array or torch tensor, got {type(pixels).__name__}"
        )
    expected = (size[0], size[1]) if channels == 1 else (size[0], size[1], channels)
    if (
        tensor.dim() != 1 + len(expected)
        or tuple(tensor.shape[1:]) != expected
        or tensor.shape[0] == 0
    ):
        dims = ", ".join(str(d) for d in expected)
        raise ValueError(
            f"{name} must have shape [N, {dims}] with N >= 1, got {list(tensor.shape)}"
        )
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{name} contains non-finite values")
    lo, hi = float(tensor.min()), float(tensor.max())
    if lo < 0.0 or hi > 1.0:
        raise ValueError(f"{name} values must lie in [0, 1], got min {lo:.4g} and max {hi:.4g}")
    return tensor.contiguous()


def as_tensor(codes: ArrayLike, name: str = "codes") -> torch.Tensor:
    """Return `codes` as a CPU tensor (numpy arrays are converted, no copy of values)."""
    if isinstance(codes, np.ndarray):
        return torch.from_numpy(codes)
    if isinstance(codes, torch.Tensor):
        return codes.detach().cpu()
    raise ValueError(f"{name} must be a numpy array or torch tensor, got {type(codes).__name__}")


def to_patches(images: torch.Tensor, patch: int) -> torch.Tensor:
    """[N, H, W] -> [N, H/p, W/p, p*p] (a patch's pixels in row-major (dy, dx) order), or
    [N, H, W, C] -> [N, H/p, W/p, p*p*C] in (dy, dx, channel) order."""
    x = images if images.dim() == 4 else images.unsqueeze(-1)
    n, h, w, c = x.shape
    x = x.reshape(n, h // patch, patch, w // patch, patch, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, h // patch, w // patch, patch * patch * c)


def from_patches(patches: torch.Tensor, patch: int, channels: int = 1) -> torch.Tensor:
    """Inverse of `to_patches`: [N, gh, gw, p*p*C] -> [N, gh*p, gw*p] (C = 1) or
    [N, gh*p, gw*p, C]."""
    n, gh, gw, _ = patches.shape
    x = patches.reshape(n, gh, gw, patch, patch, channels).permute(0, 1, 3, 2, 4, 5)
    x = x.reshape(n, gh * patch, gw * patch, channels)
    return x.squeeze(-1) if channels == 1 else x


def read_codec_dir(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read (config, tensors) of a saved codec; FileNotFoundError names the missing path."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"codec directory {root} does not exist")
    config_path, weights_path = root / CONFIG_NAME, root / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"codec directory {root} is missing {path}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from err
    if not isinstance(config, dict) or "kind" not in config:
        raise ValueError(f"{config_path} must be a JSON object with a 'kind' key")
    return config, load_file(str(weights_path))


class ImageCodec(ABC):
    """Pixels [N, H, W] (or [N, H, W, C]) in [0, 1] <-> discrete codes on a `grid` of
    visual positions (module docstring).

    Subclasses define `kind`, `grid`, the fitting procedure, `encode`/`decode`, and their
    serialisable state through `config()` / `tensors()` / `_from_state()`; their
    constructors take `image_size` and `channels` and call `_set_geometry`.
    """

    kind: ClassVar[str]
    image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE
    channels: int = DEFAULT_CHANNELS

    def _set_geometry(self, image_size: Any, channels: Any) -> None:
        self.image_size, self.channels = check_geometry(image_size, channels)

    def geometry_config(self) -> dict[str, Any]:
        """`image_size` and `channels` for `config()`, each only when not the default."""
        out: dict[str, Any] = {}
        if self.image_size != DEFAULT_IMAGE_SIZE:
            out["image_size"] = list(self.image_size)
        if self.channels != DEFAULT_CHANNELS:
            out["channels"] = self.channels
        return out

    @property
    @abstractmethod
    def grid(self) -> tuple[int, int]:
        """(gh, gw): visual positions per image (after any grouping)."""

    @property
    @abstractmethod
    def is_fitted(self) -> bool:
        """Whether the codec has parameters to encode and decode with."""

    @abstractmethod
    def fit(self, images: ArrayLike, seed: int = 0) -> ImageCodec:
        """Fit the codec on images of its geometry in [0, 1]; deterministic for a seed."""

    @abstractmethod
    def encode(self, pixels: ArrayLike) -> torch.Tensor:
        """Pixels [N, H, W(, C)] in [0, 1] -> codes on the grid."""

    @abstractmethod
    def decode(self, codes: ArrayLike) -> torch.Tensor:
        """Codes on the grid -> pixels float32 [N, H, W(, C)] in [0, 1]."""

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """JSON-serialisable constructor arguments (without "kind")."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """The fitted tensors to store in safetensors."""

    @classmethod
    @abstractmethod
    def _from_state(cls, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> ImageCodec:
        """Rebuild a fitted codec from `config()` and `tensors()`."""

    def reconstruct(self, pixels: ArrayLike) -> torch.Tensor:
        """decode(encode(pixels))."""
        return self.decode(self.encode(pixels))

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise RuntimeError(f"{type(self).__name__} is not fitted; call fit(images) first")

    def _pixels(self, pixels: ArrayLike) -> torch.Tensor:
        return as_pixels(pixels, self.image_size, channels=self.channels)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write `codec.safetensors` and `codec.json` (with "kind") into `directory`."""
        self._check_fitted()
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.tensors().items()}
        save_file(tensors, str(root / WEIGHTS_NAME))
        config = {"kind": self.kind, **self.config()}
        (root / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        apply_umask(root)  # safetensors writes 0600
        return root

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ImageCodec:
        """Load a codec saved by `save_pretrained`; the stored kind must match `cls.kind`."""
        config, tensors = read_codec_dir(directory)
        kind = config.pop("kind")
        if kind != cls.kind:
            raise ValueError(
                f"{Path(directory) / CONFIG_NAME} holds a {kind!r} codec, not {cls.kind!r}"
            )
        try:
            return cls._from_state(config, tensors)
        except TypeError as err:
            raise ValueError(f"{Path(directory) / CONFIG_NAME} has invalid fields: {err}") from err
