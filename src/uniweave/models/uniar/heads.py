"""UniAR's writing path: the bit embedding of a generated position and the visual decoder
that predicts its k x k x L bits.

- `BitEmbedding`: e = W c, a linear map (no bias) of the position's code vector
  c = (2b - 1) / sqrt(L) in {+-1/sqrt(L)}^{k*k*L} (all k*k*L bits of the composite
  position) into the decoder width.
- `VisualDecoder`: over the language model's (pre-final-norm) hidden state h at a scored
  position, x_0 = W_in RMSNorm(h), then `n_layers` residual MLP blocks
  x_{i+1} = x_i + W_2 gelu(W_1 RMSNorm(x_i)), then logits = W_out RMSNorm(x_n): one
  Bernoulli logit per bit, k*k*L of them. It runs only on the hidden states passed in.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class BitEmbedding(nn.Module):
    """Bits {0,1} [..., D] -> embeddings [..., d] (module docstring)."""

    def __init__(self, n_bits: int, latent_dim: int, width: int) -> None:
        super().__init__()
        self.latent_dim = int(latent_dim)
        self.proj = nn.Linear(n_bits, width, bias=False)

    def forward(self, bits: torch.Tensor) -> torch.Tensor:
        code = (2.0 * bits.to(self.proj.weight.dtype) - 1.0) / math.sqrt(self.latent_dim)
        return self.proj(code)


class _Block(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=eps)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class VisualDecoder(nn.Module):
    """Hidden [N, d] -> bit logits [N, D] (module docstring)."""

    def __init__(self, hidden: int, width: int, n_layers: int, n_bits: int, eps: float) -> None:
        super().__init__()
        self.norm_in = nn.RMSNorm(hidden, eps=eps)
        self.proj_in = nn.Linear(hidden, width)
        self.blocks = nn.ModuleList(_Block(width, eps) for _ in range(n_layers))
        self.norm_out = nn.RMSNorm(width, eps=eps)
        self.proj_out = nn.Linear(width, n_bits)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(self.norm_in(hidden))
        for block in self.blocks:
            x = block(x)
        return self.proj_out(self.norm_out(x))
