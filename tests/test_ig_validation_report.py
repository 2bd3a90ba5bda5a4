"""IG validation artifacts (issue 32 item 7): per validation a JSON report (atomic write)
with the distributions of absolute gain, trajectory-balanced gain, margin and gate, the
saturation rates and the pinned cycle index; the same figures as `val/ig/...` scalars in
the metrics sinks (TensorBoard). Every figure is recomputed here with numpy from per-event
values computed independently of the report's code."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from tolerances import assert_within, elementwise_bound, logprob_bound, tiny_decoder_reductions
from trainer_helpers import tiny_config

from uniweave.algorithms.information_gain import unit_scores
from uniweave.codecs.base import single_thread
from uniweave.config import validate_config
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.forward import forward_interleaved
from uniweave.models.build import build_model
from uniweave.rewards.digit_classifier import CLASSIFIER_DIR
from uniweave.train.methods.sft.information_gain import blind_scores, scored_events
from uniweave.train.methods.sft.source import sft_trajectories
from uniweave.train.run import _val_evaluator, ig_report_path, run_train

QS = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
NAMES = ("p00", "p05", "p25", "p50", "p75", "p95", "p100")
TAU, EPS = 0.25, 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _sections(val_size=3):
    ig = {"weight": 1.0, "event_selection": "all"}
    return {
        "data": {"tasks": ["draw_then_answer", "i2t_mc"], "train_size": 4, "val_size": val_size,
                 "test_size": 0},
        "algorithm": {"name": "sft", "information_gain": ig},
    }  # fmt: skip


def _independent_events(model, rows, cfg):
    """(row, direction, gain, margin, gate, full, blind) per event: full scores from a plain
    forward and a log-softmax / log-sigmoid written here, blind scores one view per forward
    (chunk 1), margin and gate from docs/numerics.md §3 in float64."""
    batch = TrajectoryBatch.collate(rows, model.special_ids.pad)
    events = scored_events(batch, cfg, 0)
    with torch.no_grad():
        out = forward_interleaved(model, batch)
        logp = torch.zeros(batch.token_ids.shape, dtype=torch.float64)
        lt = torch.log_softmax(out.text_logits.double(), -1)
        logp[out.text_index.rows, out.text_index.cols] = lt.gather(1, out.text_targets[:, None])[
            :, 0
        ]
        z, v = out.visual_logits.double(), out.visual_targets
        if v.dim() == 2:
            lv = (v * torch.nn.functional.logsigmoid(z)
                  + (1 - v) * torch.nn.functional.logsigmoid(-z)).sum(-1)  # fmt: skip
        else:
            lv = torch.log_softmax(z, -1).gather(1, v[:, None])[:, 0]
        logp[out.visual_index.rows, out.visual_index.cols] = lv
        full = unit_scores(logp, events).numpy()
        blind = blind_scores(model, batch, events, 1)[0].double().numpy()
    gain = full - blind
    margin = gain / (np.abs(blind) + EPS)
    gate = 1.0 / (1.0 + np.exp(margin / TAU))
    return [
        (e.row, e.direction, gain[k], margin[k], gate[k], full[k], blind[k])
        for k, e in enumerate(events)
    ]


def event_bounds(event, n: int) -> list[float]:
    """Bounds on the logged (gain, margin, gate) of `event` (from `_independent_events`)
    against the independent ones: each score sums a unit's log-probs from another float32
    forward, its errors adding linearly at most, so within `logprob_bound` at |score|; g =
    f - b moves by both, m = g / (|b| + eps) by (dg + |m| db) / (|b| + eps), the gate
    sigma(-m / tau) by its slope <= 1/4 over tau; the logged side's own float32 chain adds
    a few roundings (elementwise_bound, paths=1)."""
    _, _, gain, margin, _, full, blind = event
    d_full, d_blind = logprob_bound(full, n), logprob_bound(blind, n)
    d_gain = d_full + d_blind + elementwise_bound(gain, 1, paths=1)
    d_margin = (d_gain + abs(margin) * d_blind) / (abs(blind) + EPS)
    d_margin += elementwise_bound(margin, 3, paths=1)
    d_gate = 0.25 * d_margin / TAU + elementwise_bound(1.0, 5, paths=1)
    return [d_gain, d_margin, d_gate]


def _expected(events, group):
    chosen = [e for e in events if group in ("all", e[1])]
    per_row = {}
    for e in chosen:
        per_row.setdefault(e[0], []).append(e[2])
    gate = np.array([e[4] for e in chosen])
    dists = {
        "gain": [e[2] for e in chosen],
        "trajectory_gain": [np.mean(v) for v in per_row.values()],
        "margin": [e[3] for e in chosen],
        "gate": list(gate),
    }
    out = {"events": len(chosen), "rows": len(per_row)}
    for name, values in dists.items():
        out[name] = {"mean": float(np.mean(values)),
                     **dict(zip(NAMES, np.quantile(np.array(values), QS)))}  # fmt: skip
    out["saturation"] = {
        "low": float(np.mean(gate < 0.05)),
        "high": float(np.mean(gate > 0.95)),
        "total": float(np.mean((gate < 0.05) | (gate > 0.95))),
    }
    return out


def test_report_figures_equal_a_numpy_recomputation(tmp_path, small_vq_dir, classifier_dir):
    """Tolerance: the report's per-event values against the independent ones, 1e-5 relative
    (float32 forwards; blind views in chunks of 8 vs 1, as in test_information_gain's
    chunk-invariance bound); figures recomputed from the report's own per-event values,
    1e-12 (float64 order statistics and means)."""
    cfg = validate_config(tiny_config(tmp_path / "run", small_vq_dir, **_sections()))
    shutil.copytree(classifier_dir, tmp_path / "run" / CLASSIFIER_DIR)
    model = build_model(cfg)
    metrics = _val_evaluator(cfg, model, tmp_path / "run")(3)
    path = ig_report_path(tmp_path / "run", 3)
    assert path.name == "ig-val-update-000003.json"
    report = json.loads(path.read_text())
    assert not list(path.parent.glob(".*tmp*"))  # atomic: no temporary left behind
    assert report["cycle_index"] == 0 and metrics["val/ig/cycle_index"] == 0

    ig = cfg.algorithm.information_gain
    rows = sft_trajectories(cfg, model, "val", cfg.data.val_size)
    mine = _independent_events(model.eval(), rows, ig)
    logged = [(r["row"], r["direction"], r["gain"], r["margin"], r["gate"])
              for r in report["events"]]  # fmt: skip
    assert [e[:2] for e in logged] == [e[:2] for e in mine]
    n = tiny_decoder_reductions(model.config, max(len(r) for r in rows))
    for a, b in zip(logged, mine):
        err = np.abs(np.array(a[2:5]) - np.array(b[2:5]))
        assert_within(err, event_bounds(b, n), f"event {a[:2]}")
    # rows with different event counts: the trajectory-balanced mean is not the event mean
    counts = {}
    for e in mine:
        counts[e[0]] = counts.get(e[0], 0) + 1
    assert len(set(counts.values())) > 1

    for group in ("text_to_visual", "visual_to_text", "all"):
        got = report["groups"][group]
        for source, tol in ((logged, 1e-12), (mine, 1e-5)):
            want = _expected(source, group)
            assert got["events"] == want["events"] and got["rows"] == want["rows"]
            for dist in ("gain", "trajectory_gain", "margin", "gate"):
                for stat, value in want[dist].items():
                    assert got[dist][stat] == pytest.approx(value, rel=tol, abs=tol), (
                        group, dist, stat)  # fmt: skip
                    key = f"val/ig/{group}/{dist}_{stat}"
                    assert metrics[key] == got[dist][stat], key
            for stat, value in want["saturation"].items():
                # bound: a share k / n in float64, one rounding: 2^-53 ~ 1e-16 under 1e-12
                assert got["saturation"][stat] == pytest.approx(value, abs=1e-12)
                assert metrics[f"val/ig/{group}/saturation_{stat}"] == got["saturation"][stat]
    tb = report["groups"]["all"]["trajectory_gain"]["mean"]
    assert tb != pytest.approx(report["groups"]["all"]["gain"]["mean"], rel=1e-6)


def test_a_training_run_writes_the_report_and_the_same_figures_to_tensorboard(
    tmp_path, small_vq_dir, classifier_dir
):
    """One report per validation; TensorBoard's `val/ig/...` scalars at that step are the
    report's figures (stored as float32 by TensorBoard: 1e-6 relative)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sections = _sections(2)
    sections["trainer"] = {"total_updates": 2, "global_batch_size": 4, "micro_batch_size": 4,
                           "eval_every": 2}  # fmt: skip
    sections["logging"] = {"tensorboard": True, "progress_bar": False}
    sections["checkpoint"] = {"every_updates": 0}
    cfg = validate_config(tiny_config(tmp_path / "run", small_vq_dir, **sections))
    (tmp_path / "run").mkdir()
    shutil.copytree(classifier_dir, tmp_path / "run" / CLASSIFIER_DIR)
    run_dir = run_train(cfg)
    reports = sorted(p.name for p in (run_dir / "evals").glob("ig-val-*.json"))
    assert reports == ["ig-val-update-000002.json"]
    report = json.loads(ig_report_path(run_dir, 2).read_text())
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    checked = 0
    for group, figures in report["groups"].items():
        for dist in ("gain", "trajectory_gain", "margin", "gate"):
            for stat in ("mean", *NAMES):
                tag = f"val/ig/{group}/{dist}_{stat}"
                assert tag in tags, tag
                (event,) = [e for e in acc.Scalars(tag) if e.step == 2]
                # tensorboard stores float32: one rounding of the float64 figure
                want = figures[dist][stat]
                assert abs(event.value - want) <= elementwise_bound(want, 1, paths=1)
                checked += 1
        for stat in ("low", "high", "total"):
            (event,) = acc.Scalars(f"val/ig/{group}/saturation_{stat}")
            want = figures["saturation"][stat]
            assert abs(event.value - want) <= elementwise_bound(want, 1, paths=1)
    assert checked == 3 * 4 * 8
