"""`run.deterministic`: deterministic kernels, so the same command gives the same bits."""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def set_determinism(deterministic: bool, device: torch.device) -> None:
    """`run.deterministic`: deterministic kernels (`torch.use_deterministic_algorithms`),
    so the same command gives the same bits at a fixed thread count and device; on CUDA
    also cuBLAS's fixed workspace (`CUBLAS_WORKSPACE_CONFIG`, set before the first CUDA
    matmul; a value already in the environment is kept)."""
    if deterministic and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(deterministic)
