"""Stateless per-sample seeds (docs/numerics.md §14): a retried or resumed update redraws exactly.

seed = int.from_bytes(blake2b(payload).digest()[:8], "little"), where payload is the
four ints in order, each encoded as 8 unsigned little-endian bytes (32 bytes; blake2b
with its default 64-byte digest). The result is a 64-bit unsigned int; no RNG state is
read or written. Each int must be a non-negative int below 2**64 (bools are rejected).
"""

from __future__ import annotations

import hashlib
import numbers

import torch

_MAX = 2**64


def _check(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) < _MAX:
        raise ValueError(f"{name} must be a non-negative int below 2**64, got {value}")
    return int(value)


def seed_for(run_seed: int, update: int, prompt_index: int, member: int) -> int:
    """64-bit seed of (run_seed, update, prompt_index, member); see the module docstring."""
    values = {
        "run_seed": run_seed,
        "update": update,
        "prompt_index": prompt_index,
        "member": member,
    }
    payload = b"".join(_check(k, v).to_bytes(8, "little") for k, v in values.items())
    return int.from_bytes(hashlib.blake2b(payload).digest()[:8], "little")


def generator_for(
    run_seed: int,
    update: int,
    prompt_index: int,
    member: int,
    device: torch.device | str = "cpu",
) -> torch.Generator:
    """A torch.Generator on `device` seeded with `seed_for(...)`."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_for(run_seed, update, prompt_index, member))
    return gen
