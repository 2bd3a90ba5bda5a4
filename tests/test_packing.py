"""Sequence packing (`trainer.packing`): first-fit bins, block-causal attention with
positions restarted per sequence, the conv prior stopping at boundaries, and the SFT
objective (loss and every gradient) unchanged by packing, to the float64 model's bound
(tests/tolerances.py: float64 sums, float32 norms in the backward)."""

from __future__ import annotations

import pytest
import torch
from tolerances import (
    assert_within,
    fp64_forward_bound,
    gradient_reductions,
    magnitude,
    mixed_fp64_bound,
    rmsnorm_fp32_reductions,
    tiny_decoder_reductions,
)

from uniweave.codecs import build_codec
from uniweave.config import ConfigError, validate_config
from uniweave.config.algorithms import SFTConfig
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.digits import TASKS, make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.data.template import serialize
from uniweave.data.tokenizer import SpecialIds, build_tokenizer
from uniweave.forward import body_hidden
from uniweave.models.base import packed_attention_mask, packed_positions
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.train.engine.batching import bins, pack, padded_fraction
from uniweave.train.methods.sft.objective import SFTObjective


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    codec = build_codec("vq", codebook_size=16, n_init=1, max_iter=5)
    codec.fit(load_split("train").images[:100], seed=0)
    tok = build_tokenizer()
    config = TinyArchitecture(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model = TinyUnifiedModel(config, tok, codec).double()
    samples = [s for t in TASKS for s in make_task_samples(t, "train", 3, seed=1)]
    trajs = [serialize(s, tok, encode_image=codec.encode) for s in samples]
    return model, trajs, SpecialIds.from_tokenizer(tok).pad


def test_bins_place_every_item_once_within_capacity():
    lengths = [7, 3, 5, 2, 9, 1, 4, 4]
    out = bins(lengths, 9)
    assert sorted(i for b in out for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 9 for b in out)
    assert len(out) == -(-sum(lengths) // 9)  # these lengths fill bins exactly


def test_positions_restart_and_attention_stays_in_its_sequence():
    seg = torch.tensor([[1, 1, 1, 2, 2, 0]])
    assert packed_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = packed_attention_mask(seg)[0].int()
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert mask.tolist() == expected


def test_packed_hidden_states_equal_each_rows_own(setup):
    model, trajs, pad = setup
    packed = pack(trajs, pad)
    assert len(packed) < len(trajs)
    hidden = body_hidden(model, packed)
    row, start = 0, 0
    seg = packed.segment_ids
    for r in range(len(packed)):
        for s in range(1, int(seg[r].max()) + 1):
            cols = (seg[r] == s).nonzero().squeeze(1)
            ids = packed.token_ids[r, cols]
            match = [t for t in trajs if torch.equal(t.token_ids, ids)]
            alone = body_hidden(model, TrajectoryBatch.collate(match[:1], pad))[0]
            # float64 forwards over other key lengths (the packed row's, the row's own)
            n = tiny_decoder_reductions(model.config, len(seg[r]), head=model.config.hidden_size)
            tol = fp64_forward_bound(magnitude(alone), n)
            assert_within((hidden[r, cols] - alone).abs(), tol, f"packed hidden {r, s}")
            row, start = row + 1, start + len(cols)
    assert row == len(trajs)


def test_sft_loss_and_gradients_are_invariant_to_packing(setup):
    model, trajs, pad = setup
    objective = SFTObjective(SFTConfig())
    plain = TrajectoryBatch.collate(trajs, pad)
    packed = pack(trajs, pad)
    assert padded_fraction(packed) < padded_fraction(plain)
    n = objective.count(plain)
    assert objective.count(packed) == n
    results = []
    for batch in (plain, packed):
        model.zero_grad(set_to_none=True)
        loss, stats = objective.loss(model, batch, n)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), stats, grads))
    (l0, s0, g0), (l1, s1, g1) = results
    # float64 weights, float32 norms (tests/tolerances.py): the loss and its sums are a
    # forward plus a mean over the scored tokens; a gradient adds the backward and the
    # sum over tokens, with the norms' float32 backward
    cfg, tokens = model.config, int(plain.attention_mask.sum())
    fwd = tiny_decoder_reductions(cfg, plain.token_ids.shape[1]) + tokens
    n32 = rmsnorm_fp32_reductions(cfg.hidden_size, cfg.num_layers)
    assert_within((l0 - l1).abs(), fp64_forward_bound(magnitude(l0), fwd), "loss")
    assert s0.keys() == s1.keys()
    for k in s0:
        assert_within(abs(s0[k] - s1[k]), fp64_forward_bound(magnitude(s0[k]), fwd), k)
    assert g0.keys() == g1.keys()
    n64 = gradient_reductions(tiny_decoder_reductions(cfg, plain.token_ids.shape[1]), tokens)
    for k in g0:
        assert_within((g0[k] - g1[k]).abs(), mixed_fp64_bound(magnitude(g0[k]), n64, n32), k)


def test_packing_refuses_rows_with_per_row_training_data(setup):
    _, trajs, pad = setup
    row = trajs[0]
    row.advantage = 1.0
    try:
        with pytest.raises(ValueError, match="advantage"):
            pack([row, *trajs[1:]], pad)
    finally:
        row.advantage = None


@pytest.mark.parametrize(
    "changes, culprit",
    [
        ({"algorithm": {"name": "grpo"}, "reward": {"plugins": [{"name": "mc_exact"}]}}, "sft"),
        ({"model": {"kind": "janus_pro", "path": "/nonexistent"}}, "model.kind=tiny"),
        ({"model": {"visual_head": "bsq"}, "algorithm": {"name": "sft", "bitflip": {"probability": 0.1}}}, "BitFlip"),
    ],
)  # fmt: skip
def test_packing_refusals_name_the_key(tmp_path, changes, culprit):
    data = {"run": {"output_dir": str(tmp_path)}, "trainer": {"packing": True}, **changes}
    with pytest.raises(ConfigError, match=f"trainer.packing.*{culprit}"):
        validate_config(data)
