"""Information Gain: events, the blind mask (exactly the source keys, conv mixer included),
gains and losses against an independent computation, trajectory-first reduction, no
gradient through the blind view, cycle selection deterministic across resume, Janus-Pro."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from rollout_fixtures import tiny_model, tokenizer
from tolerances import (
    assert_within,
    elementwise_bound,
    gradient_reductions,
    logprob_bound,
    magnitude,
    reduction_bound,
    tiny_decoder_reductions,
)
from trainer_helpers import tiny_config

from uniweave.algorithms.information_gain import (
    Block,
    Event,
    blind_attention_mask,
    blocks,
    event_losses,
    row_events,
    select_events,
    trajectory_sum,
    unit_scores,
)
from uniweave.codecs.base import single_thread
from uniweave.config import validate_config
from uniweave.config.algorithms import InformationGainConfig
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality, Owner
from uniweave.data.digits import make_task_samples
from uniweave.data.template import serialize
from uniweave.forward import forward_interleaved
from uniweave.models.build import build_model
from uniweave.models.tiny import TinyUnifiedModel
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.sft.information_gain import (
    blind_scores,
    full_logp,
    ig_terms,
    scored_events,
)
from uniweave.train.methods.sft.objective import SFTObjective
from uniweave.train.methods.sft.source import DatasetSource, sft_trajectories

ALL = InformationGainConfig(weight=1.0, event_selection="all")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _rows(model, n=3, task="draw_then_answer"):
    bits = model.n_visual_outputs if model.visual_head == "bsq" else None
    samples = make_task_samples(task, "val", n, seed=2)
    return [serialize(s, tokenizer(), encode_image=model.codec.encode, bits=bits) for s in samples]


def _batch(model, rows):
    return TrajectoryBatch.collate(rows, model.special_ids.pad)


def _full_scores(model, batch, events):
    out = forward_interleaved(model, batch)
    logp = full_logp(
        out,
        -torch.log_softmax(out.text_logits.float(), -1).gather(1, out.text_targets[:, None])[:, 0],
        _visual_ce(out),
    )
    return unit_scores(logp, events)


def _visual_ce(out):
    if out.visual_targets.dim() == 2:  # BSQ: Σ_f −log p(b_f)
        z, b = out.visual_logits.float(), out.visual_targets
        return -(
            b * torch.nn.functional.logsigmoid(z) + (1 - b) * torch.nn.functional.logsigmoid(-z)
        ).sum(-1)
    lp = torch.log_softmax(out.visual_logits.float(), -1)
    return -lp.gather(1, out.visual_targets[:, None])[:, 0]


# -- events and the mask ---------------------------------------------------------------


def test_events_of_the_interleaved_task():
    model = tiny_model("vq")
    traj = _rows(model, 1)[0]
    visual = (traj.modality == Modality.VISUAL).tolist()
    scored = ((traj.owner == Owner.POLICY) & (torch.arange(len(traj)) > 0)).tolist()
    bl = blocks(visual)
    assert [b.visual for b in bl] == [False, True, False, True, False]
    assert all(a.end == b.start for a, b in zip(bl, bl[1:])) and bl[-1].end == len(traj)
    events = row_events(0, visual, scored)
    # shown image -> response text, response text -> drawn image, drawn image -> answer
    assert [e.direction for e in events] == ["visual_to_text", "text_to_visual", "visual_to_text"]
    assert [e.target for e in events] == bl[2:]
    for e in events:
        assert set(e.targets) == {p for p in range(e.target.start, e.target.end) if scored[p]}
    cyc = [select_events(events, "cycle", c) for c in range(3)]
    assert cyc[0] == [events[0], events[1]] and cyc[1] == [events[1], events[2]]
    assert cyc[2] == cyc[0] and select_events(events, "all", 5) == events


def test_blind_mask_against_an_independent_construction():
    T, length = 12, 10
    s, t = Block(3, 6, True), Block(6, 9, False)
    mask = blind_attention_mask(length, T, [s], query_end=t.end)
    for q in range(T):
        for k in range(T):
            blinded = s.end - 1 <= q < t.end and s.start <= k < s.end and k != q
            allowed = (k <= q and k < length and not blinded) or k == q
            assert bool(mask[q, k]) == allowed, (q, k)


@pytest.mark.parametrize("kind", ["vq", "bsq"])
@pytest.mark.parametrize("mixer", [4, 0])
def test_blind_view_hides_exactly_the_source(kind, mixer):
    """Changing the source block's tokens leaves the blind scores unchanged (to float
    rounding) and changes the full scores; the conv mixer is covered (mixer=4)."""
    base = tiny_model(kind)  # seeds 0
    cfg = base.config.model_copy(update={"initializer_range": 0.3, "mixer_kernel": mixer})
    model = TinyUnifiedModel(cfg, tokenizer(), base.codec).eval()
    rows = _rows(model, 3)
    batch = _batch(model, rows)
    events = [e for e in scored_events(batch, ALL, 0) if e.source.start > 0]
    assert {e.direction for e in events} == {"visual_to_text", "text_to_visual"}
    for e in events:
        row = copy.deepcopy(rows[e.row])
        src = slice(e.source.start, e.source.end - 1)  # s_end predicts t's first token
        if e.source.visual:
            codes = row.visual_codes
            codes[src] = (1 - codes[src]) if kind == "bsq" else (codes[src] + 1) % 16
        else:
            row.token_ids[src] = torch.where(row.token_ids[src] == 0, 1, 0)
        changed = list(rows)
        changed[e.row] = row
        other = TrajectoryBatch.collate(changed, model.special_ids.pad, validate=False)
        b1, _ = blind_scores(model, batch, [e], 4)
        b2, _ = blind_scores(model, other, [e], 4)
        # same shapes, same kernels; a blinded key's weight is exactly 0: exact
        assert torch.equal(b1, b2), e
        with torch.no_grad():
            f1, f2 = _full_scores(model, batch, [e]), _full_scores(model, other, [e])
        assert (f1 - f2).abs().min() > 1e-4, e
        assert (f1 - b1).abs().max() > 1e-4  # the blind view is not the full one


def test_blind_scores_are_chunk_invariant_and_match_one_view_at_a_time():
    model = tiny_model("bsq", init=0.3)
    batch = _batch(model, _rows(model, 3))
    events = scored_events(batch, ALL, 0)
    together, calls = blind_scores(model, batch, events, 64)
    assert calls == 1
    one, calls_one = blind_scores(model, batch, events, 1)
    assert calls_one == len(events)
    # one view per call or all in one batch: two fp32 paths (tests/tolerances.py); a score
    # sums a unit's log-probs, whose errors add linearly at most: |score| is the magnitude
    tol = logprob_bound(one, tiny_decoder_reductions(model.config, batch.token_ids.shape[1]))
    assert_within((together - one).abs(), tol, "chunking")


# -- numerics ---------------------------------------------------------------------------


def _reference_loss(full, blind, formulation, tau, eps):
    out = []
    for f, b in zip(full, blind):
        g = f - b
        if formulation == "absolute":
            out.append((g, -g, 1 / (1 + math.exp(g / (abs(b) + eps) / tau))))
        else:
            m = g / (abs(b) + eps)
            out.append((g, tau * math.log1p(math.exp(-m / tau)), 1 / (1 + math.exp(m / tau))))
    return out


@pytest.mark.parametrize("formulation", ["absolute", "relative_per_unit"])
def test_gains_losses_and_trajectory_first_reduction(formulation):
    gen = torch.Generator().manual_seed(3)
    full = -torch.rand(7, generator=gen) * 3
    blind = -torch.rand(7, generator=gen) * 3
    tau, eps = 0.25, 1e-4
    el = event_losses(full, blind, formulation, tau, eps)
    ref = _reference_loss(full.tolist(), blind.tolist(), formulation, tau, eps)
    # float32 elementwise chains on the same float32 inputs against a float64 reference
    # (elementwise_bound, paths=1; libm's exp/log1p counted as 2 roundings, their ulp):
    # gain: one subtraction, |g| <= 3; loss: the margin's + eps and division, softplus (exp,
    # log1p, its add) and x tau, slope <= 1 in m / tau, so at the scale max(3, |m| / tau);
    # gate: sigmoid's slope sigma(1 - sigma)|x| <= 0.224 times the margin's 3 roundings, plus
    # its own exp, add and reciprocal: 5 roundings of a value <= 1
    for k, (g, loss, gate) in enumerate(ref):
        x = abs(el.margin[k].item()) / tau
        assert abs(el.gain[k].item() - g) <= elementwise_bound(3.0, 1, paths=1), k
        assert abs(el.loss[k].item() - loss) <= elementwise_bound(max(3.0, x), 8, paths=1), k
        assert abs(el.gate[k].item() - gate) <= elementwise_bound(1.0, 5, paths=1), k
    # rows 0 (3 events), 2 (1 event), 5 (3 events); weights per event
    rows = [0, 0, 0, 2, 5, 5, 5]
    block = Block(0, 1, False)
    events = [Event(r, block, block, (1,)) for r in rows]
    weights = torch.tensor([1.0, 0.5, 1.0, 2.0, 1.0, 1.0, 0.0])
    total, n = trajectory_sum(el.loss, events, weights)
    per_row = {}
    for r, w, (_, loss, _) in zip(rows, weights.tolist(), ref):
        per_row.setdefault(r, []).append(w * loss)
    expected = sum(sum(v) / len(v) for v in per_row.values())
    assert n == 3 and total.item() == pytest.approx(expected, rel=1e-5)


def test_relative_gate_is_the_slope_of_the_loss():
    full = torch.tensor([-1.0, -2.0, -0.2], requires_grad=True)
    blind = torch.tensor([-1.5, -1.0, -0.2])
    el = event_losses(full, blind, "relative_per_unit", 0.25, 1e-4)
    el.loss.sum().backward()
    # dℓ/dS_full = −gate / (|S_blind| + ε)
    want = -el.gate / (blind.abs() + 1e-4)
    # two float32 elementwise chains: softplus' backward (exp, add, divide, x tau, / tau,
    # / (|b| + eps)) and sigmoid then a division: <= 6 roundings each at the scale |want|
    assert_within((full.grad - want).abs(), elementwise_bound(magnitude(want), 6), "slope")


def test_blind_scores_carry_no_gradient():
    model = tiny_model("vq", init=0.3).train()
    batch = _batch(model, _rows(model, 2))
    events = scored_events(batch, ALL, 0)
    blind, _ = blind_scores(model, batch, events, 8)
    assert not blind.requires_grad
    out = forward_interleaved(model, batch)
    text = torch.nn.functional.cross_entropy(out.text_logits, out.text_targets, reduction="none")
    logp = full_logp(out, text, _visual_ce(out))
    terms = ig_terms(model, batch, logp, ALL, 0)
    grads = torch.autograd.grad(
        terms.loss_sum, list(model.parameters()), allow_unused=True, retain_graph=True
    )
    # the same loss with the blind scores as plain constants gives the same gradient
    full = unit_scores(logp, events)
    el = event_losses(full, blind.clone(), "relative_per_unit", 0.25, 1e-4)
    loss, _ = trajectory_sum(el.loss, events, torch.ones(len(events)))
    ref = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    # one forward, two backwards through it from the same loss terms computed the same
    # way: the same kernels on the same shapes, the same bits
    for g, r in zip(grads, ref):
        assert (g is None) == (r is None)
        if g is not None:
            assert torch.equal(g, r)


# -- in the trainer ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def codec_dir(small_vq_dir):
    return small_vq_dir


def _trainer(cfg, run_dir, model):
    trajs = sft_trajectories(cfg, model, "train", cfg.data.train_size)
    source = DatasetSource(trajs, cfg.trainer.global_batch_size, cfg.data.seed, run_seed=3)
    return Trainer(model, source, SFTObjective(cfg.algorithm), cfg, run_dir, DistInfo(),
                   model.special_ids.pad)  # fmt: skip


def test_cycle_is_deterministic_across_resume(tmp_path, codec_dir):
    ig = {"weight": 0.5, "event_selection": "cycle", "blind_view_chunk_size": 3}
    sections = {
        "data": {"tasks": ["draw_then_answer", "i2t_mc"], "train_size": 4, "val_size": 0,
                 "test_size": 0},
        "algorithm": {"name": "sft", "information_gain": ig},
        "trainer": {"total_updates": 4, "global_batch_size": 4, "micro_batch_size": 2},
    }  # fmt: skip
    cfg = validate_config(tiny_config(tmp_path / "ref", codec_dir, **sections))
    model = build_model(cfg)
    reference = [m for _, m in _trainer(cfg, tmp_path / "ref", copy.deepcopy(model)).fit()]
    cut = validate_config(tiny_config(tmp_path / "cut", codec_dir, **sections))
    first = _trainer(cut, tmp_path / "cut", copy.deepcopy(model))
    seen = []
    for update, m in first.fit():
        seen.append(m)
        if update == 2:
            break
    resumed = _trainer(cut, tmp_path / "cut", copy.deepcopy(model))
    seen += [m for _, m in resumed.fit()]
    assert len(seen) == 4
    keys = ["loss", "ig/loss", "ig/visual_to_text/blind", "ig/text_to_visual/gain"]
    # the resumed run loads the saved state bitwise and runs the same kernels on the same
    # batches: the same numbers
    for a, b in zip(reference, seen):
        for k in keys:
            assert a[k] == b[k], k
    # the cycle moves: updates 1 and 2 score different visual->text events
    assert reference[0]["ig/visual_to_text/blind"] != reference[1]["ig/visual_to_text/blind"]
    assert reference[0]["ig/visual_to_text/events"] == 4  # one per row and direction


def test_ig_term_enters_the_loss_trajectory_first(tmp_path, codec_dir):
    """loss(IG) − loss(no IG) = weight · L_IG for the same batch and weights."""
    base = {"data": {"tasks": ["draw_then_answer"], "train_size": 4, "val_size": 0,
                     "test_size": 0},
            "trainer": {"total_updates": 1, "global_batch_size": 4, "micro_batch_size": 2}}  # fmt: skip
    out = {}
    for w in (0.0, 0.7):
        sections = {**base, "algorithm": {"name": "sft", "information_gain": {"weight": w}}}
        cfg = validate_config(tiny_config(tmp_path / f"w{w}", codec_dir, **sections))
        torch.manual_seed(0)
        model = build_model(cfg)
        out[w] = _trainer(cfg, tmp_path / f"w{w}", model).step()
    assert out[0.7]["loss"] - out[0.0]["loss"] == pytest.approx(0.7 * out[0.7]["ig/loss"], rel=1e-4)
    assert out[0.7]["ig/rows"] == 4


def test_janus_pro_blind_view(tmp_path):
    from uniweave.core.sample import ImagePart, Sample, TextPart
    from uniweave.models.janus_pro import JanusProModel
    from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path, TinyJanusSpec(initializer_range=0.2), ["a b c d"])
    model = JanusProModel.from_pretrained(ckpt).eval()
    side = model.image_size[0]
    gen = torch.Generator().manual_seed(0)
    pixels = torch.rand(side, side, 3, generator=gen).numpy()
    sample = Sample(
        id="j",
        parts=[TextPart("a b c d a b", "user"), ImagePart(pixels=pixels, role="assistant")],
        answer="",
    )
    traj = model.prompt_trajectory(sample, add_generation_prompt=False)
    batch = TrajectoryBatch.collate([traj], model.special_ids.pad)
    events = scored_events(batch, ALL, 0)
    # a Janus answer is text or one image: text-to-image rows hold one text->visual event
    assert [e.direction for e in events] == ["text_to_visual"]
    blind, _ = blind_scores(model, batch, events, 4)
    ids = traj.token_ids.clone()
    src = slice(1, events[0].source.end - 1)  # keep BOS and <begin_of_image>
    ids[src] = torch.where(ids[src] == ids[2], ids[3], ids[2])
    other = TrajectoryBatch.collate([dataclasses.replace(traj, token_ids=ids)],
                                    model.special_ids.pad)  # fmt: skip
    again, _ = blind_scores(model, other, events, 4)
    assert torch.equal(blind, again)  # same shapes and kernels, blinded keys weigh exactly 0
    with torch.no_grad():
        f1, f2 = _full_scores(model, batch, events), _full_scores(model, other, events)
    assert (f1 - f2).abs().max() > 1e-5


def test_validation_pins_the_cycle_and_probe_prints_the_four_self_scores(tmp_path, codec_dir):
    import io

    from uniweave.train.methods.sft.information_gain import ig_evaluation
    from uniweave.train.methods.sft.probe import run_probe

    sections = {
        "data": {"tasks": ["draw_then_answer"], "train_size": 4, "val_size": 2, "test_size": 0},
        "algorithm": {"name": "sft", "information_gain": {"weight": 1.0}},
    }
    cfg = validate_config(tiny_config(tmp_path / "run", codec_dir, **sections))
    model = build_model(cfg)
    rows = sft_trajectories(cfg, model, "val", 2)
    ig = cfg.algorithm.information_gain
    first, _ = ig_evaluation(model, rows, ig, model.special_ids.pad)
    assert first == ig_evaluation(model, rows, ig, model.special_ids.pad)[0]
    assert first["ig/visual_to_text/events"] == 2 and first["ig/text_to_visual/events"] == 2
    before = sorted(tmp_path.rglob("*"))
    out = io.StringIO()
    records = run_probe(cfg, 2, out)
    assert sorted(tmp_path.rglob("*")) == before  # writes nothing
    answers = [r for r in records if r["target"][1] == r["target"][0] + 3]
    assert len(answers) == 2 and all("s00" in r for r in answers)
    # S_10 hides v (the drawn image): it is the event's blind score; S_01 / S_00 differ
    for r in answers:
        assert r["s11"] == r["full"] and r["s10"] == r["blind"]
        assert r["s01"] != r["s11"] and r["s00"] != r["s10"]
    assert "necessity of v" in out.getvalue() and "mean visual_to_text" in out.getvalue()


def test_ig_rows_use_clean_context_under_bitflip():
    """With BitFlip on, the CE sees noisy input bits but the IG full view is clean: its
    scores equal those of a clean forward, and differ from the noisy forward's."""
    from uniweave.config.algorithms import SFTConfig

    model = tiny_model("bsq", init=0.3).train()
    rows = [dataclasses.replace(r, seed=11 + k) for k, r in enumerate(_rows(model, 2))]
    batch = _batch(model, rows)
    ig = {"weight": 1.0, "event_selection": "all"}
    objective = SFTObjective(SFTConfig(bitflip={"probability": 0.5}, information_gain=ig))
    objective.begin_update(0, [batch], DistInfo())
    _, stats = objective.loss(model, batch, objective.count(batch))
    events = scored_events(batch, ALL, 0)
    with torch.no_grad():
        clean = _full_scores(model, batch, events)
        out = forward_interleaved(model, batch, objective._noisy_inputs(model, batch))
        text = torch.nn.functional.cross_entropy(
            out.text_logits, out.text_targets, reduction="none"
        )
        noisy = unit_scores(full_logp(out, text, _visual_ce(out)), events)
    for d in ("text_to_visual", "visual_to_text"):
        sel = torch.tensor([e.direction == d for e in events])
        assert stats[f"ig/{d}/full_sum"] == pytest.approx(float(clean[sel].sum()), rel=1e-5)
    assert (clean - noisy).abs().max() > 1e-4


def test_a_direction_weighted_zero_is_not_scored():
    model = tiny_model("vq")
    batch = _batch(model, _rows(model, 2))
    only = InformationGainConfig(weight=1.0, event_selection="all", text_to_visual_weight=0.0)
    events = scored_events(batch, only, 0)
    assert events and all(e.direction == "visual_to_text" for e in events)
    assert events == [e for e in scored_events(batch, ALL, 0) if e.direction == "visual_to_text"]


def test_ig_gradient_is_invariant_to_the_micro_batch_split(tmp_path, codec_dir):
    """Trajectory-first over the global batch: micro-batches of 4, 2 or 1 rows give one
    gradient (rows contribute different event counts: i2t_mc 1, draw_then_answer 2)."""
    grads = {}
    for micro in (4, 1):
        sections = {
            "data": {"tasks": ["draw_then_answer", "i2t_mc"], "train_size": 2, "val_size": 0,
                     "test_size": 0},
            "algorithm": {"name": "sft", "information_gain": {"weight": 2.0}},
            "trainer": {"total_updates": 1, "global_batch_size": 4, "micro_batch_size": micro},
        }  # fmt: skip
        cfg = validate_config(tiny_config(tmp_path / f"m{micro}", codec_dir, **sections))
        torch.manual_seed(0)
        trainer = _trainer(cfg, tmp_path / f"m{micro}", build_model(cfg))
        trainer.accumulate()
        grads[micro] = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    # float32, the global batch's gradient summed in micro-batches of 4 or 1 rows
    whole = TrajectoryBatch.collate(trainer.source.global_batch(0), trainer.pad_id)
    n = gradient_reductions(
        tiny_decoder_reductions(trainer.model.config, whole.token_ids.shape[1]),
        int(whole.attention_mask.sum()),
    )
    for name, g in grads[4].items():
        assert_within((g - grads[1][name]).abs(), reduction_bound(magnitude(g), n), name)


def test_validation_logs_ig_metrics(tmp_path, codec_dir, classifier_dir):
    import shutil

    from uniweave.rewards.digit_classifier import CLASSIFIER_DIR
    from uniweave.train.run import _val_evaluator

    sections = {
        "data": {"tasks": ["draw_then_answer"], "train_size": 2, "val_size": 2, "test_size": 0},
        "algorithm": {"name": "sft", "information_gain": {"weight": 1.0}},
    }
    cfg = validate_config(tiny_config(tmp_path / "run", codec_dir, **sections))
    shutil.copytree(classifier_dir, tmp_path / "run" / CLASSIFIER_DIR)
    model = build_model(cfg)
    metrics = _val_evaluator(cfg, model, tmp_path / "run")(1)
    assert metrics["val/ig/visual_to_text/events"] == 2  # one per row (cycle pinned)
    assert "val/draw_then_answer/exact_match" in metrics
    assert "val/ig/text_to_visual/saturation" in metrics


def test_uniar_blind_view():
    """UniAR (Qwen3-VL + BSQ): the [B, T, T] blind mask reaches transformers' attention,
    so the answer's blind score ignores the drawn image (its shown image is read through
    the vision tower: text-modality placeholders, part of the first text block)."""
    from model_fixtures import UNIAR_SIZES, random_bsq_codec

    from uniweave.models.uniar import build_tiny_uniar

    model = build_tiny_uniar(random_bsq_codec(16, 2, 1), UNIAR_SIZES, seed=0).eval()
    sample = make_task_samples("draw_then_answer", "val", 1, seed=2)[0]
    traj = model.prompt_trajectory(sample, add_generation_prompt=False)
    batch = TrajectoryBatch.collate([traj], model.special_ids.pad)
    events = scored_events(batch, ALL, 0)
    assert [e.direction for e in events] == ["text_to_visual", "visual_to_text"]
    e = events[1]
    row = copy.deepcopy(traj)
    src = slice(e.source.start, e.source.end - 1)  # s_end predicts t's first token
    row.visual_codes[src] = 1 - row.visual_codes[src]
    other = TrajectoryBatch.collate([row], model.special_ids.pad, validate=False)
    b1, _ = blind_scores(model, batch, [e], 4)
    b2, _ = blind_scores(model, other, [e], 4)
    assert torch.equal(b1, b2)  # same shapes and kernels, blinded keys weigh exactly 0
    with torch.no_grad():
        f1, f2 = _full_scores(model, batch, [e]), _full_scores(model, other, [e])
    assert (f1 - f2).abs().max() > 1e-3
    assert (f1 - b1).abs().max() > 1e-3  # the blind view is not the full one
