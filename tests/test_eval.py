"""`unirl eval` end to end on the tiny model and a custom colour dataset."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser

import numpy as np
import pytest
from eval_fixtures import make_dataset, write_config
from PIL import Image

from unirl.config import load_config
from unirl.core.types import TRUNCATED_REASONS
from unirl.eval import evaluate
from unirl.train.engine.build import build_model


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.headers: list[str] = []
        self.rows = 0
        self._in_th = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "th":
            self._in_th = True
            assert attrs["onclick"].startswith("sortBy(")
        if tag == "tr":
            self.rows += 1

    def handle_endtag(self, tag):
        if tag == "th":
            self._in_th = False

    def handle_data(self, data):
        if self._in_th:
            self.headers.append(data)


def test_eval_sampled_records_summary_and_page(tmp_path):
    data = make_dataset(tmp_path / "data", 8)
    extra = "evaluation: {rollouts_per_sample: 3, greedy: false}\n"
    cfg = load_config(write_config(tmp_path, data, extra))
    model = build_model(cfg).eval()
    out = tmp_path / "eval"
    summary = evaluate(cfg, model, out)
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["id"], r["member"]) for r in records) == [
        (f"sq{i}", m) for i in (1, 3, 5, 7) for m in range(3)
    ]
    for r in records:
        assert r["scores"].keys() == {"text_exact"} and r["finish_reason"]
        kept = r["finish_reason"] not in TRUNCATED_REASONS
        expected = float(r["response"].strip() == r["answer"] and kept)
        assert r["total"] == expected
        assert r["prompt"] == "<image>Which colour is the square?" and len(r["prompt_images"]) == 1
        with Image.open(out / r["prompt_images"][0]) as im:
            assert im.mode == "L" and im.size == (8, 8)  # the tiny model's greyscale view
    by_id: dict[str, list[float]] = {}
    for r in records:
        by_id.setdefault(r["id"], []).append(r["total"])
    mean_n = np.mean([np.mean(v) for v in by_id.values()])
    pass_n = np.mean([max(v) >= 1.0 for v in by_id.values()])
    assert summary["all"]["mean@n"] == pytest.approx(mean_n)
    assert summary["all"]["pass@n"] == pytest.approx(pass_n)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert len({r["response"] for r in records if r["id"] == "sq1"}) > 1  # sampled
    page = _Page()
    page.feed((out / "index.html").read_text())
    assert page.rows == 1 + len(records) and "total" in page.headers
    assert page.images and all((out / src).is_file() for src in page.images)
    again = evaluate(cfg, model, tmp_path / "eval2")  # common random numbers
    assert again == summary
    records2 = (tmp_path / "eval2" / "results.jsonl").read_text().splitlines()
    assert sorted(records2) == sorted((out / "results.jsonl").read_text().splitlines())


def test_eval_resumes_after_sigkill(tmp_path):
    data = make_dataset(tmp_path / "data", 40)
    extra = (
        f"evaluation: {{rollouts_per_sample: 2, greedy: false, output_dir: {tmp_path / 'out'}}}\n"
    )
    config = write_config(tmp_path, data, extra)
    cmd = [sys.executable, "-m", "unirl", "eval", str(config), "rollout.batch_size=1"]
    env = {**os.environ, "CI": "true"}
    results = tmp_path / "out" / "results.jsonl"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if results.is_file() and results.read_text().count("\n") >= 3:
            break
        time.sleep(0.005)
    assert proc.poll() is None, proc.stderr.read().decode()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = results.read_text().count("\n")
    assert 3 <= done < 40
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    keys = [(r["id"], r["member"]) for r in map(json.loads, results.read_text().splitlines())]
    assert sorted(keys) == sorted((f"sq{i}", m) for i in range(1, 40, 2) for m in range(2))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["all"]["n_rollouts"] == 40.0


def test_eval_refuses_another_config_in_the_same_directory(tmp_path):
    data = make_dataset(tmp_path / "data", 4)
    cfg = load_config(write_config(tmp_path, data))
    model = build_model(cfg).eval()
    evaluate(cfg, model, tmp_path / "out")
    other = load_config(write_config(tmp_path, data), ["evaluation.pass_threshold=0.5"])
    with pytest.raises(Exception, match="evaluation.output_dir"):
        evaluate(other, model, tmp_path / "out")


def test_training_validates_and_tests_with_the_evaluator(tmp_path):
    """data.path runs: `val/<task>/*` every eval_every updates and eval.json at the end
    come from the `unirl eval` evaluator (first data.<split>_size rows per task)."""
    from unirl.train.run import run_train

    data = make_dataset(tmp_path / "data", 8)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    for i, row in enumerate(rows):
        row["split"] = ("train", "val", "train", "test")[i % 4]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = (
        "trainer: {total_updates: 2, eval_every: 1, global_batch_size: 2, micro_batch_size: 2}\n"
    )
    cfg = load_config(write_config(tmp_path, data, extra), ["data.val_size=1"])
    run_dir = run_train(cfg)
    logged = {m["update"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").open())}
    for update in (1, 2):
        out = run_dir / "evals" / f"val-update-{update:06d}"
        records = [json.loads(line) for line in (out / "results.jsonl").open()]
        assert [r["id"] for r in records] == ["sq1"]  # val rows sq1, sq5; val_size 1
        assert logged[update]["val/colour_qa/mean@n"] == records[0]["total"]
        assert logged[update]["val/colour_qa/pass@n"] == float(records[0]["total"] >= 1.0)
    results = json.loads((run_dir / "eval.json").read_text())
    records = [
        json.loads(line)
        for line in (run_dir / "evals" / "test-update-000002" / "results.jsonl").open()
    ]
    assert sorted(r["id"] for r in records) == ["sq3", "sq7"]
    assert results["colour_qa/mean@n"] == pytest.approx(np.mean([r["total"] for r in records]))
    assert results["colour_qa/n_samples"] == 2.0
