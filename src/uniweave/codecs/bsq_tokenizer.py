"""A configurable BSQ image tokenizer at real scale (colour, any square size), frozen.

Geometry (all from `BSQTokenizerConfig`): an S x S image with C channels is cut into
(S/p) x (S/p) cells by a patch conv of stride p; each cell gets an L-bit code
(L = `embed_dim`); k x k neighbouring cells (k = `spatial_group`) form one composite
visual position of k*k*L bits, so the grid is (S/p/k) x (S/p/k). UniAR's geometry is
k = 4, L = 64: 1,024 bits per position (the defaults: 384 px at /16 -> a 6x6 grid).

    v = enc(2x - 1)                 patch conv, `num_layers` residual 3x3 conv blocks
    u = normalize(quant_embed(v))   1x1 conv to L dims, L2-normalised per cell
    c = sign(u) / sqrt(L)           the code (a unit vector), bits b = (u > 0)
    x_hat = sigmoid(dec(post_quant_embed(c)))   blocks, transposed patch conv

`encode(pixels [N, S, S, 3] (or [N, S, S] grey, copied into each channel) in [0, 1])`
-> float {0,1} bits [N, G, G, k*k*L] in (dy, dx, bit) order; `decode` inverts the
grouping and returns pixels [N, S, S, 3] in [0, 1] ([N, S, S] when C = 1). Both run
without gradients on the tokenizer's device and return CPU tensors.

A tokenizer directory holds `config.json` ("kind": "bsq_tokenizer" plus every field of
`BSQTokenizerConfig`) and `model.safetensors`; `from_pretrained` refuses a missing file,
a missing, unknown or invalid field, or tensors whose shapes the config does not give,
with one line naming the file and the field. Module names follow the public BSQ code's
(`quant_embed`, `post_quant_embed`, `embed_dim`); nothing here loads a released
tokenizer's weights. Training is not built (the codec is frozen in uniweave).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from uniweave.codecs.base import ArrayLike, as_tensor
from uniweave.codecs.bsq import bits_to_code_vectors, conv1x1_affine, group_bits, ungroup_bits

KIND = "bsq_tokenizer"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class BSQTokenizerConfig:
    """Geometry and widths (module docstring); `check` validates them."""

    image_size: int = 384
    num_channels: int = 3
    patch_size: int = 16
    hidden_size: int = 256
    num_layers: int = 2
    embed_dim: int = 64
    spatial_group: int = 4

    def problem(self) -> tuple[str, str] | None:
        """(field, why) of the first invalid field, or None."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return f.name, f"must be an integer >= 1, got {value!r}"
        if self.num_channels not in (1, 3):
            return "num_channels", f"must be 1 or 3, got {self.num_channels}"
        if self.image_size % self.patch_size:
            return "patch_size", f"{self.patch_size} does not divide image_size {self.image_size}"
        cells = self.image_size // self.patch_size
        if cells % self.spatial_group:
            return "spatial_group", f"{self.spatial_group} does not divide the {cells} cells a side"
        return None

    @property
    def grid(self) -> tuple[int, int]:
        side = self.image_size // self.patch_size // self.spatial_group
        return (side, side)

    @property
    def bits_per_position(self) -> int:
        return self.spatial_group**2 * self.embed_dim

    def check(self, where: str = "BSQTokenizerConfig") -> BSQTokenizerConfig:
        bad = self.problem()
        if bad is not None:
            raise ValueError(f"{where}: field {bad[0]} {bad[1]}")
        return self

    @classmethod
    def from_file(cls, file: Path) -> BSQTokenizerConfig:
        """The config of a `config.json`; ValueError naming the file and the field."""
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}: not valid JSON ({err})") from None
        if not isinstance(data, dict) or data.get("kind") != KIND:
            got = data.get("kind") if isinstance(data, dict) else data
            raise ValueError(f"{file}: field kind is {got!r}, not {KIND!r}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names) - {"kind"})
        if unknown:
            raise ValueError(f"{file}: field {unknown[0]} is unknown (fields: {names})")
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"{file}: field {missing[0]} is missing")
        return cls(**{n: data[n] for n in names}).check(str(file))


class _ResBlock(nn.Module):
    """x + conv2(gelu(conv1(gelu(x)))), 3x3 convs keeping the width."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(nn.functional.gelu(self.conv1(nn.functional.gelu(x))))


class BSQTokenizerNet(nn.Module):
    """The encoder, the two BSQ projections and the decoder (module docstring)."""

    def __init__(self, cfg: BSQTokenizerConfig) -> None:
        super().__init__()
        h, p = cfg.hidden_size, cfg.patch_size
        self.patch_embed = nn.Conv2d(cfg.num_channels, h, p, stride=p)
        self.encoder = nn.ModuleList(_ResBlock(h) for _ in range(cfg.num_layers))
        self.quant_embed = nn.Conv2d(h, cfg.embed_dim, 1)
        self.post_quant_embed = nn.Conv2d(cfg.embed_dim, h, 1)
        self.decoder = nn.ModuleList(_ResBlock(h) for _ in range(cfg.num_layers))
        self.head = nn.ConvTranspose2d(h, cfg.num_channels, p, stride=p)

    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """u = normalize(quant_embed(enc(2x - 1))) per cell: [N, L, S/p, S/p]."""
        v = self.patch_embed(2.0 * x - 1.0)
        for block in self.encoder:
            v = block(v)
        return nn.functional.normalize(self.quant_embed(nn.functional.gelu(v)), dim=1)

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        """Codes [N, L, S/p, S/p] -> pixels [N, C, S, S] in (0, 1)."""
        v = self.post_quant_embed(c)
        for block in self.decoder:
            v = block(v)
        return torch.sigmoid(self.head(nn.functional.gelu(v)))


# Which config fields set each tensor's shape (for the mismatch message).
_SHAPE_FIELDS = {
    "patch_embed": "num_channels/hidden_size/patch_size",
    "encoder": "hidden_size/num_layers",
    "quant_embed": "embed_dim/hidden_size",
    "post_quant_embed": "embed_dim/hidden_size",
    "decoder": "hidden_size/num_layers",
    "head": "num_channels/hidden_size/patch_size",
}


class BSQTokenizer:
    """A frozen BSQ image tokenizer as a uniweave codec (module docstring)."""

    kind = KIND

    def __init__(self, config: BSQTokenizerConfig, net: BSQTokenizerNet | None = None) -> None:
        self.cfg = config.check()
        self.net = (net or BSQTokenizerNet(self.cfg)).eval().requires_grad_(False)

    # ---- geometry --------------------------------------------------------------------
    @property
    def latent_dim(self) -> int:
        return self.cfg.embed_dim

    @property
    def group(self) -> int:
        return self.cfg.spatial_group

    @property
    def image_size(self) -> tuple[int, int]:
        return (self.cfg.image_size, self.cfg.image_size)

    @property
    def grid(self) -> tuple[int, int]:
        return self.cfg.grid

    @property
    def bits_per_position(self) -> int:
        return self.cfg.bits_per_position

    @property
    def is_fitted(self) -> bool:
        return True

    def to(self, device: torch.device | str) -> BSQTokenizer:
        self.net.to(device)
        return self

    def _device(self) -> torch.device:
        return next(self.net.parameters()).device

    # ---- pixels <-> bits -------------------------------------------------------------
    def _pixels(self, pixels: ArrayLike) -> torch.Tensor:
        """[N, S, S, C] (or grey [N, S, S]) in [0, 1] -> float32 [N, C, S, S]."""
        x = as_tensor(pixels, "pixels")
        s, c = self.cfg.image_size, self.cfg.num_channels
        if x.dim() == 3:
            x = x.unsqueeze(-1).expand(*x.shape, c)
        if x.dim() != 4 or tuple(x.shape[1:]) != (s, s, c) or x.shape[0] == 0:
            raise ValueError(f"pixels must have shape [N, {s}, {s}, {c}], got {list(x.shape)}")
        x = x.float()
        if not torch.isfinite(x).all() or float(x.min()) < 0.0 or float(x.max()) > 1.0:
            raise ValueError("pixels must be finite and lie in [0, 1]")
        return x.permute(0, 3, 1, 2).contiguous()

    @torch.no_grad()
    def encode(self, pixels: ArrayLike) -> torch.Tensor:
        """Bits b = (u > 0): float32 {0,1} [N, G, G, k*k*L] (module docstring)."""
        u = self.net.latents(self._pixels(pixels).to(self._device()))
        bits = (u > 0).float().permute(0, 2, 3, 1).contiguous().cpu()
        return group_bits(bits, self.group)

    def bits_to_vectors(self, bits: ArrayLike) -> torch.Tensor:
        """Bits {0,1} [..., k*k*L] -> code values (2b - 1)/sqrt(L) (each cell unit norm)."""
        return bits_to_code_vectors(bits, self.bits_per_position, self.latent_dim)

    @torch.no_grad()
    def decode(self, codes: ArrayLike) -> torch.Tensor:
        """Bits [N, G, G, k*k*L] -> pixels float32 [N, S, S, C] in [0, 1] (C = 1: [N, S, S])."""
        t = as_tensor(codes, "codes")
        g = self.grid
        if t.dim() != 4 or tuple(t.shape[1:3]) != g or t.shape[0] == 0:
            raise ValueError(
                f"BSQ codes must have shape [N, {g[0]}, {g[1]}, {self.bits_per_position}], "
                f"got {list(t.shape)}"
            )
        c = ungroup_bits(self.bits_to_vectors(t), self.group, self.latent_dim)
        x = self.net.decode(c.permute(0, 3, 1, 2).contiguous().to(self._device()))
        x = x.permute(0, 2, 3, 1).float().cpu()
        return x[..., 0] if self.cfg.num_channels == 1 else x

    def feature_projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [hidden_size, L], bias [hidden_size]) of `post_quant_embed`, the 1x1 conv
        from one cell's code vector to decoder features: the code -> feature projection F
        of the Soft-BSQ loss (docs/numerics.md §2). Detached float32 copies."""
        return conv1x1_affine(self.net.post_quant_embed)

    def reconstruct(self, pixels: ArrayLike) -> torch.Tensor:
        """decode(encode(pixels))."""
        return self.decode(self.encode(pixels))

    # ---- saving ----------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return asdict(self.cfg)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write `config.json` (kind + every config field) and `model.safetensors`."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.net.state_dict().items()}
        save_file(state, str(root / WEIGHTS_FILE), metadata={"format": "pt"})
        text = json.dumps({"kind": KIND, **self.config()}, indent=2, sort_keys=True)
        (root / CONFIG_FILE).write_text(text + "\n")
        return root

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> BSQTokenizer:
        """Load a `save_pretrained` directory, checks first (module docstring)."""
        root = Path(directory)
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (root / name).is_file():
                raise FileNotFoundError(f"{root / name}: missing (a BSQ tokenizer directory)")
        cfg = BSQTokenizerConfig.from_file(root / CONFIG_FILE)
        net = BSQTokenizerNet(cfg)
        expected = net.state_dict()
        state = load_file(str(root / WEIGHTS_FILE))
        for name in sorted(set(expected) | set(state)):
            if name not in state or name not in expected:  # a block more or fewer
                where = "lacks" if name not in state else "has an unexpected"
                raise ValueError(
                    f"{root / CONFIG_FILE}: field num_layers does not match the weights "
                    f"({WEIGHTS_FILE} {where} tensor {name})"
                )
            if tuple(state[name].shape) != tuple(expected[name].shape):
                field = _SHAPE_FIELDS[name.split(".")[0]]
                raise ValueError(
                    f"{root / CONFIG_FILE}: field {field} gives tensor {name} shape "
                    f"{list(expected[name].shape)} but {WEIGHTS_FILE} holds "
                    f"{list(state[name].shape)}"
                )
        net.load_state_dict(state)
        return cls(cfg, net)
