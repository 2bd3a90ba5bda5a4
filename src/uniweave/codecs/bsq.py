"""Binary spherical quantisation (BSQ, Zhao et al. 2024, arXiv:2406.07548) for the digits.

A small conv autoencoder with a binary bottleneck on a (H/p) x (W/p) grid of positions,
for images of the codec's `image_size` (H, W) and `channels` (default: 8x8 greyscale; the
convolutions take and give `channels` planes):

    v = enc(x)                      per-position features (patchify conv, 3x3 conv)
    u = normalize(W v) in R^L       linear projection, then L2 normalisation
    c = sign(u) / sqrt(L)           the code: a corner of the hypercube on the unit sphere
    c_hat = u + stopgrad(c - u)     straight-through estimator
    x_hat = sigmoid(dec(c_hat))     back to pixels in [0, 1]
    bits b = (c > 0) as float {0,1}

Training loss (per batch of positions):

    mse(x_hat, x) + beta * ||u - stopgrad(c)||^2
      + zeta * (gamma0 * H_sample - gamma * H_codebook) / tau

with the soft-assignment entropy estimate of the paper, factorised over groups of
g = `entropy_group` bits: for each group j, q_j(s | u) = softmax_s(2 tau <u_j, s>) over its
2^g sub-codes s in {+-1/sqrt(L)}^g; H_sample = mean over positions of sum_j H(q_j(. | u));
H_codebook = sum_j H(mean over positions of q_j(. | u)). Minimising H_sample makes each
assignment confident; maximising H_codebook spreads positions over the codebook.

Optional grouping: k x k neighbouring positions form one composite position of k*k*L bits
(row-major (dy, dx, bit) order), so `encode` returns [N, gh/k, gw/k, k*k*L].
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from uniweave.codecs.base import ArrayLike, ImageCodec, as_tensor, train_minibatches


def group_bits(bits: torch.Tensor, k: int) -> torch.Tensor:
    """[N, gh, gw, L] -> [N, gh/k, gw/k, k*k*L]; composite bits in (dy, dx, bit) order."""
    n, gh, gw, L = bits.shape
    x = bits.reshape(n, gh // k, k, gw // k, k, L).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, gh // k, gw // k, k * k * L)


def ungroup_bits(bits: torch.Tensor, k: int, latent_dim: int) -> torch.Tensor:
    """Inverse of `group_bits`: [N, Gh, Gw, k*k*L] -> [N, Gh*k, Gw*k, L]."""
    n, gh, gw, _ = bits.shape
    x = bits.reshape(n, gh, gw, k, k, latent_dim).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, gh * k, gw * k, latent_dim)


def bits_to_code_vectors(bits: ArrayLike, bits_per_position: int, latent_dim: int) -> torch.Tensor:
    """Bits {0,1} [..., bits_per_position] -> code values (2b - 1)/sqrt(L) (float32); each
    L-bit cell is a unit vector. ValueError for another last dim or a non-bit value."""
    t = as_tensor(bits, "bits")
    if t.dim() == 0 or t.shape[-1] != bits_per_position:
        raise ValueError(f"bits must end in a dim of {bits_per_position}, got {list(t.shape)}")
    t = t.float()
    if not ((t == 0) | (t == 1)).all():
        raise ValueError("bits must have values in {0, 1}")
    return (2.0 * t - 1.0) / math.sqrt(latent_dim)


def sub_codebook(group_size: int, latent_dim: int) -> torch.Tensor:
    """All 2^g sub-codes of one bit group, {+-1/sqrt(L)}^g: [2^g, g] (bit 0 is the MSB)."""
    ids = torch.arange(2**group_size).unsqueeze(1)
    shifts = torch.arange(group_size - 1, -1, -1)
    bits = (ids >> shifts) & 1
    return (bits.float() * 2.0 - 1.0) / math.sqrt(latent_dim)


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) over the last dim."""
    return -(p * torch.log(p.clamp_min(1e-12))).sum(-1)


def bsq_entropy_terms(
    u: torch.Tensor, codebook: torch.Tensor, inv_temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(H_sample, H_codebook) of the group-factorised soft assignments of u [M, L].

    q_j(s | u) = softmax_s(2 tau <u_j, s>) factorises over the bits of group j into
    Bernoulli(sigmoid(4 tau u_d / sqrt(L))), so H_sample is computed analytically as the
    mean over rows of the summed binary entropies; H_codebook needs the full q_j.
    """
    g = codebook.shape[1]
    z = 4.0 * inv_temperature * u / math.sqrt(u.shape[1])
    p = torch.sigmoid(z)
    binary = p * nn.functional.softplus(-z) + (1.0 - p) * nn.functional.softplus(z)
    per_sample = binary.sum(-1).mean()
    ug = u.reshape(u.shape[0], -1, g)  # [M, L/g, g]
    q = (2.0 * inv_temperature * torch.einsum("mjg,sg->mjs", ug, codebook)).softmax(-1)
    codebook_entropy = _entropy(q.mean(0)).sum()
    return per_sample, codebook_entropy


class BSQAutoencoder(nn.Module):
    """Encoder to unit-norm per-position latents u [N, L, gh, gw] and decoder from codes."""

    def __init__(self, latent_dim: int, hidden: int, patch: int, channels: int = 1) -> None:
        super().__init__()
        self.channels = channels
        self.encoder = nn.Sequential(
            nn.Conv2d(channels, hidden, patch, stride=patch),
            nn.GELU(),
            nn.Conv2d(hidden, hidden, 3, padding=1),
            nn.GELU(),
        )
        self.proj = nn.Conv2d(hidden, latent_dim, 1)
        self.decoder = nn.Sequential(
            nn.Conv2d(latent_dim, hidden, 1),
            nn.GELU(),
            nn.Conv2d(hidden, hidden, 3, padding=1),
            nn.GELU(),
            nn.ConvTranspose2d(hidden, channels, patch, stride=patch),
        )

    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """u = normalize(W enc(x)) over the channel dim: [N, L, gh, gw], from pixels
        [N, H, W] (one channel) or [N, H, W, C]."""
        planes = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)
        return nn.functional.normalize(self.proj(self.encoder(planes)), dim=1)

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        """Code vectors [N, L, gh, gw] -> pixels [N, H, W] (or [N, H, W, C]) in (0, 1)."""
        out = torch.sigmoid(self.decoder(c))
        return out.squeeze(1) if self.channels == 1 else out.permute(0, 2, 3, 1).contiguous()


def quantize(u: torch.Tensor) -> torch.Tensor:
    """Straight-through BSQ: c_hat = u + stopgrad(sign(u)/sqrt(L) - u), L = u.shape[1]."""
    c = torch.where(u > 0, 1.0, -1.0) / math.sqrt(u.shape[1])
    return u + (c - u).detach()


def conv1x1_affine(conv: nn.Conv2d) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1x1 conv as (weight [out, in], bias [out]): detached float32 copies."""
    if tuple(conv.kernel_size) != (1, 1):
        raise ValueError(f"expected a 1x1 conv, got kernel {tuple(conv.kernel_size)}")
    weight = conv.weight.detach()[:, :, 0, 0].float().clone()
    bias = conv.bias.detach().float().clone() if conv.bias is not None else None
    return weight, bias if bias is not None else weight.new_zeros(weight.shape[0])


class BSQCodec(ImageCodec):
    """BSQ autoencoder codec; codes are float {0,1} bits [N, gh, gw, bits_per_position]."""

    kind = "bsq"

    def __init__(
        self,
        latent_dim: int = 16,
        hidden: int = 32,
        patch: int = 2,
        group: int = 1,
        entropy_group: int = 8,
        epochs: int = 60,
        batch_size: int = 64,
        lr: float = 5e-3,
        beta: float = 0.25,
        gamma0: float = 1.0,
        gamma: float = 1.0,
        zeta: float = 1.0,
        inv_temperature: float = 16.0,
        image_size: tuple[int, int] | list[int] = (8, 8),
        channels: int = 1,
    ) -> None:
        self._set_geometry(image_size, channels)
        h, w = self.image_size
        if patch < 1 or h % patch or w % patch:
            raise ValueError(f"patch must divide the image size {self.image_size}, got {patch}")
        if group < 1 or (h // patch) % group or (w // patch) % group:
            raise ValueError(f"group must divide the {h // patch}x{w // patch} grid, got {group}")
        if entropy_group < 1 or latent_dim % entropy_group:
            raise ValueError(
                f"entropy_group must divide latent_dim={latent_dim}, got {entropy_group}"
            )
        self.latent_dim = int(latent_dim)
        self.hidden = int(hidden)
        self.patch = int(patch)
        self.group = int(group)
        self.entropy_group = int(entropy_group)
        self.epochs = int(epochs)
        self.batch_size = int(batch_size)
        self.lr = float(lr)
        self.beta = float(beta)
        self.gamma0 = float(gamma0)
        self.gamma = float(gamma)
        self.zeta = float(zeta)
        self.inv_temperature = float(inv_temperature)
        self.net: BSQAutoencoder | None = None

    @property
    def grid(self) -> tuple[int, int]:
        h, w = self.image_size
        return (h // self.patch // self.group, w // self.patch // self.group)

    @property
    def bits_per_position(self) -> int:
        """k*k*L bits per (composite) visual position."""
        return self.group * self.group * self.latent_dim

    @property
    def is_fitted(self) -> bool:
        return self.net is not None

    @property
    def _fitted_net(self) -> BSQAutoencoder:
        """The autoencoder (after `fit` or loading)."""
        assert self.net is not None, "the BSQ codec is not fitted"
        return self.net

    def _build(self) -> BSQAutoencoder:
        return BSQAutoencoder(self.latent_dim, self.hidden, self.patch, self.channels)

    def loss(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Training loss on pixels x [B, H, W(, C)] (module docstring) and its parts."""
        self._check_fitted()
        u = self._fitted_net.latents(x)
        c_hat = quantize(u)
        recon = nn.functional.mse_loss(self._fitted_net.decode(c_hat), x)
        flat = u.permute(0, 2, 3, 1).reshape(-1, self.latent_dim)
        commit = (flat - quantize(flat).detach()).pow(2).sum(-1).mean()
        codebook = sub_codebook(self.entropy_group, self.latent_dim)
        h_sample, h_codebook = bsq_entropy_terms(flat, codebook, self.inv_temperature)
        entropy = (self.gamma0 * h_sample - self.gamma * h_codebook) / self.inv_temperature
        total = recon + self.beta * commit + self.zeta * entropy
        parts = {
            "recon": float(recon.detach()),
            "commit": float(commit.detach()),
            "h_sample": float(h_sample.detach()),
            "h_codebook": float(h_codebook.detach()),
        }
        return total, parts

    def fit(self, images: ArrayLike, seed: int = 0) -> BSQCodec:
        """Train from scratch (seeded init and data order; see `train_minibatches`)."""
        x = self._pixels(images)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = self._build()
        self._fitted_net.train()
        train_minibatches(
            self._fitted_net.parameters(),
            lambda idx: self.loss(x[idx])[0],
            n=x.shape[0],
            epochs=self.epochs,
            batch_size=self.batch_size,
            lr=self.lr,
            weight_decay=0.0,
            seed=seed,
        )
        self._fitted_net.eval()
        return self

    def encode(self, pixels: ArrayLike) -> torch.Tensor:
        """bits b = (u > 0): float32 {0,1} [N, gh, gw, bits_per_position]."""
        self._check_fitted()
        x = self._pixels(pixels)
        with torch.no_grad():
            u = self._fitted_net.latents(x)
        bits = (u > 0).float().permute(0, 2, 3, 1).contiguous()
        return group_bits(bits, self.group) if self.group > 1 else bits

    def _check_bits(self, codes: ArrayLike) -> torch.Tensor:
        bits = as_tensor(codes)
        gh, gw = self.grid
        d = self.bits_per_position
        if bits.dim() != 4 or tuple(bits.shape[1:]) != (gh, gw, d) or bits.shape[0] == 0:
            raise ValueError(
                f"BSQ codes must have shape [N, {gh}, {gw}, {d}] with N >= 1, "
                f"got {list(bits.shape)}"
            )
        if bits.dtype.is_complex:
            raise ValueError(f"BSQ codes must be real, got dtype {bits.dtype}")
        bits = bits.float()
        if not ((bits == 0) | (bits == 1)).all():
            raise ValueError("BSQ codes must be bits with values in {0, 1}")
        return bits

    def bits_to_vectors(self, bits: ArrayLike) -> torch.Tensor:
        """Bits {0,1} [..., k*k*L] -> code values (2b - 1)/sqrt(L), same shape (float32).

        Each underlying position's L-vector has unit norm (a composite has norm k).
        """
        return bits_to_code_vectors(bits, self.bits_per_position, self.latent_dim)

    def decode(self, codes: ArrayLike) -> torch.Tensor:
        """Bits [N, gh, gw, bits_per_position] -> pixels float32 [N, H, W(, C)] in [0, 1]."""
        self._check_fitted()
        bits = self._check_bits(codes)
        if self.group > 1:
            bits = ungroup_bits(bits, self.group, self.latent_dim)
        c = ((2.0 * bits - 1.0) / math.sqrt(self.latent_dim)).permute(0, 3, 1, 2)
        with torch.no_grad():
            return self._fitted_net.decode(c.contiguous())

    def feature_projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [hidden, L], bias [hidden]) of the decoder's first layer, the 1x1 conv
        that maps one cell's code vector to features: the code -> feature projection F
        of the Soft-BSQ loss (docs/numerics.md §2). Detached float32 copies."""
        self._check_fitted()
        conv = self._fitted_net.decoder[0]
        assert isinstance(conv, nn.Conv2d), "the decoder starts with a 1x1 conv"
        return conv1x1_affine(conv)

    def with_group(self, group: int) -> BSQCodec:
        """The same fitted autoencoder viewed with a different k x k position grouping."""
        config = {**self.config(), "group": group}
        other = type(self)(**config)
        other.net = self.net
        return other

    def config(self) -> dict[str, Any]:
        return {
            "latent_dim": self.latent_dim,
            "hidden": self.hidden,
            "patch": self.patch,
            "group": self.group,
            "entropy_group": self.entropy_group,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "beta": self.beta,
            "gamma0": self.gamma0,
            "gamma": self.gamma,
            "zeta": self.zeta,
            "inv_temperature": self.inv_temperature,
            **self.geometry_config(),
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        self._check_fitted()
        return dict(self._fitted_net.state_dict())

    @classmethod
    def _from_state(cls, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> BSQCodec:
        codec = cls(**config)
        net = codec._build()
        try:
            net.load_state_dict(tensors)
        except RuntimeError as err:
            raise ValueError(f"BSQ codec tensors do not match its config: {err}") from err
        net.eval()
        codec.net = net
        return codec
