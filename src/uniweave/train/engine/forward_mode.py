"""How a training forward runs: in which precision (`autocast`, `trainer.precision`) and
whether it draws random numbers (`draws_dropout`). The trainer and the methods' objectives
and validation ask here; so does the resume check of a world-size change
(`uniweave.train.engine.resume.check_world_size_change`)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from uniweave.config.trainer import TrainerConfig


def autocast(cfg: TrainerConfig, device: torch.device):
    """The forward's precision context (`trainer.precision`)."""
    if cfg.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def draws_dropout(model: nn.Module) -> bool:
    """Whether a training-mode forward of `model` draws dropout masks from the global torch
    RNG (a dropout module with p > 0, LoRA's included, or `attention_dropout` > 0)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        if float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0:
            return True
    return False
