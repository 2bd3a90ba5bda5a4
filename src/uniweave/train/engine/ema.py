"""An exponential moving average (EMA) shadow of a model's trainable parameters.

θ̄ ← μ·θ̄ + (1 − μ)·θ after every optimizer step, θ̄₀ = θ at the run's start, so after k
steps θ̄_k = μ^k·θ₀ + (1 − μ)·Σ_{j=1..k} μ^{k−j}·θ_j. The shadow lives in buffers allocated
once (same dtype and device as each parameter) and is updated in place with
`torch._foreach_mul_` / `torch._foreach_add_`. `swapped` puts the shadow into the model's
parameters for a no-grad forward (a pointer swap of `.data`, no copy) and back.
`state_dict` / `load_state_dict` carry the shadow through a checkpoint exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class EMA:
    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.shadow: list[torch.Tensor] | None = None
        self._pending: dict[str, torch.Tensor] | None = None

    @property
    def ready(self) -> bool:
        return self.shadow is not None

    def attach(self, model: nn.Module) -> None:
        """Bind to `model`'s trainable parameters; the shadow is a copy of them, or the
        state loaded before (`load_state_dict`, a resumed run)."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        if self._pending is not None:
            if sorted(self._pending) != sorted(self.names):
                raise ValueError("EMA state does not fit the model's trainable parameters")
            self.shadow = [
                self._pending[n].to(device=p.device, dtype=p.dtype).clone() for n, p in named
            ]
            self._pending = None
        else:
            self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """θ̄ ← μ·θ̄ + (1 − μ)·θ in place."""
        if self.shadow is None:
            raise RuntimeError("EMA.update before attach")
        torch._foreach_mul_(self.shadow, self.decay)
        torch._foreach_add_(self.shadow, [p.detach() for p in self.params], alpha=1.0 - self.decay)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside the block the model's trainable parameters hold θ̄ (and the shadow
        buffers θ); after it, both are back. Use under `torch.no_grad`."""
        if self.shadow is None:
            raise RuntimeError("EMA.swapped before attach")
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        assert self.shadow is not None, "the EMA shadow exists once the EMA started"
        for k, p in enumerate(self.params):
            data = p.data
            p.data = self.shadow[k]
            self.shadow[k] = data

    def state_dict(self) -> dict[str, object]:
        """{"decay", "shadow": {name: CPU copy}} (the pending state before `attach`)."""
        if self.shadow is None:
            shadow = dict(self._pending or {})
        else:
            shadow = {n: s.detach().cpu().clone() for n, s in zip(self.names, self.shadow)}
        return {"decay": self.decay, "shadow": shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; it takes effect at the next `attach` (or now, when
        attached)."""
        if float(state["decay"]) != self.decay:
            raise ValueError(f"EMA state has decay {state['decay']}, this run {self.decay}")
        shadow = dict(state["shadow"])
        if self.shadow is None:
            self._pending = shadow
            return
        if sorted(shadow) != sorted(self.names):
            raise ValueError("EMA state does not fit the model's trainable parameters")
        with torch.no_grad():
            for k, n in enumerate(self.names):
                self.shadow[k].copy_(shadow[n])
