"""`evaluation.workers_per_gpu` (uniweave.eval.runner): N evaluation workers in one process,
each a thread with its own deep copy of the model, claiming engine batches from the same
queue.

Checked exactly (no tolerance): every item carries its own stateless seed, and with
`rollout.batch_size` 1 every engine batch is one item whichever worker runs it or
whenever it is claimed, so the records (tokens, images, scores, every field) of N = 2
equal N = 1's, and a killed N = 1 evaluation resumed with N = 2 keeps the committed
records and recomputes exactly the missing ones, again equal to N = 1's. That both
workers really ran is checked by a rollout function whose first call in each worker
waits (a barrier) until the other worker has also claimed one: neither can drain the
queue alone.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from trainer_helpers import tiny_config

from uniweave.config import validate_config
from uniweave.eval.runner import engine_rollout, evaluate, split_config
from uniweave.models.build import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(root, vq, workers: int):
    raw = tiny_config(
        root,
        vq,
        data={"tasks": ["t2i", "i2t_mc"], "train_size": 8, "val_size": 2, "test_size": 0},
        rollout={"batch_size": 1, "max_new_tokens": 12},
        evaluation={"rollouts_per_sample": 2, "greedy": False, "workers_per_gpu": workers},
    )
    return split_config(validate_config(raw), "val")


def _records(out):
    lines = (out / "results.jsonl").read_text().splitlines()
    return sorted((json.loads(x) for x in lines), key=lambda r: (r["id"], r["member"]))


def _meeting_rollout(workers: int):
    """The engine's rollout, whose first call in each worker thread waits for the other
    workers' first calls (so each worker holds a claim before any finishes one)."""
    meet = threading.Barrier(workers, timeout=60)

    def make(model):
        generate = engine_rollout(model)
        first = [True]

        def rollout(requests):
            if first[0]:
                first[0] = False
                meet.wait()
            return generate(requests)

        return rollout

    return make


def test_workers_equal_one_worker_and_resume(tmp_path, small_vq_dir, classifier_dir):
    one_cfg = _config(tmp_path / "run", small_vq_dir, 1)
    two_cfg = _config(tmp_path / "run", small_vq_dir, 2)
    model = build_model(one_cfg).eval()
    common = {"per_task": 2, "classifier_dir": classifier_dir, "stale": "replace"}
    one = evaluate(one_cfg, model, tmp_path / "one", **common)
    expected = _records(tmp_path / "one")
    assert len(expected) == 8

    worked_by: dict = {}
    two = evaluate(
        two_cfg,
        model,
        tmp_path / "two",
        rollout=_meeting_rollout(2),
        worked_by=worked_by,
        **common,
    )
    assert _records(tmp_path / "two") == expected and two == one
    assert set(worked_by.values()) == {0, 1}, f"both workers computed records: {worked_by}"
    assert len(worked_by) == 8
    work = json.loads((tmp_path / "two" / "work.json").read_text())
    assert work == {
        "computed": [[sum(v == w for v in worked_by.values()) for w in (0, 1)]],
        "kept": 0,
    }
    # workers_per_gpu does not key the directory: N = 2 may resume N = 1's records
    assert (tmp_path / "two" / "config_hash").read_text() == (
        tmp_path / "one" / "config_hash"
    ).read_text()

    # a killed N = 1 evaluation (3 whole records and a torn fourth), resumed with N = 2
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config_hash", "weights_sha256"):
        shutil.copy(tmp_path / "one" / name, partial / name)
    lines = (tmp_path / "one" / "results.jsonl").read_text().splitlines(keepends=True)
    (partial / "results.jsonl").write_text("".join(lines[:3]) + lines[3][:30])
    shutil.copytree(tmp_path / "one" / "images", partial / "images")
    worked_by = {}
    resumed = evaluate(two_cfg, model, partial, worked_by=worked_by, **common)
    now = (partial / "results.jsonl").read_text().splitlines(keepends=True)
    assert now[:3] == lines[:3], "committed records are kept as they were"
    first3 = {(json.loads(x)["id"], json.loads(x)["member"]) for x in lines[:3]}
    assert len(worked_by) == 5 and not set(worked_by) & first3, "only the missing 5 recomputed"
    assert _records(partial) == expected and resumed == one
    assert json.loads((partial / "work.json").read_text())["kept"] == 3
