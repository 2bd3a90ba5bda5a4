"""BitFlip `partition` (issue 32 item 6): `half` noises exactly the rows
`half_partition` names — checked on the input codes the model actually receives against
an independent computation of the chosen set and of each row's noise — for any
micro-batch split; `all` is main's behaviour bit for bit; refusals at config time."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from rollout_fixtures import tiny_model, tokenizer

import uniweave.train.methods.sft.objective as objective_module
from uniweave.algorithms.sft import bitflip, bitflip_rates, half_partition
from uniweave.codecs.base import single_thread
from uniweave.config import ConfigError, validate_config
from uniweave.config.algorithms import SFTConfig
from uniweave.core.seeding import seed_for
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.digits import make_task_samples
from uniweave.data.template import serialize
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.methods.sft.objective import SFTObjective

P = 0.3


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _rows(model, n):
    """`n` serialised t2i rows, each with its stateless seed as DatasetSource sets it."""
    samples = make_task_samples("t2i", "val", n, seed=2)
    rows = [
        serialize(s, tokenizer(), encode_image=model.codec.encode, bits=model.n_visual_outputs)
        for s in samples
    ]
    return [dataclasses.replace(r, seed=seed_for(3, 5, 1000 + k, 0)) for k, r in enumerate(rows)]


def _chosen_independently(seeds):
    """Noised iff the number of *distinct* seeds below a row's seed is even (docs/numerics.md
    §2): counted directly, no sort."""
    distinct = set(seeds)
    return [sum(1 for d in distinct if d < s) % 2 == 0 for s in seeds]


def _noise_independently(row_codes, row_visual, seed):
    """A row's BitFlip noise under `fixed` p, written out from docs/numerics.md: one
    generator per row, first draw sets the rate (unused under fixed), then one uniform per
    (position, bit) in row-major order; a visual bit flips where its draw is < p."""
    g = torch.Generator().manual_seed(seed)
    torch.rand((), generator=g)
    draws = torch.rand(row_codes.shape, generator=g)
    flip = (draws < P) & row_visual[:, None]
    return torch.where(flip, 1.0 - row_codes, row_codes)


def test_half_partition_is_the_even_positions_of_the_distinct_sorted_seeds():
    rng = random.Random(0)
    for n in range(1, 12):
        seeds = [rng.randrange(2**63) for _ in range(n)]
        seeds += seeds[: n // 3]  # rows drawn twice in one update
        rng.shuffle(seeds)
        chosen = half_partition(seeds)
        assert [s in chosen for s in seeds] == _chosen_independently(seeds)
        assert len(chosen) == math.ceil(len(set(seeds)) / 2)
        assert half_partition(list(reversed(seeds))) == chosen  # the set, not the order


def _spy(monkeypatch):
    """Record the input codes each SFT forward receives (then run the real forward)."""
    seen = []
    real = objective_module.forward_interleaved

    def spy(model, batch, visual_inputs=None):
        codes = batch.visual_codes if visual_inputs is None else visual_inputs
        seen.append((list(batch.seeds), codes.detach().clone()))
        return real(model, batch, visual_inputs)

    monkeypatch.setattr(objective_module, "forward_interleaved", spy)
    return seen


@pytest.mark.parametrize("micro", [1, 2, 3, 6])
def test_half_noises_exactly_the_chosen_rows_for_any_micro_batch_size(monkeypatch, micro):
    model = tiny_model("bsq")
    rows = _rows(model, 6)
    seeds = [r.seed for r in rows]
    expect = dict(zip(seeds, _chosen_independently(seeds)))
    assert sum(expect.values()) == 3
    objective = SFTObjective(SFTConfig(bitflip={"probability": P, "partition": "half"}))
    micros = [
        TrajectoryBatch.collate(rows[i : i + micro], model.special_ids.pad)
        for i in range(0, len(rows), micro)
    ]
    objective.begin_update(5, micros, DistInfo())
    seen = _spy(monkeypatch)
    for m in micros:
        assert objective.noised_rows(m) == [expect[s] for s in m.seeds]
        objective.loss(model, m, objective.count(m))
    assert len(seen) == len(micros)
    for m, (row_seeds, codes) in zip(micros, seen):
        assert row_seeds == list(m.seeds)
        for b, s in enumerate(row_seeds):
            clean, visual = m.visual_codes[b], m.visual_mask[b]
            want = _noise_independently(clean, visual, s) if expect[s] else clean
            assert torch.equal(codes[b], want), (micro, b)
            assert torch.equal(codes[b], clean) != expect[s]  # a noised row has flips


def test_all_is_mains_noise_bit_for_bit(monkeypatch):
    """`partition: all` (default or explicit) feeds every row main's noise: the sequence
    main's `_noisy_inputs` ran, called here directly."""
    model = tiny_model("bsq")
    rows = _rows(model, 4)
    batch = TrajectoryBatch.collate(rows, model.special_ids.pad)
    gens = [torch.Generator().manual_seed(s) for s in batch.seeds]
    uniforms = torch.stack([torch.rand((), generator=g) for g in gens])
    rates = bitflip_rates(P, "uniform", uniforms)
    main = bitflip(batch.visual_codes, batch.visual_mask, rates, model.n_visual_outputs, gens)
    for cfg in ({"probability": P, "probability_mode": "uniform"},
                {"probability": P, "probability_mode": "uniform", "partition": "all"}):  # fmt: skip
        objective = SFTObjective(SFTConfig(bitflip=cfg))
        objective.begin_update(0, [batch], DistInfo())
        seen = _spy(monkeypatch)
        objective.loss(model, batch, objective.count(batch))
        assert torch.equal(seen[-1][1], main)
        assert objective.noised_rows(batch) == [True] * 4


def test_half_refuses_a_batch_begin_update_did_not_see():
    model = tiny_model("bsq")
    rows = _rows(model, 4)
    objective = SFTObjective(SFTConfig(bitflip={"probability": P, "partition": "half"}))
    first = TrajectoryBatch.collate(rows[:2], model.special_ids.pad)
    with pytest.raises(RuntimeError, match="begin_update was not called"):
        objective.loss(model, first, objective.count(first))
    objective.begin_update(0, [first], DistInfo())
    other = TrajectoryBatch.collate(rows[2:], model.special_ids.pad)
    with pytest.raises(RuntimeError, match="begin_update was not called"):
        objective.loss(model, other, objective.count(other))


def _cfg(tmp_path, **algorithm):
    return {
        "run": {"name": "t", "output_dir": str(tmp_path / "run"), "device": "cpu"},
        "model": {"kind": "tiny", "visual_head": algorithm.pop("head", "bsq")},
        "algorithm": {"name": "sft", **algorithm},
    }


@pytest.mark.parametrize(
    "algorithm,key",
    [
        ({"bitflip": {"partition": "half"}}, "algorithm.bitflip.partition"),
        ({"bitflip": {"probability": 0.0, "partition": "half"}}, "algorithm.bitflip.partition"),
        (
            {"head": "vq", "bitflip": {"probability": P, "partition": "half"}},
            "algorithm.bitflip.probability",
        ),  # fmt: skip
    ],
)
def test_half_is_refused_where_it_cannot_act(tmp_path, algorithm, key):
    with pytest.raises(ConfigError) as err:
        validate_config(_cfg(tmp_path, **algorithm))
    assert err.value.key == key or key in str(err.value)
    assert not (tmp_path / "run").exists()
