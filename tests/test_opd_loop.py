"""The OPD loop on the shared trainer: the objective against an independent computation
(VQ and BSQ), the privileged teacher's alignment, the frozen teacher, the action-space
check, every routing x GT-replay combination, and exact resume (SIGKILL during the
rollout and during an update; --stop-after-updates; a changed teacher is refused)."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tolerances import (
    assert_within,
    elementwise_bound,
    fp64_forward_bound,
    gradient_reductions,
    logprob_bound,
    magnitude,
    mixed_fp64_bound,
    reduction_bound,
    rmsnorm_fp32_reductions,
    tiny_decoder_reductions,
)
from trainer_helpers import (
    assert_same_state,
    checkpoint_tensors,
    opd_config,
    run_cli,
    write_config,
)

from uniweave.algorithms.opd import event_index
from uniweave.algorithms.sft import text_ce, visual_ce
from uniweave.codecs import build_codec
from uniweave.config import ConfigError, validate_config
from uniweave.config.algorithms import ModalityWeights
from uniweave.core.distributions import jsd_from_logp
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.data.digits import make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.forward import forward_interleaved, scored_mask
from uniweave.models.build import build_model
from uniweave.replay import replay_distributions
from uniweave.rewards import PLUGINS, RewardError, RewardPlugin
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.errors import TrainingError
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.opd.job import build_opd_job
from uniweave.train.methods.opd.objective import OPDObjective, check_action_spaces
from uniweave.train.methods.opd.source import DistillRecord, teacher_view

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on 1 thread


@pytest.fixture(scope="module")
def assets(tmp_path_factory, small_vq_dir, small_bsq_dir, classifier_dir):
    root = tmp_path_factory.mktemp("opd_assets")
    out = {"clf": classifier_dir, "vq": small_vq_dir, "bsq": small_bsq_dir}
    for kind in ("vq", "bsq"):
        cfg = validate_config(opd_config(root / "x", out, kind, seed=9))
        build_model(cfg).save_pretrained(root / f"teacher_{kind}")
        out[f"teacher_{kind}"] = root / f"teacher_{kind}"
    return out


def make_trainer(cfg: dict) -> Trainer:
    cfg = validate_config(cfg)
    run_dir = Path(cfg.run.output_dir)
    model = build_model(cfg).train()
    source, objective = build_opd_job(cfg, model, run_dir, DistInfo())
    pad = model.special_ids.pad
    return Trainer(model, source, objective, cfg, run_dir, DistInfo(), pad)


def loss_bound(objective: OPDObjective, model, micro: TrajectoryBatch, loss: float) -> float:
    """The float32 objective against `reference_loss` (float64 divergences of float32
    distributions): a position's divergence moves by at most its log-probs' error on each
    side (its slope in each side's log-probs is a probability-weighted log-ratio, the
    slopes summing to <= 1 per side), each log-prob within `logprob_bound` of its forward
    at the scale 2 max|logit| + log V (any log-softmax value is within it); the loss adds
    the float32 means over the batch's positions."""
    n_pos = int(micro.attention_mask.sum())
    total = reduction_bound(loss, n_pos)
    for net in (model, objective.teacher):
        with torch.no_grad():
            out = forward_interleaved(net, micro)
        logits = [z for z in (out.text_logits, out.visual_logits) if z is not None and z.numel()]
        scale = max(2 * magnitude(z) + math.log(max(z.shape[-1], 2)) for z in logits)
        n = tiny_decoder_reductions(net.config, micro.token_ids.shape[1])
        total += logprob_bound(scale, n)
    return total


def reference_loss(
    objective: OPDObjective,
    model,
    micro: TrajectoryBatch,
    text_clip: float | None = None,
    carriers: torch.Tensor | None = None,
    differentiable: bool = False,
) -> float | torch.Tensor:
    """The OPD loss of a micro-batch from the full distributions of both models
    (`replay_distributions`), core's dense `jsd_from_logp`, explicit per-row loops over
    events and a separate SFT forward for the GT rows, divided by the row count. With
    `text_clip` c a row's text part (its events' text positions summed, each event
    divided by all its positions, averaged over events) counts min(part, c). With
    `carriers` (bool [B, T] of the distilled rows) an event keeps only its carrier
    positions and an event without one is dropped. `differentiable`: the student side
    keeps its graph and the loss comes back as a tensor (teacher still no grad)."""
    a = objective.algo
    distil, gt = objective._split(micro)
    total, n = torch.zeros((), dtype=torch.float64), 0
    if distil:
        batch = micro[distil].without_training_data()
        records = list(batch.sampling)
        views = [teacher_view(t, r) for t, r in zip(batch.unbatch(), records)]
        tbatch = TrajectoryBatch.collate(views, batch.pad_id)
        trecs = [r if r.teacher_prompt is None else
                 DistillRecord(r.params, len(r.teacher_prompt), r.seed) for r in records]  # fmt: skip
        d = torch.zeros(batch.token_ids.shape, dtype=torch.float64)
        with torch.set_grad_enabled(differentiable):
            with torch.no_grad():
                teacher = list(
                    replay_distributions(objective.teacher, tbatch, trecs, chunk_size=1000)
                )
            pairs = zip(replay_distributions(model, batch, records, chunk_size=1000), teacher)
            for s, t in pairs:
                if batch.is_bits and s.modality == Modality.VISUAL:
                    ps, qs = _pairs(s.dist), _pairs(t.dist)
                    val = jsd_from_logp(ps.double(), qs.double(), a.beta).mean(-1)
                else:
                    val = jsd_from_logp(
                        s.dist.log_probs.double(), t.dist.log_probs.double(), a.beta
                    )
                d[s.rows, s.cols] = val
        w = {False: a.modality_weights.text, True: a.modality_weights.visual}
        for b in range(len(batch)):
            row = batch[[b]]
            events = event_index(scored_mask(row), row.modality, row.finish_reasons, a.events)
            parts = {False: [], True: []}  # text / visual share of each event's mean
            vis = batch.modality[b] == Modality.VISUAL
            for e in range(len(events.kinds[0])):
                ts = (events.index[0] == e).nonzero().flatten().tolist()
                if carriers is not None:
                    ts = [t for t in ts if bool(carriers[b, t])]
                    if not ts:
                        continue
                for modality, share in parts.items():
                    terms = [w[modality] * d[b, t] for t in ts if bool(vis[t]) == modality]
                    share.append(sum(terms) / len(ts))
            if parts[True]:
                text = sum(parts[False]) / len(parts[False])
                if text_clip is not None:
                    text = min(text, text_clip)
                total += sum(parts[True]) / len(parts[True]) + text
                n += 1
    if gt:
        with torch.set_grad_enabled(differentiable):
            out = forward_interleaved(model, micro[gt])
        w = objective.algo.modality_weights
        for j in range(len(gt)):
            ce = [
                w.text * v.double()
                for v, r in zip(text_ce(out.text_logits, out.text_targets), out.text_index.rows)
                if r == j
            ]
            ce += [w.visual * v.double() for v, r in
                   zip(visual_ce(out.visual_logits, out.visual_targets), out.visual_index.rows)
                   if r == j]  # fmt: skip
            total += sum(ce) / len(ce)
            n += 1
    return total / n if differentiable else float(total / n)


def _pairs(dist) -> torch.Tensor:
    ones = torch.ones(dist.logits.shape)
    return torch.stack([dist.log_prob_factors(ones), dist.log_prob_factors(1 - ones)], -1)


@pytest.mark.parametrize(
    "kind,algo",
    [
        ("vq", {}),
        (
            "vq",
            {
                "beta": 0.0,
                "top_k": 3,
                "retained_mass_min": 1.0,
                "gt_replay": {"mode": "uniform", "budget": 2},
                "modality_weights": {"text": 0.5, "visual": 2.0},
            },
        ),  # fmt: skip
        (
            "vq",
            {
                "beta": 1.0,
                "routing": "privileged_correction",
                "teacher": {"privilege": "answer"},
                "events": "first_complete_window",
            },
        ),  # fmt: skip
        ("bsq", {"beta": 0.3, "gt_replay": {"mode": "uniform", "budget": 1}}),
    ],
)
def test_objective_matches_an_independent_computation(tmp_path, assets, kind, algo):
    """(top-K with retained_mass_min 1 falls back to the full vocabulary wherever the
    union loses mass: the full-distribution reference holds at every position.)"""
    cfg = opd_config(tmp_path / "run", assets, kind, **algo)
    if "teacher" in algo:
        cfg["algorithm"]["teacher"] = {"path": str(assets[f"teacher_{kind}"]), **algo["teacher"]}
    trainer = make_trainer(cfg)
    trajs = trainer.source.global_batch(0)
    micro = TrajectoryBatch.collate(trajs, trainer.pad_id)
    n = trainer.objective.count(micro)
    assert n > 0
    loss, _ = trainer.objective.loss(trainer.model, micro, n)
    expected = reference_loss(trainer.objective, trainer.model, micro)
    tol = loss_bound(trainer.objective, trainer.model, micro, expected)
    assert_within(abs(loss.item() - expected), tol, "opd loss")
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())
    teacher = trainer.objective.teacher
    assert not teacher.training and all(not p.requires_grad for p in teacher.parameters())
    in_opt = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not in_opt & {id(p) for p in teacher.parameters()}


def test_a_teacher_equal_to_the_student_gives_zero_and_privilege_does_not(tmp_path, assets):
    """The teacher = the student's own weights: the plain JSD is 0 at every position; the
    privileged teacher (answer in its prompt, positions realigned) differs."""
    cfg = opd_config(tmp_path / "run", assets)
    student = build_model(validate_config(cfg))
    student.save_pretrained(tmp_path / "same")
    cfg["algorithm"]["teacher"]["path"] = str(tmp_path / "same")
    plain = make_trainer(cfg)
    micro = TrajectoryBatch.collate(plain.source.global_batch(0), plain.pad_id)
    loss, stats = plain.objective.loss(plain.model, micro, plain.objective.count(micro))
    # the same weights, kernels and shapes: identical log-probs; the mixture m = (1 - b)p +
    # b p of two equal distributions is p (1 + e), |e| <= ~6 roundings (two products, the
    # sum, or their log-space logaddexp), and the JSD is then <= |e| per position
    per_position = elementwise_bound(1.0, 6, paths=1)
    assert abs(loss.item()) <= per_position and stats["n_text"] > 0
    assert abs(stats["jsd_text_sum"]) <= stats["n_text"] * per_position
    cfg["algorithm"]["teacher"]["privilege"] = "answer"
    priv = make_trainer(cfg)
    micro = TrajectoryBatch.collate(priv.source.global_batch(0), priv.pad_id)
    assert all(r.teacher_prompt is not None for r in micro.sampling)
    loss, _ = priv.objective.loss(priv.model, micro, priv.objective.count(micro))
    assert loss.item() > 1e-4


def test_action_spaces_must_match(tmp_path, assets):
    vq = build_model(validate_config(opd_config(tmp_path / "a", assets, "vq")))
    bsq = build_model(validate_config(opd_config(tmp_path / "b", assets, "bsq")))
    with pytest.raises(ConfigError, match="algorithm.teacher.path: the teacher's visual head"):
        check_action_spaces(vq, bsq)
    other = tmp_path / "vq_other"  # the same codebook size, fitted on other images
    build_codec("vq", codebook_size=16, n_init=1, max_iter=20).fit(
        load_split("train").images[300:600], seed=1
    ).save_pretrained(other)
    refit = build_model(validate_config(opd_config(tmp_path / "c", {**assets, "vq": other})))
    with pytest.raises(ConfigError, match="image codec differs"):
        check_action_spaces(vq, refit)
    check_action_spaces(vq, build_model(validate_config(opd_config(tmp_path / "d", assets))))


ROUTES = [
    (routing, replay)
    for routing in ("all", "correct_only", "privileged_correction")
    for replay in ("none", "uniform", "failure")
    if not (routing == "all" and replay == "failure")
]


@pytest.mark.parametrize("routing,replay", ROUTES)
def test_every_valid_routing_and_replay_runs_an_update(tmp_path, assets, routing, replay):
    algo = {
        "routing": routing,
        "gt_replay": {"mode": replay, "budget": 0 if replay == "none" else 2},
    }
    if routing == "privileged_correction":
        algo["teacher"] = {"path": str(assets["teacher_vq"]), "privilege": "answer"}
    cfg = opd_config(tmp_path / "run", assets, **algo)
    if "teacher" in algo:
        cfg["algorithm"]["teacher"] = algo["teacher"]
    cfg["trainer"]["total_updates"] = 1
    trainer = make_trainer(cfg)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    (_, m), *_ = list(trainer.fit())
    counts = m["route/n_plain"] + m["route/n_privileged"] + m["route/n_dropped"]
    assert counts == 6
    assert m["replay/n_gt_rows"] == (0 if replay == "none" else min(2, 6))
    if routing == "correct_only":
        assert m["route/n_privileged"] == 0 and m["route/n_plain"] == 6 * m["route/correct_frac"]
    if routing == "privileged_correction":
        assert m["route/n_dropped"] == 0
        assert m["route/n_privileged"] == round(6 * (1 - m["route/correct_frac"]))
    if routing == "all":
        assert m["route/n_plain"] == 6
    trained = m["opd/n_distilled_rows"] + m["opd/n_gt_rows"] > 0
    moved = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert moved == trained


def test_failure_replay_without_a_verifier_routing_exits_2(tmp_path, assets):
    cfg = opd_config(tmp_path / "run", assets, gt_replay={"mode": "failure", "budget": 2})
    done = run_cli(["train", str(write_config(tmp_path / "c.yaml", cfg))])
    assert done.returncode == 2
    assert "algorithm.gt_replay.mode: 'failure' needs a verifier routing" in done.stderr
    assert not (tmp_path / "run").exists()


class _RaisesOnPrompt1(RewardPlugin):
    name = "raises_on_prompt_1"

    def score(self, samples, responses):
        if any(s.id == "prompt-1" for s in samples):
            raise RuntimeError("scorer crashed")
        return [1.0] * len(samples)


def test_a_failing_verifier_names_the_update_and_the_dataset_row(tmp_path, assets, monkeypatch):
    """The rollout round GRPO and OPD share (`uniweave.train.onpolicy.rounds`): a reward
    error names the update and the dataset row of the failing prompt, as GRPO's does."""
    monkeypatch.setitem(PLUGINS, _RaisesOnPrompt1.name, _RaisesOnPrompt1)
    cfg = opd_config(tmp_path / "run", assets)
    cfg["reward"] = {"plugins": [{"name": _RaisesOnPrompt1.name}]}
    trainer = make_trainer(cfg)
    row = trainer.source.prompt_sampler.prompts(0, 6)[1].meta["source_id"]
    match = (
        r"update 1: reward plugin 'raises_on_prompt_1' failed on sample 'prompt-1': .*"
        rf"\(prompt-1 is dataset row '{row}'\)"
    )
    with pytest.raises(RewardError, match=match):
        next(iter(trainer.fit()))


def _final(run_dir: Path):
    last = sorted((run_dir / "checkpoints").glob("update-*"))[-1]
    return checkpoint_tensors(last)


def test_sigkill_during_rollout_and_update_and_stop_after_resume_bitwise(tmp_path, assets):
    def config(name: str) -> Path:
        cfg = opd_config(tmp_path / name, assets, top_k=3, retained_mass_min=0.5,
                         routing="correct_only", gt_replay={"mode": "failure", "budget": 2})  # fmt: skip
        cfg["trainer"]["total_updates"] = 6
        return write_config(tmp_path / f"{name}.yaml", cfg)

    reference = run_cli(["train", str(config("ref"))])
    assert reference.returncode == 0, reference.stderr[-2000:]
    path = config("killed")
    for fault in ("rollout:3", "update:5"):
        killed = run_cli(["train", str(path)], env_extra={"UNIWEAVE_FAULT": fault})
        assert killed.returncode == -9, (fault, killed.stderr[-2000:])
    assert run_cli(["train", str(path)]).returncode == 0
    stopped = config("stopped")
    first = run_cli(["train", str(stopped), "--stop-after-updates", "3"])
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").glob("update-*"))[-1] == (
        "update-000003"
    )
    assert not (tmp_path / "stopped" / "model").exists()
    assert run_cli(["train", str(stopped)]).returncode == 0
    ref = _final(tmp_path / "ref")
    for name in ("killed", "stopped"):
        got = _final(tmp_path / name)
        assert_same_state(ref[0], got[0], f"{name} model")
        assert_same_state(ref[1], got[1], f"{name} optimizer")


def test_resume_against_a_changed_teacher_is_refused(tmp_path, assets):
    teacher = tmp_path / "teacher"
    shutil.copytree(assets["teacher_vq"], teacher)
    cfg = opd_config(tmp_path / "run", assets)
    cfg["algorithm"]["teacher"]["path"] = str(teacher)
    for _ in make_trainer(cfg).fit():
        pass
    weights = next(teacher.glob("*.safetensors"))
    from safetensors.torch import load_file, save_file

    state = load_file(str(weights))
    key = next(iter(state))
    state[key] = state[key] + 1
    save_file(state, str(weights))
    cfg["trainer"]["total_updates"] = 3
    with pytest.raises(TrainingError, match="refusing to resume .* trained against"):
        for _ in make_trainer(cfg).fit():
            pass


def _one_update_of_a_family(tmp_path, model: dict, teacher, max_new_tokens: int) -> None:
    """One OPD update on t2i and i2t_mc rows with `model` as student and `teacher`: the
    loss equals the independent computation, text and visual positions are both
    distilled, the student moves and the teacher does not."""
    cfg = {
        "run": {"name": "f", "seed": 0, "output_dir": str(tmp_path / "run"), "device": "cpu"},
        "model": model,
        "data": {"tasks": ["t2i", "i2t_mc"], "train_size": 8, "val_size": 0, "test_size": 0},
        "rollout": {"batch_size": 16, "max_new_tokens": max_new_tokens},
        "algorithm": {"name": "opd", "teacher": {"path": str(teacher)}},
        "trainer": {"total_updates": 1, "global_batch_size": 4, "micro_batch_size": 4},
        "checkpoint": {"every_updates": 0},
        "logging": {"tensorboard": False, "progress_bar": False},
    }
    trainer = make_trainer(cfg)
    micro = TrajectoryBatch.collate(trainer.source.global_batch(0), trainer.pad_id)
    n = trainer.objective.count(micro)
    loss, stats = trainer.objective.loss(trainer.model, micro, n)
    assert loss.item() == pytest.approx(
        reference_loss(trainer.objective, trainer.model, micro), rel=1e-4
    )
    assert stats["n_visual"] > 0 and stats["n_text"] > 0
    t_before = [p.clone() for p in trainer.objective.teacher.parameters()]
    s_before = [p.detach().clone() for p in trainer.model.parameters()]
    (_, m), *_ = list(trainer.fit())
    assert m["opd/jsd_visual"] > 0 and m["opd/jsd_text"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(s_before, trainer.model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(t_before, trainer.objective.teacher.parameters()))


def test_janus_pro_student_and_teacher_run_one_update(tmp_path):
    """A tiny random Janus-Pro student and a same-family teacher (another seed and width,
    the same tokenizer, image grid and codebook size) run one OPD update."""
    from uniweave.data.digits import vocabulary_texts
    from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint

    texts = vocabulary_texts()
    student = write_tiny_checkpoint(tmp_path / "student", TinyJanusSpec(grid=2), texts)
    teacher = write_tiny_checkpoint(
        tmp_path / "teacher", TinyJanusSpec(grid=2, hidden_size=48, seed=1), texts
    )
    _one_update_of_a_family(tmp_path, {"kind": "janus_pro", "path": str(student)}, teacher, 6)


def test_uniar_student_and_teacher_run_one_update(tmp_path):
    """A tiny random UniAR student and a same-family teacher (another seed, the same
    tokenizer and BSQ codec: 16-bit visual positions) run one OPD update; rows need room
    for a 4x4 image and its header, hence 24 new tokens."""
    from model_fixtures import UNIAR_SIZES, random_bsq_codec

    from uniweave.models.uniar import build_tiny_uniar

    codec = random_bsq_codec(16, 2, 1)
    build_tiny_uniar(codec, UNIAR_SIZES, seed=0).save_pretrained(tmp_path / "student")
    build_tiny_uniar(codec, UNIAR_SIZES, seed=1).save_pretrained(tmp_path / "teacher")
    model = {"kind": "uniar", "path": str(tmp_path / "student"), "visual_head": "bsq"}
    _one_update_of_a_family(tmp_path, model, tmp_path / "teacher", 24)


# -- gradient diagnostics and text contribution clipping (issue 33) -----------------
def count_backwards(monkeypatch) -> list[str]:
    """Every `Tensor.backward` and `torch.autograd.grad` call from now on, by name (each
    is still run: the counter wraps them)."""
    calls: list[str] = []
    backward, grad = torch.Tensor.backward, torch.autograd.grad

    def counted_backward(self, *args, **kwargs):
        calls.append("backward")
        return backward(self, *args, **kwargs)

    def counted_grad(*args, **kwargs):
        calls.append("grad")
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", counted_backward)
    monkeypatch.setattr(torch.autograd, "grad", counted_grad)
    return calls


def test_gradient_diagnostics_equal_two_separate_backwards_from_one(tmp_path, assets, monkeypatch):
    """6 distilled + 2 GT rows in micro-batches of 2. With the diagnostics on, the update
    runs one backward per micro-batch (4, as with them off) and logs the pre-clip norms,
    ratio and cosine of the distillation and GT-replay gradients; an independent
    computation — each part's rows as one micro-batch, its own backward from zero
    gradients — gives the same figures to 1e-5. Bound: both sides hold fp32 gradients of
    the same loss terms summed in another order (3 micro-batches vs 1, other padding
    widths), each element off by a few fp32 roundings of its terms, |err| <~ 1e-6 of the
    gradient's scale; norms, dot product and cosine are then formed in float64, so they
    carry that relative error (the cosine at most twice it) — 1e-5 leaves a factor 10.
    The total gradient equals the diagnostics-off update's to 1e-6 (§15: another float32
    order of the same objective)."""
    algo = {"gt_replay": {"mode": "uniform", "budget": 2}}
    cfg = opd_config(tmp_path / "on", assets, **algo)
    cfg["trainer"]["micro_batch_size"] = 2
    cfg["logging"] = {**cfg.get("logging", {}), "gradient_diagnostics_every_updates": 1}
    on = make_trainer(cfg)
    calls = count_backwards(monkeypatch)
    metrics = on.accumulate()
    assert calls == ["backward"] * 4
    total = [p.grad.detach().clone() for p in on.params]

    trajs = on.source.global_batch(0)
    objective = on.objective
    parts = [[t for t in trajs if objective.in_second_part(t) == second] for second in (0, 1)]
    assert [len(p) for p in parts] == [6, 2]
    micros = [TrajectoryBatch.collate(p, on.pad_id) for p in parts]
    n_global = sum(objective.count(m) for m in micros)
    grads = []
    for micro in micros:
        on.optimizer.zero_grad(set_to_none=True)
        objective.loss(on.model, micro, n_global)[0].backward()
        grads.append(torch.cat([p.grad.double().flatten() for p in on.params]))
    na, nb = grads[0].norm().item(), grads[1].norm().item()
    assert metrics["grad/opd_norm"] == pytest.approx(na, rel=1e-5)
    assert metrics["grad/gt_replay_norm"] == pytest.approx(nb, rel=1e-5)
    assert metrics["grad/opd_to_gt_replay_norm_ratio"] == pytest.approx(na / nb, rel=1e-5)
    cosine = float(grads[0] @ grads[1]) / (na * nb)
    # bound: the docstring's: ~1e-6 relative gradient error, cosine off by twice it
    assert metrics["grad/opd_gt_replay_cosine"] == pytest.approx(cosine, rel=1e-5, abs=1e-6)
    summed = torch.cat([g.double().flatten() for g in total])
    # float32 gradients over other micro-batch geometries (tests/tolerances.py)
    whole = TrajectoryBatch.collate(trajs, on.pad_id)
    n_red = gradient_reductions(
        tiny_decoder_reductions(on.model.config, whole.token_ids.shape[1]),
        int(whole.attention_mask.sum()),
    )
    tol = reduction_bound(magnitude(summed), n_red)
    assert_within((summed - (grads[0] + grads[1])).abs(), tol, "summed parts")

    cfg["logging"]["gradient_diagnostics_every_updates"] = 0
    cfg["run"]["output_dir"] = str(tmp_path / "off")
    off = make_trainer(cfg)
    calls.clear()
    plain = off.accumulate()
    assert calls == ["backward"] * 4 and not any(k.startswith("grad/") for k in plain)
    # the diagnostics' split adds (g1 + g2 + g3) + g4, the order of the plain
    # accumulation, on the same micro-batches: the same bits
    for a, b in zip(total, off.params):
        assert torch.equal(a, b.grad)


def answer_rows(trainer: Trainer, n: int) -> TrajectoryBatch:
    """`n` draw-then-answer rows (text, image, text: both parts in one row) with their
    reference answers as the distilled response, ended by eos (every segment complete):
    a random student's own rollouts rarely finish a text segment."""
    params = trainer.source.params
    rows = [
        replace(
            trainer.model.prompt_trajectory(s, add_generation_prompt=False),
            sampling=DistillRecord(params, None, k),
            finish_reason="eos",
        )
        for k, s in enumerate(make_task_samples("draw_then_answer", "train", n, seed=0))
    ]
    return TrajectoryBatch.collate(rows, trainer.pad_id)


def test_text_clip_matches_an_independent_computation(tmp_path, assets):
    """`algorithm.text_clip` c: the loss equals the reference with each distilled row's
    text part replaced by min(part, c) to 1e-6 (the float64 reference against the fp32
    objective on the same full-vocabulary divergences: fp32 rounding of log-probs and
    divergences, ~1e-7 relative each, summed over a few hundred positions); c is the
    median text part, so some rows clip and some do not. Gradient: the clip scales row
    i's text gradient by s_i = min(1, c / T_i), so it equals the gradient of the
    unclipped objective with text weight s_i, row by row (one-row micro-batches, summed)
    — to 1e-5 (other batch shapes, fp32 gradients summed in another order)."""
    cfg = opd_config(tmp_path / "run", assets)
    cfg["algorithm"]["text_clip"] = 1e9  # measure: never clips
    wide = make_trainer(cfg)
    micro = answer_rows(wide, 6)
    n = wide.objective.count(micro)
    assert n == 6
    parts = [wide.objective.loss(wide.model, micro[[b]], 1)[1]["text_part_sum"] for b in range(6)]
    c = sorted(parts)[3]
    assert 0 < min(parts) < c < max(parts)
    cfg["algorithm"]["text_clip"] = c
    clipped = make_trainer(cfg)
    loss, stats = clipped.objective.loss(clipped.model, micro, n)
    expected = reference_loss(clipped.objective, clipped.model, micro, text_clip=c)
    unclipped = reference_loss(clipped.objective, clipped.model, micro)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert unclipped - expected > 1e-3 * expected  # the clip's effect: >= 1000x the tolerance
    assert stats["text_clipped_rows"] == sum(p > c for p in parts) > 0
    clipped.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    got = torch.cat([p.grad.flatten() for p in clipped.params])
    want = torch.zeros_like(got)
    for b, part in enumerate(parts):
        weights = {"text": min(1.0, c / part), "visual": 1.0}
        algo = clipped.objective.algo.model_copy(
            update={"text_clip": None, "modality_weights": ModalityWeights(**weights)}
        )
        clipped.optimizer.zero_grad(set_to_none=True)
        objective = OPDObjective(algo, clipped.objective.teacher, {})
        objective.loss(clipped.model, micro[[b]], n)[0].backward()
        want += torch.cat([p.grad.flatten() for p in clipped.params])
    # float32 gradients, one batch against one-row micro-batches (tests/tolerances.py)
    n_red = gradient_reductions(
        tiny_decoder_reductions(clipped.model.config, micro.token_ids.shape[1]),
        int(micro.attention_mask.sum()),
    )
    assert_within((got - want).abs(), reduction_bound(magnitude(want), n_red), "clip grad")


def test_text_clip_and_gradient_diagnostics_are_refused_where_they_cannot_act():
    opd = {"name": "opd", "teacher": {"path": "t"}}
    gt = {"gt_replay": {"mode": "uniform", "budget": 1}}
    key = "logging.gradient_diagnostics_every_updates"
    diag = {"logging": {"gradient_diagnostics_every_updates": 2}}
    cases = [
        ({**diag, "algorithm": {"name": "grpo"}, "reward": {"plugins": [{"name": "mc_exact"}]}},
         key, "acts only with opd"),
        ({**diag, "algorithm": opd}, key, "acts only with GT replay"),
        ({**diag, "algorithm": {**opd, **gt}, "trainer": {"parallel": "ddp"}}, key,
         "built for one process"),
        ({"algorithm": {**opd, "text_clip": 1.0, "modality_weights": {"text": 0.0}}},
         "algorithm.text_clip", "acts only with modality_weights.text > 0"),
        ({"algorithm": {**opd, "text_clip": 0.0}}, "algorithm.text_clip", "greater than 0"),
        ({"algorithm": {**opd, "retained_mass_min": 0.5}}, "algorithm.retained_mass_min",
         "has no effect with top_k 0"),
    ]  # fmt: skip
    for case, where, fragment in cases:
        with pytest.raises(ConfigError, match=fragment) as info:
            validate_config(case)
        assert info.value.key == where
    validate_config({**diag, "algorithm": {**opd, **gt}})
    validate_config({"algorithm": {**opd, "text_clip": 1.0}})
    validate_config({"algorithm": {**opd, "retained_mass_min": 0.95}})  # the default: harmless
    validate_config({"algorithm": {**opd, "retained_mass_min": 0.5, "top_k": 2}})


def _independent_carriers(teacher, batch: TrajectoryBatch, threshold: float) -> torch.Tensor:
    """bool [B, T] of distilled rows: teacher log-prob of the target in the ordinary
    forward of its own view minus that with the event's source blinded (IG's blind view,
    one single-position event at a time), ≥ threshold; in student coordinates."""
    from uniweave.algorithms.information_gain import Event, batch_events
    from uniweave.train.methods.sft.information_gain import blind_scores

    records = list(batch.sampling)
    views = [teacher_view(t, r) for t, r in zip(batch.unbatch(), records)]
    shift = [len(v) - len(t) for v, t in zip(views, batch.unbatch())]
    tbatch = TrajectoryBatch.collate(views, batch.pad_id)
    scored = scored_mask(tbatch)
    per_row = batch_events(tbatch.modality == Modality.VISUAL, scored, tbatch.lengths)
    singles = [Event(e.row, e.source, e.target, (p,)) for row in per_row for e in row
               for p in e.targets]  # fmt: skip
    with torch.no_grad():
        blind, _ = blind_scores(teacher, tbatch, singles, 1000)
        out = forward_interleaved(teacher, tbatch)
    full = {}
    text = -text_ce(out.text_logits, out.text_targets)
    for r, c, v in zip(out.text_index.rows.tolist(), out.text_index.cols.tolist(), text.tolist()):
        full[r, c] = v
    vis = -visual_ce(out.visual_logits, out.visual_targets)
    for r, c, v in zip(
        out.visual_index.rows.tolist(), out.visual_index.cols.tolist(), vis.tolist()
    ):
        full[r, c] = v
    mask = torch.zeros(batch.token_ids.shape, dtype=torch.bool)
    for e, b in zip(singles, blind.tolist()):
        p = e.targets[0]
        if full[e.row, p] - b >= threshold:
            mask[e.row, p - shift[e.row]] = True
    return mask


def test_necessity_carriers_match_an_independent_computation(tmp_path, assets):
    """`carriers: necessity`: only the teacher's carriers (C11 − C10 ≥ threshold) enter
    the divergence; the loss equals the reference restricted to carriers computed from
    separate forwards (tolerance as in the unrestricted comparison above)."""
    cfg = opd_config(tmp_path / "run", assets, "vq", carriers="necessity",
                     carrier_min_necessity=0.0)  # fmt: skip
    trainer = make_trainer(cfg)
    objective = trainer.objective
    micro = TrajectoryBatch.collate(trainer.source.global_batch(0), trainer.pad_id)
    n = objective.count(micro)
    loss, stats = objective.loss(trainer.model, micro, n)
    distil, _ = objective._split(micro)
    batch = micro[distil].without_training_data()
    carriers = _independent_carriers(objective.teacher, batch, 0.0)
    n_scored = int(scored_mask(batch).sum())
    assert 0 < int(carriers.sum()) < n_scored  # a real selection
    assert torch.equal(objective.carrier_mask(batch).cpu(), carriers)
    expected = reference_loss(objective, trainer.model, micro, carriers=carriers)
    tol = loss_bound(objective, trainer.model, micro, expected)
    assert_within(abs(loss.item() - expected), tol, "carrier loss")
    assert stats["carriers"] == int(carriers.sum())
    everything = reference_loss(objective, trainer.model, micro)
    assert abs(everything - expected) > 1e-6  # restricting to carriers changes the loss


def test_necessity_carriers_gradients_match_an_independent_computation(tmp_path, assets):
    """`carriers: necessity` in float64 (student and teacher cast after the rollout): the
    loss and every parameter gradient equal those of the independent reference restricted
    to independently computed carriers, to 1e-6. Bound: float64 throughout, so the two
    paths (fused views + the objective vs single-position blind views + dense JSD and
    per-row loops) differ by rounding ~1e-13; 1e-6 is the acceptance bound, far above it,
    and a wrong carrier, event or normaliser moves the loss by far more (checked above)."""
    cfg = opd_config(tmp_path / "run", assets, "vq", carriers="necessity",
                     carrier_min_necessity=0.0)  # fmt: skip
    trainer = make_trainer(cfg)
    objective = trainer.objective
    micro = TrajectoryBatch.collate(trainer.source.global_batch(0), trainer.pad_id)
    model = trainer.model.double()
    objective.teacher.double()
    n = objective.count(micro)
    loss, _ = objective.loss(model, micro, n)
    assert loss.dtype == torch.float64
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, params, allow_unused=True)
    distil, _ = objective._split(micro)
    batch = micro[distil].without_training_data()
    carriers = _independent_carriers(objective.teacher, batch, 0.0)
    assert torch.equal(objective.carrier_mask(batch).cpu(), carriers)
    assert 0 < int(carriers.sum()) < int(scored_mask(batch).sum())
    ref = reference_loss(objective, model, micro, carriers=carriers, differentiable=True)
    # float64 weights, float32 norms (tests/tolerances.py)
    cfg, tokens = model.config, int(micro.attention_mask.sum())
    fwd = tiny_decoder_reductions(cfg, micro.token_ids.shape[1])
    tol = fp64_forward_bound(magnitude(ref), fwd + tokens)
    assert_within(abs(loss.item() - ref.item()), tol, "float64 carrier loss")
    n64 = gradient_reductions(fwd, tokens)
    n32 = rmsnorm_fp32_reductions(cfg.hidden_size, cfg.num_layers)
    want = torch.autograd.grad(ref, params, allow_unused=True)
    moved = 0
    for a, b in zip(got, want):
        a = torch.zeros_like(b) if a is None and b is not None else a
        if b is None:
            assert a is None or a.abs().max() == 0
            continue
        assert_within((a - b).abs(), mixed_fp64_bound(magnitude(b), n64, n32), "carrier grad")
        moved += int(b.abs().max() > 1e-4)
    assert moved > 0  # the gradient is not trivially zero
