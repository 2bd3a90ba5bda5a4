"""IG's full view under BitFlip `partition: half` (issue 32 item 6): IG scores the clean
rows; `student_full_view: fused` reads their full scores from the SFT forward (one
backbone call for noisy SFT rows and clean IG rows), `sequential` runs a separate forward.
Same loss and gradients; the backbone calls are counted with a forward hook on the
model's decoder (every backbone pass goes through it: SFT, full and blind views)."""

from __future__ import annotations

import dataclasses

import pytest
from rollout_fixtures import tiny_model, tokenizer
from tolerances import (
    assert_within,
    gradient_reductions,
    magnitude,
    reduction_bound,
    tiny_decoder_reductions,
)

from uniweave.codecs.base import single_thread
from uniweave.config.algorithms import SFTConfig
from uniweave.core.seeding import seed_for
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.digits import make_task_samples
from uniweave.data.template import serialize
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.methods.sft.information_gain import scored_events
from uniweave.train.methods.sft.objective import SFTObjective


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _rows(model):
    """3 draw_then_answer rows (text→visual and visual→text events) and 3 t2i rows, each
    with a stateless seed."""
    rows = []
    for task in ("draw_then_answer", "t2i"):
        samples = make_task_samples(task, "val", 3, seed=5)
        bits = model.n_visual_outputs
        rows += [serialize(s, tokenizer(), encode_image=model.codec.encode, bits=bits)
                 for s in samples]  # fmt: skip
    return [dataclasses.replace(r, seed=seed_for(1, 7, 500 + k, 0)) for k, r in enumerate(rows)]


def _config(view):
    ig = {"weight": 1.5, "event_selection": "all", "student_full_view": view}
    return SFTConfig(bitflip={"probability": 0.3, "partition": "half"}, information_gain=ig)


def _run(model, micros, view):
    """Loss, per-parameter gradients, stats and backbone calls of one update's micro-batches."""
    calls = []
    hook = model.decoder.register_forward_hook(lambda *_: calls.append(1))
    try:
        objective = SFTObjective(_config(view))
        objective.begin_update(7, micros, DistInfo())
        n = sum(objective.count(m) for m in micros)
        model.zero_grad()
        total, stats = 0.0, {}
        for m in micros:
            loss, s = objective.loss(model, m, n)
            loss.backward()
            total += float(loss.detach())
            for k, v in s.items():
                stats[k] = stats.get(k, 0.0) + v
    finally:
        hook.remove()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return total, grads, stats, len(calls), objective


@pytest.mark.parametrize("micro", [6, 2])
def test_fused_and_sequential_agree_with_one_backbone_call_fewer(micro):
    """The same per-row function of the weights in float32, evaluated in a batch of other
    rows (padding to another length, other matmul shapes): two fp32 paths to a gradient
    (tests/tolerances.py, docs/numerics.md §15)."""
    model = tiny_model("bsq", init=0.3).train()
    rows = _rows(model)
    micros = [
        TrajectoryBatch.collate(rows[i : i + micro], model.special_ids.pad)
        for i in range(0, len(rows), micro)
    ]
    fused = _run(model, micros, "fused")
    seq = _run(model, micros, "sequential")
    assert fused[0] == pytest.approx(seq[0], rel=1e-6)
    assert fused[1].keys() == seq[1].keys()
    keys = max(m.token_ids.shape[1] for m in micros)
    tokens = sum(int(m.attention_mask.sum()) for m in micros)
    n = gradient_reductions(tiny_decoder_reductions(model.config, keys), tokens)
    for k, g in fused[1].items():
        assert_within((g - seq[1][k]).abs(), reduction_bound(magnitude(g), n), k)
    for k in ("ig/loss_sum", "ig/rows", "ig/visual_to_text/events", "ig/text_to_visual/events"):
        assert fused[2][k] == pytest.approx(seq[2][k], rel=1e-6), k
    # one backbone call fewer per micro-batch holding a clean row
    objective = fused[4]
    with_clean = sum(1 for m in micros if not all(objective.noised_rows(m)))
    assert with_clean >= 1
    assert seq[3] - fused[3] == with_clean
    assert fused[2]["ig/full_calls"] == 0 and seq[2]["ig/full_calls"] == with_clean
    # IG scored exactly the clean rows that have events
    clean = [
        (m, [b for b, noised in enumerate(objective.noised_rows(m)) if not noised]) for m in micros
    ]
    want_rows = sum(len({e.row for e in scored_events(m, objective.ig, 7, r)}) for m, r in clean)
    every_row = sum(len({e.row for e in scored_events(m, objective.ig, 7)}) for m, _ in clean)
    assert fused[2]["ig/rows"] == want_rows == objective.ig_rows_global
    assert 0 < want_rows < every_row


def test_fused_refuses_a_model_with_active_dropout():
    model = tiny_model("bsq", init=0.3).train()
    model.attention_dropout = 0.1  # what `draws_dropout` reads on attention modules
    batch = TrajectoryBatch.collate(_rows(model), model.special_ids.pad)
    objective = SFTObjective(_config("fused"))
    objective.begin_update(7, [batch], DistInfo())
    with pytest.raises(RuntimeError, match="student_full_view=sequential"):
        objective.loss(model, batch, objective.count(batch))
    objective = SFTObjective(_config("sequential"))
    objective.begin_update(7, [batch], DistInfo())
    objective.loss(model, batch, objective.count(batch))  # eval-mode view: no dropout
