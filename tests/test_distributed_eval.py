"""The run's evaluations shared across ranks under `trainer.parallel` ddp and fsdp2
(`uniweave.train.run`: `evaluation_model`, `evaluate_split`; `uniweave.eval.runner`, "Several
ranks"): the baseline evaluations (update 0), validation and the end-of-run test
evaluation, all through one code path.

`uniweave train` with 2 spawned workers (gloo on CPU) runs one update with `eval_every` 1.
Every evaluation directory must hold exactly the records (every field, images included)
that one process evaluating the same weights writes: the exported model for update 1,
the model the config builds for update 0 (its weights_sha256 is checked first). No
tolerance: both sides evaluate bitwise the same weights (under fsdp2 the ranks evaluate
an unsharded copy all-gathered from the shards, whose bytes are the fp32 parameters
themselves, not a re-rounded cast), every item carries its own seed and the engine
batches are the ones one process forms, so the computation is the same. eval.json is the
test evaluation's metrics; the metrics log holds the validation's. That every rank took
part: each evaluation's work.json counts the records each rank computed, and both must
have computed some (4 claims of one item each; rank 1 would have to stall for all of
them to miss out).
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from trainer_helpers import run_cli, tiny_config, write_config

from uniweave.config import validate_config
from uniweave.eval.runner import evaluate, split_config, task_metrics, weights_sha256
from uniweave.models.build import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _records(out):
    lines = (out / "results.jsonl").read_text().splitlines()
    return sorted((json.loads(x) for x in lines), key=lambda r: (r["id"], r["member"]))


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_evaluate_as_one_process(tmp_path, small_vq_dir, classifier_dir, mode):
    plugins = [
        {"name": "digit_classifier", "path": str(classifier_dir), "tasks": ["t2i"]},
        {"name": "mc_exact", "tasks": ["i2t_mc"]},
    ]
    trainer = {"total_updates": 1, "parallel": mode, "world_size": 2, "eval_every": 1}
    if mode == "fsdp2":  # gloo on CPU: gather in fp32
        trainer["fsdp"] = {"param_dtype": "fp32", "reduce_dtype": "fp32"}
    raw = tiny_config(
        tmp_path / "run",
        small_vq_dir,
        data={"tasks": ["t2i", "i2t_mc"], "train_size": 8, "val_size": 2, "test_size": 2},
        rollout={"batch_size": 1, "max_new_tokens": 8},  # 4 claims per evaluation
        evaluation={"greedy": False},
        reward={"plugins": plugins},
        trainer=trainer,
        checkpoint={"every_updates": 0},
    )
    proc = run_cli(["train", str(write_config(tmp_path / "c.yaml", raw))])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    cfg = validate_config(raw)
    start = build_model(cfg).eval()
    final = build_model(cfg).eval()
    final.load_state_dict(load_file(str(run / "model" / "model.safetensors")))
    for name, model in (("update-000000", start), ("update-000001", final)):
        for split in ("val", "test"):
            got = run / "evals" / f"{split}-{name}"
            assert (got / "weights_sha256").read_text().strip() == weights_sha256(model)
            one = tmp_path / f"one-{split}-{name}"
            evaluate(split_config(cfg, split), model, one, per_task=2, stale="replace")
            assert _records(got) == _records(one), (mode, split, name)
            assert len(_records(one)) == 4
            work = json.loads((got / "work.json").read_text())
            assert work["kept"] == 0 and len(work["computed"]) == 2, work
            assert all(sum(rank) > 0 for rank in work["computed"]), f"both ranks computed {work}"
            assert json.loads((got / "summary.json").read_text()) == json.loads(
                (one / "summary.json").read_text()
            )
    expected = task_metrics(json.loads((one / "summary.json").read_text()))
    assert json.loads((run / "eval.json").read_text()) == expected
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    metrics = {k[4:]: v for k, v in logged[-1].items() if k.startswith("val/")}
    val = task_metrics(
        json.loads((run / "evals" / "val-update-000001" / "summary.json").read_text())
    )
    assert val and {k: metrics.get(k) for k in val} == val
    assert {"loss", "loss_text"} <= metrics.keys(), "rank 0 adds SFT's validation losses"
