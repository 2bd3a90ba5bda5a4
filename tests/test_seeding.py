from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from uniweave.core import generator_for, seed_for

BASE = (17, 3, 42, 5)


def test_same_inputs_same_seed_and_documented_encoding():
    # the seed is a function of its inputs alone: another interpreter (its own hash
    # randomisation, no state of this process) computes the same one
    other = subprocess.run(
        [sys.executable, "-c", f"from uniweave.core import seed_for; print(seed_for{BASE})"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "random"},
    )
    assert int(other.stdout) == seed_for(*BASE)
    payload = struct.pack("<4Q", *BASE)
    expected = int.from_bytes(hashlib.blake2b(payload).digest()[:8], "little")
    assert seed_for(*BASE) == expected
    assert 0 <= seed_for(*BASE) < 2**64


@pytest.mark.parametrize("position", range(4))
@pytest.mark.parametrize("delta", [1, 2, 1000])
def test_changing_any_single_input_changes_the_seed(position, delta):
    changed = list(BASE)
    changed[position] += delta
    assert seed_for(*changed) != seed_for(*BASE)


def test_inputs_are_not_interchangeable():
    # a positional hash, not a hash of the multiset of values
    assert seed_for(1, 2, 3, 4) != seed_for(4, 3, 2, 1)
    assert seed_for(0, 0, 1, 0) != seed_for(0, 0, 0, 1)


def test_seeds_cover_64_bits():
    seeds = {seed_for(0, 0, p, m) for p in range(32) for m in range(8)}
    assert len(seeds) == 256
    assert any(s >= 2**63 for s in seeds)


@pytest.mark.parametrize("bad", [True, False, 1.0, "3", None])
def test_rejects_non_ints_and_bools(bad):
    with pytest.raises(TypeError):
        seed_for(0, bad, 0, 0)


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_rejects_out_of_range(bad):
    with pytest.raises(ValueError, match="prompt_index"):
        seed_for(0, 0, bad, 0)


def test_numpy_ints_are_accepted():
    assert seed_for(np.int64(17), 3, np.int32(42), 5) == seed_for(*BASE)


def test_generators_seeded_alike_draw_identically():
    g1, g2 = generator_for(*BASE), generator_for(*BASE)
    assert g1.initial_seed() == seed_for(*BASE)
    assert torch.equal(torch.rand(100, generator=g1), torch.rand(100, generator=g2))
    assert torch.equal(
        torch.randint(0, 10**6, (50,), generator=g1), torch.randint(0, 10**6, (50,), generator=g2)
    )
    other = generator_for(17, 3, 42, 6)
    assert not torch.equal(
        torch.rand(100, generator=generator_for(*BASE)), torch.rand(100, generator=other)
    )


def test_generator_does_not_touch_global_rng():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    torch.rand(10, generator=generator_for(*BASE))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generator():
    g = generator_for(*BASE, device="cuda")
    assert g.device.type == "cuda"
    a = torch.rand(10, generator=g, device="cuda")
    b = torch.rand(10, generator=generator_for(*BASE, device="cuda"), device="cuda")
    assert torch.equal(a, b)
