"""Issue 31 items 4-5: SFT's teacher-forced validation loss, epoch-boundary cadence,
the best checkpoint, the step-zero checkpoint, saved GRPO rollouts linked from
checkpoints, TensorBoard truncation on resume, and evaluation reuse keyed by the weights.

Every run is the real trainer on a tiny model; a scripted evaluator stands in only for the
metric `checkpoint.keep_best` reads (the thing tested is the keeping, not the metric).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trainer_helpers import grpo_config, make_grpo_trainer, tiny_config

from uniweave.config import ConfigError, validate_config
from uniweave.core.trajectory import TrajectoryBatch, load_trajectories
from uniweave.core.types import Modality, Owner
from uniweave.eval.runner import evaluate, split_config, weights_sha256
from uniweave.rewards.digit_classifier import CLASSIFIER_DIR
from uniweave.rollout import RolloutTrajectory
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.errors import TrainingError
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.sft.source import sft_trajectories
from uniweave.train.methods.sft.validation import validation_loss
from uniweave.train.run import JOBS, _prepare_model, _val_evaluator
from uniweave.train.state import artifacts
from uniweave.train.state.checkpoint import checkpoint_dir

pytestmark = pytest.mark.usefixtures("one_thread")


def sft_cfg(tmp_path: Path, codec: Path, kind: str = "vq", **sections):
    base = tiny_config(
        tmp_path / "run",
        codec,
        model={"visual_head": kind, "codec": {"path": str(codec), "codebook_size": 16}},
        data={"tasks": ["t2i", "i2t_mc"], "train_size": 4, "val_size": 3, "test_size": 0},
        trainer={"total_updates": 4, "global_batch_size": 4, "micro_batch_size": 2},
        checkpoint={"every_updates": 0, "keep_last": 0},
    )
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return validate_config(base)


def sft_trainer(cfg, evaluator=None, real_evaluator: bool = False) -> Trainer:
    run_dir = Path(cfg.run.output_dir)
    model = _prepare_model(cfg, run_dir, torch.device("cpu"))
    source, objective = JOBS["sft"](cfg, model, run_dir, DistInfo())
    if real_evaluator:
        evaluator = _val_evaluator(cfg, model, run_dir)
    pad = model.special_ids.pad
    return Trainer(model, source, objective, cfg, run_dir, DistInfo(), pad, evaluator=evaluator)


def saved_updates(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in checkpoint_dir(run_dir).glob("update-*"))


# -- validation loss -------------------------------------------------------------------


def independent_ce(model, rows, lambda_visual: float) -> dict[str, float]:
    """Row by row, no padding: every position's full log-softmax in float64, the target
    read at the scored (POLICY, t >= 1) positions."""
    sums = {"text": 0.0, "visual": 0.0}
    counts = {"text": 0, "visual": 0}
    model.eval()
    with torch.no_grad():
        for row in rows:
            batch = TrajectoryBatch.collate([row], 0)
            hidden = model.hidden(model.prepare(batch)).hidden[0].double()
            for t in range(1, len(row)):
                if int(row.owner[t]) != Owner.POLICY:
                    continue
                h = hidden[t - 1 : t].float()
                if int(row.modality[t]) == Modality.VISUAL:
                    z = model.visual_logits(h)[0].double()
                    code = row.visual_codes[t]
                    if code.dim():  # BSQ bits: Σ_f −log σ(±z_f)
                        ce = -(code.double() * F.logsigmoid(z) + (1 - code.double()) * F.logsigmoid(-z)).sum()  # fmt: skip
                    else:
                        ce = -torch.log_softmax(z, -1)[int(code)]
                    sums["visual"] += float(ce)
                    counts["visual"] += 1
                else:
                    z = model.text_logits(h)[0].double()
                    sums["text"] += float(-torch.log_softmax(z, -1)[int(row.token_ids[t])])
                    counts["text"] += 1
    model.train()
    n = counts["text"] + counts["visual"]
    return {
        "loss": (sums["text"] + lambda_visual * sums["visual"]) / n,
        "loss_text": sums["text"] / counts["text"],
        "loss_image": sums["visual"] / counts["visual"],
    }


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_validation_loss_equals_independent_ce(tmp_path, small_vq_dir, small_bsq_dir, kind):
    codec = small_vq_dir if kind == "vq" else small_bsq_dir
    cfg = sft_cfg(tmp_path, codec, kind, algorithm={"name": "sft", "lambda_visual": 0.5})
    model = _prepare_model(cfg, tmp_path / "run", torch.device("cpu"))
    rows = sft_trajectories(cfg, model, "val", cfg.data.val_size)
    got = validation_loss(cfg, model, rows, model.special_ids.pad)
    want = independent_ce(model, rows, 0.5)
    suffix = {"vq": "vq", "bsq": "bits"}[kind]
    assert set(got) == {"loss", "loss_text", f"loss_image_{suffix}"}
    # fp32 forward either way (padded batch of micro_batch_size rows vs one row): each
    # logit carries ~1e2 float32 roundings of relative size 2^-24 ≈ 6e-8 through a
    # 2-layer width-32 body, ≲ 1e-5 relative in a CE of order 1; means do not amplify it.
    rtol = 1e-5
    assert math.isclose(got["loss"], want["loss"], rel_tol=rtol)
    assert math.isclose(got["loss_text"], want["loss_text"], rel_tol=rtol)
    assert math.isclose(got[f"loss_image_{suffix}"], want["loss_image"], rel_tol=rtol)


# -- epoch cadence, step zero, validation metrics in the run ----------------------------


def test_epoch_boundaries_land_on_exact_updates(tmp_path, small_vq_dir, classifier_dir):
    """R = 5 rows (train_size 5, one task), B = 2: epoch e ends with update ceil(5e/2)."""
    cfg = sft_cfg(
        tmp_path,
        small_vq_dir,
        data={"tasks": ["t2i"], "train_size": 5, "val_size": 2},
        trainer={
            "total_updates": 9,
            "global_batch_size": 2,
            "micro_batch_size": 2,
            "eval_every_epochs": 2,
        },  # fmt: skip
        checkpoint={"every_epochs": 1, "every_updates": 0, "keep_last": 0},
        logging={"tensorboard": False, "progress_bar": False},
    )
    run_dir = Path(cfg.run.output_dir)
    (run_dir / CLASSIFIER_DIR).mkdir(parents=True)
    for f in classifier_dir.iterdir():
        shutil.copy(f, run_dir / CLASSIFIER_DIR / f.name)
    trainer = sft_trainer(cfg, real_evaluator=True)
    R, B = len(trainer.source.rows), 2
    assert R == 5
    metrics = dict(trainer.fit())
    ends = [math.ceil(e * R / B) for e in range(1, 4)]  # 3, 5, 8
    assert ends == [3, 5, 8]
    for u in ends:  # the batch of update u (rows uB-B .. uB-1) holds the epoch's last row
        e = ends.index(u) + 1
        assert (u - 1) * B <= e * R - 1 < u * B
    # the step-zero checkpoint, every epoch boundary, and the last update
    assert saved_updates(run_dir) == [0, 3, 5, 8, 9]
    zero = json.loads((checkpoint_dir(run_dir) / "update-000000" / "state.json").read_text())
    assert zero["update"] == 0 and zero["data_cursor"] == 0
    evaluated = [u for u, m in metrics.items() if "val/loss" in m]
    assert evaluated == [5, 9]  # epoch 2 ends at update 5; the last update is evaluated
    logged = {r["update"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").open())}
    for u in evaluated:
        assert {"val/loss", "val/loss_text", "val/loss_image_vq"} <= set(logged[u])
        assert any(k.startswith("val/t2i/") for k in logged[u])  # the rollout evaluation too
    # what the run logged at its last update is the independent CE of the final weights
    rows = sft_trajectories(cfg, trainer.model, "val", cfg.data.val_size)
    want = independent_ce(trainer.model, rows, cfg.algorithm.lambda_visual)
    for key, ref in (("val/loss", "loss"), ("val/loss_text", "loss_text"),
                     ("val/loss_image_vq", "loss_image")):  # fmt: skip
        assert math.isclose(logged[9][key], want[ref], rel_tol=1e-5)  # bound: see above


# -- the best checkpoint ----------------------------------------------------------------


@pytest.mark.parametrize(("mode", "best_update", "kept"), [("min", 4, [4, 6]), ("max", 6, [6])])
def test_keep_best_keeps_the_best_beside_the_newest(
    tmp_path, small_vq_dir, mode, best_update, kept
):
    script = {1: 5.0, 2: 3.0, 3: 4.0, 4: 2.0, 5: 6.0, 6: 7.0}
    cfg = sft_cfg(
        tmp_path,
        small_vq_dir,
        trainer={"total_updates": 6, "eval_every": 1},
        checkpoint={
            "every_updates": 0,
            "keep_last": 1,
            "keep_best": "val/loss",
            "keep_best_mode": mode,
        },  # fmt: skip
    )
    trainer = sft_trainer(cfg, evaluator=lambda u: {"val/loss": script[u]})
    list(trainer.fit())
    run_dir = Path(cfg.run.output_dir)
    assert saved_updates(run_dir) == kept
    best = json.loads((checkpoint_dir(run_dir) / artifacts.BEST).read_text())
    assert best == {"metric": "val/loss", "mode": mode, "value": script[best_update],
                    "update": best_update, "checkpoint": f"update-{best_update:06d}"}  # fmt: skip
    last = json.loads((checkpoint_dir(run_dir) / "update-000006" / "state.json").read_text())
    assert last["best"] == best  # a resume restores best.json from the newest checkpoint


def test_keep_best_refuses_a_metric_the_evaluator_does_not_give(tmp_path, small_vq_dir):
    cfg = sft_cfg(
        tmp_path,
        small_vq_dir,
        trainer={"total_updates": 2, "eval_every": 1},
        checkpoint={"keep_best": "val/t2i/accuracy"},
    )
    trainer = sft_trainer(cfg, evaluator=lambda u: {"val/loss": 1.0})
    with pytest.raises(TrainingError, match="checkpoint.keep_best: val/t2i/accuracy is not"):
        list(trainer.fit())


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"checkpoint": {"every_epochs": 1}}, "checkpoint.every_epochs"),
        ({"trainer": {"eval_every_epochs": 1}}, "trainer.eval_every_epochs"),
        ({"checkpoint": {"keep_best": "val/loss"}}, "checkpoint.keep_best"),
        ({"checkpoint": {"keep_best_mode": "max"}}, "checkpoint.keep_best_mode"),
    ],
)
def test_refused_where_it_cannot_act(tmp_path, small_vq_dir, classifier_dir, changes, key):
    """Epoch cadences are SFT-only (GRPO walks a pool per task); keep_best needs an
    evaluation cadence and (for val/loss) SFT; keep_best_mode needs keep_best."""
    assets = {"vq": small_vq_dir, "clf": classifier_dir}
    data = grpo_config(tmp_path / "g", assets)
    data["trainer"]["eval_every"] = 0
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(data)
    sft = tiny_config(tmp_path / "s", small_vq_dir, checkpoint={"save_rollouts": True})
    with pytest.raises(ConfigError, match=r"checkpoint\.save_rollouts: acts only with grpo"):
        validate_config(sft)


# -- TensorBoard truncation on resume -----------------------------------------------------


def tb_steps(run_dir: Path) -> list[int]:
    steps = []
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        steps += [e.step for e in acc.Scalars("loss")]
    return sorted(steps)


def test_resume_truncates_tensorboard_like_jsonl(tmp_path, small_vq_dir):
    cfg = sft_cfg(
        tmp_path,
        small_vq_dir,
        trainer={"total_updates": 5},
        checkpoint={"every_updates": 2, "keep_last": 0},
        logging={"tensorboard": True, "progress_bar": False},
    )
    run_dir = Path(cfg.run.output_dir)
    list(sft_trainer(cfg).fit())
    assert tb_steps(run_dir) == [1, 2, 3, 4, 5]
    for u in (4, 5):  # as if the run died after logging update 5 but before checkpoint 4
        shutil.rmtree(checkpoint_dir(run_dir) / f"update-{u:06d}")
    list(sft_trainer(cfg).fit())  # resumes from update 2
    assert tb_steps(run_dir) == [1, 2, 3, 4, 5]  # no duplicate of 3, 4, 5
    jsonl = [json.loads(line)["update"] for line in (run_dir / "metrics.jsonl").open()]
    assert jsonl == [1, 2, 3, 4, 5]


# -- saved GRPO rollouts ---------------------------------------------------------------------


def test_grpo_rollouts_saved_linked_and_truncated(tmp_path, small_vq_dir, classifier_dir):
    assets = {"vq": small_vq_dir, "clf": classifier_dir}
    data = grpo_config(
        tmp_path / "run",
        assets,
        trainer={"total_updates": 3},
        checkpoint={"every_updates": 2, "keep_last": 0, "save_rollouts": True},
    )
    trainer = make_grpo_trainer(data)
    batches = {}
    for update, _ in trainer.fit():
        batches[update] = trainer.source.rollout(update - 1)
    run_dir = Path(data["run"]["output_dir"])
    root = run_dir / artifacts.ROLLOUTS
    names = sorted(p.name for p in root.glob("update-*"))
    assert names == [f"update-{u:06d}.{x}" for u in (1, 2, 3) for x in ("json", "pt")]
    for u, rollout in batches.items():
        saved = load_trajectories(root / f"update-{u:06d}.pt", [RolloutTrajectory])
        assert [t.token_ids.tolist() for t in saved] == [
            t.token_ids.tolist() for t in rollout.trajectories
        ]
        record = json.loads((root / f"update-{u:06d}.json").read_text())
        assert [r["reward"] for r in record["rows"]] == rollout.rewards
        assert [r["advantage"] for r in record["rows"]] == [t.advantage for t in saved]
        assert record["trajectories"]["sha256"] == artifacts.file_sha256(
            root / f"update-{u:06d}.pt"
        )
    # checkpoint 2 links the files of updates 1-2 by their inventory
    state = json.loads((checkpoint_dir(run_dir) / "update-000002" / "state.json").read_text())
    assert state["rollouts"]["files"] == names[:4]
    assert state["rollouts"]["inventory_sha256"] == artifacts.inventory_sha256(
        artifacts.rollout_inventory(run_dir, 2)
    )
    # a resume from update 2 deletes update 3's files; a changed linked file is refused
    shutil.rmtree(checkpoint_dir(run_dir) / "update-000003")
    assert make_grpo_trainer(data).resume()
    assert sorted(p.name for p in root.glob("update-*")) == names[:4]
    (root / "update-000001.json").write_text("{}\n")
    with pytest.raises(TrainingError, match="no longer holds the rollout files"):
        make_grpo_trainer(data).resume()


# -- evaluation reuse needs the same weights ----------------------------------------------------


def test_evaluation_reuse_requires_the_same_weights(tmp_path, small_vq_dir, classifier_dir):
    cfg = split_config(
        sft_cfg(tmp_path, small_vq_dir, data={"tasks": ["t2i"], "val_size": 2}), "val"
    )
    model = _prepare_model(cfg, tmp_path / "run", torch.device("cpu")).eval()
    out = tmp_path / "eval"
    evaluate(cfg, model, out, per_task=2, classifier_dir=classifier_dir)
    first = (out / "results.jsonl").read_text()
    evaluate(cfg, model, out, per_task=2, classifier_dir=classifier_dir)  # same weights: reused
    assert (out / "results.jsonl").read_text() == first
    with torch.no_grad():
        next(model.parameters()).add_(0.5)
    with pytest.raises(ConfigError, match="holds an evaluation of other weights"):
        evaluate(cfg, model, out, per_task=2, classifier_dir=classifier_dir)
    evaluate(cfg, model, out, per_task=2, classifier_dir=classifier_dir, stale="replace")
    assert (out / "weights_sha256").read_text().strip() == weights_sha256(model)


# -- saved OPD rollouts: routes and the GT replay selection ------------------------------------


def test_opd_rollout_record_holds_routes_and_replay_selection(
    tmp_path, small_vq_dir, classifier_dir
):
    from uniweave.models.build import build_model
    from uniweave.train.methods.opd.job import build_opd_job

    def opd(run_dir: Path, seed: int, teacher: str) -> dict:
        cfg = tiny_config(
            run_dir,
            small_vq_dir,
            data={"tasks": ["t2i", "i2t_mc"], "train_size": 16},
            rollout={"max_new_tokens": 20, "length_semantics": "cap"},
            reward={
                "plugins": [
                    {"name": "digit_classifier", "path": str(classifier_dir), "tasks": ["t2i"]},
                    {"name": "mc_exact", "tasks": ["i2t_mc"]},
                ]
            },  # fmt: skip
            trainer={"total_updates": 1, "global_batch_size": 6, "micro_batch_size": 3},
            checkpoint={"every_updates": 0, "keep_last": 0, "save_rollouts": True},
        )
        cfg["run"]["seed"] = seed
        cfg["algorithm"] = {"name": "opd", "teacher": {"path": teacher, "privilege": "answer"},
                            "routing": "privileged_correction", "gt_replay": {"mode": "failure", "budget": 2}}  # fmt: skip
        return cfg

    teacher = tmp_path / "teacher"
    build_model(validate_config(opd(tmp_path / "x", 9, "/nonexistent"))).save_pretrained(teacher)
    cfg = validate_config(opd(tmp_path / "run", 3, str(teacher)))
    model = build_model(cfg).train()
    source, objective = build_opd_job(cfg, model, Path(cfg.run.output_dir), DistInfo())
    trainer = Trainer(model, source, objective, cfg, Path(cfg.run.output_dir), DistInfo(),
                      model.special_ids.pad)  # fmt: skip
    ((_, metrics),) = list(trainer.fit())
    root = Path(cfg.run.output_dir) / artifacts.ROLLOUTS
    record = json.loads((root / "update-000001.json").read_text())
    saved = load_trajectories(root / "update-000001.pt", [RolloutTrajectory])
    rows = record["rows"]
    trained = [t.token_ids.tolist() for t in source.global_batch(0) if t.sampling is not None]
    assert trained == [t.token_ids.tolist() for t in saved]  # every row is distilled
    assert len(rows) == 6
    assert [r["route"] for r in rows] == ["plain" if r["correct"] else "privileged" for r in rows]
    assert sum(r["route"] == "privileged" for r in rows) == metrics["route/n_privileged"]
    failed = [r["id"] for r in rows if not r["correct"]]
    chosen = [g["sample_id"] for g in record["gt_replay"]["rows"]]
    assert len(chosen) == metrics["replay/n_gt_rows"] == min(2, len(failed))
    assert set(chosen) <= set(failed)
