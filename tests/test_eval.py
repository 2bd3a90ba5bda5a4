"""`uniweave eval` end to end on the tiny model and a custom colour dataset."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from eval_fixtures import make_dataset, write_config
from PIL import Image

from uniweave.config import load_config
from uniweave.core.types import TRUNCATED_REASONS
from uniweave.eval import evaluate
from uniweave.models.build import build_model

ROOT = Path(__file__).resolve().parents[1]


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
    cmd = [
        sys.executable,
        "-m",
        "uniweave",
        "eval",
        str(config),
        "rollout.batch_size=1",
        "--random-init",
    ]
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
    other = load_config(write_config(tmp_path, data), ["evaluation.pass_threshold=0.25"])
    with pytest.raises(Exception, match="evaluation.output_dir"):
        evaluate(other, model, tmp_path / "out")


def test_training_validates_and_tests_with_the_evaluator(tmp_path):
    """data.path runs: `val/<task>/*` every eval_every updates and eval.json at the end
    come from the `uniweave eval` evaluator (first data.<split>_size rows per task)."""
    from uniweave.train.run import run_train

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


def _flat(summary: dict) -> dict[str, float]:
    return {f"{t}/{k}": v for t, stats in summary["tasks"].items() for k, v in stats.items()}


def test_uniweave_eval_of_a_trained_run_reproduces_its_eval_json(tmp_path):
    """One evaluator (issue 29): a short digits SFT run validates every eval_every
    updates and writes eval.json at the end; `uniweave eval` on the run's model/ with the
    run's config and its test split gives exactly those numbers, and the logged val/
    metrics are the val evaluations' summaries."""
    from trainer_helpers import fit_small_codec, tiny_config

    from uniweave.cli import main
    from uniweave.config import validate_config
    from uniweave.data.digits_images import load_split
    from uniweave.rewards.digit_classifier import CLASSIFIER_DIR, DigitClassifier
    from uniweave.train.run import run_train

    run_dir = tmp_path / "run"
    train = load_split("train")  # a small classifier where the run looks for its own
    clf = DigitClassifier().fit(train.images[:200], train.labels[:200])
    clf.save_pretrained(run_dir / CLASSIFIER_DIR)
    sections = {
        "data": {
            "tasks": ["t2i", "i2t_mc", "draw_then_answer"],
            "train_size": 32,
            "val_size": 2,
            "test_size": 4,
        },
        "trainer": {
            "total_updates": 150,
            "eval_every": 75,
            "global_batch_size": 8,
            "optimizer": {"lr": 5e-3},
        },
        "checkpoint": {"every_updates": 0},
        "rollout": {"max_new_tokens": 48, "batch_size": 8},
    }
    cfg = validate_config(tiny_config(run_dir, fit_small_codec(tmp_path / "codec"), **sections))
    run_train(cfg)
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["i2t_mc/accuracy"] == results["i2t_mc/mean@n"]  # the headline names
    assert results["t2i/score"] == results["t2i/digit_classifier/mean"]
    assert results["t2i/n_samples"] == 4.0 and "t2i/finish_length_exact_frac" in results
    for key in ("exact_match", "exact_match_unmasked", "exact_match_masked_image"):
        assert f"draw_then_answer/{key}" in results  # the masked-image probe is part of it
    out = tmp_path / "uniweave-eval"
    argv = [
        "eval",
        str(run_dir / "config.yaml"),
        f"model.path={run_dir / 'model'}",
        "evaluation.split=test",
        f"evaluation.output_dir={out}",
    ]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert _flat(summary) == results  # the same numbers, exactly
    assert summary["scoring"]["source"] == "task defaults"
    assert [p["name"] for p in summary["scoring"]["plugins"]] == [
        "digit_classifier",
        "mc_exact",
        "exact_answer",
    ]
    records = [json.loads(line) for line in (out / "results.jsonl").open()]
    t2i = [r for r in records if r["task"] == "t2i"]
    assert len({tuple(map(tuple, r["codes"][0])) for r in t2i}) > 1  # sampled images
    drawn = [r for r in records if r["task"] == "draw_then_answer"]
    assert any(r["images"] for r in drawn)  # (trained enough to draw: the probe bites)
    for r in drawn:  # greedy: re-decoding the answer unmasked gives the engine's answer
        assert r["masked"]["unmasked"] == r["scores"]["exact_answer"]
    logged = {m["update"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").open())}
    for update in (75, 150):
        val = json.loads(
            (run_dir / "evals" / f"val-update-{update:06d}" / "summary.json").read_text()
        )
        rollout_keys = {  # besides SFT's teacher-forced val/loss* (test_validation_cadence)
            k: v
            for k, v in logged[update].items()
            if k.startswith("val/") and not k.startswith("val/loss")
        }
        assert rollout_keys == {f"val/{k}": v for k, v in _flat(val).items()}
        assert {"val/loss", "val/loss_text", "val/loss_image_vq"} <= set(logged[update])


def test_every_digits_task_declares_a_default_verifier():
    from uniweave.config import DIGITS_TASKS
    from uniweave.rewards import PLUGINS, TASK_VERIFIERS

    assert set(TASK_VERIFIERS) == set(DIGITS_TASKS)
    assert all(v.plugin in PLUGINS for v in TASK_VERIFIERS.values())


def test_a_task_nothing_can_score_is_a_config_error(tmp_path):
    """data.path rows of a task without a default verifier and no reward.plugins: a
    ConfigError naming reward.plugins before anything is written (no silent zeros)."""
    from uniweave.config import ConfigError, UniweaveConfig
    from uniweave.eval import run_eval
    from uniweave.train.run import run_train

    data = make_dataset(tmp_path / "data", 4)
    path = write_config(tmp_path, data)
    text = path.read_text().replace(
        "reward: {plugins: [{name: text_exact, tasks: [colour_qa]}]}\n", ""
    )
    path.write_text(text + f"evaluation: {{output_dir: {tmp_path / 'out'}}}\n")
    cfg: UniweaveConfig = load_config(path)
    with pytest.raises(ConfigError, match="colour_qa.*no default verifier") as err:
        run_eval(cfg)
    assert err.value.key == "reward.plugins" and not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="no default verifier"):
        run_train(cfg)
    assert not (tmp_path / "run").exists()


def test_one_definition_of_passing():
    """A row passes when its total reward is >= evaluation.pass_threshold (default 0.5:
    a classifier's 0.9999 passes), in evaluation and in GRPO/OPD's accuracy."""
    import torch

    from uniweave.config import EvaluationConfig
    from uniweave.rewards import RewardResult, passes
    from uniweave.train.onpolicy.stats import row_passes, task_accuracy

    threshold = EvaluationConfig().pass_threshold
    total = torch.tensor([0.9999, 1.0, 0.5, 0.4999, 0.0])
    assert passes(total, threshold).tolist() == [True, True, True, False, False]
    assert passes(0.9999, 1.0).item() is False and passes(torch.tensor([1.0]), 1.0).item()
    n = len(total)
    result = RewardResult(
        total=total,
        raw_total=total,
        per_plugin={"p": total},
        applied={"p": torch.ones(n, dtype=torch.bool)},
        invalid={"p": torch.zeros(n, dtype=torch.bool)},
        errors={"p": torch.zeros(n, dtype=torch.bool)},
        truncated=torch.zeros(n, dtype=torch.bool),
        overwritten=torch.zeros(n, dtype=torch.bool),
        sample_ids=[str(i) for i in range(n)],
        tasks=["a", "a", "b", "b", "b"],
    )
    assert row_passes(result, threshold).tolist() == passes(total, threshold).tolist()
    assert task_accuracy(result, threshold) == {
        "task/a/accuracy": 1.0,
        "task/b/accuracy": 1 / 3,
    }


def test_max_samples_is_stratified_by_task(tmp_path):
    """evaluation.max_samples deals its N rows round-robin over the tasks (a task with no
    rows left passes its turn), draws each task's rows with a seed from (data.seed, task),
    and a kept row keeps its seed index: its sampled response equals the uncapped run's."""
    data = make_dataset(tmp_path / "data", 24)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    test_ids = [r["id"] for r in rows if r["split"] == "test"]
    late = set(test_ids[-2:])  # the last two test rows: task colour_qb, after every colour_qa
    for row in rows:
        row["task"] = "colour_qb" if row["id"] in late | {"sq0"} else "colour_qa"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = "evaluation: {greedy: false}\n"
    path = write_config(tmp_path, data, extra)
    text = path.read_text().replace("tasks: [colour_qa]", "tasks: [colour_qa, colour_qb]")
    path.write_text(text)
    base = load_config(path)
    model = build_model(base).eval()

    def kept(overrides: list[str]) -> dict[str, str]:
        cfg = load_config(path, overrides)
        out = tmp_path / f"eval-{len(list(tmp_path.iterdir()))}"
        evaluate(cfg, model, out)
        records = [json.loads(line) for line in (out / "results.jsonl").open()]
        return {r["id"]: r["response"] for r in records}

    everything = kept([])
    assert sorted(everything) == sorted(test_ids)
    for cap in (1, 2, 4, 6, 11, 12):
        # two tasks of 10 and 2 rows, dealt a, b, a, b, ...: b gets min(2, floor(cap / 2))
        want_b = min(2, cap // 2)
        got = kept([f"evaluation.max_samples={cap}"])
        assert len(got) == cap and len(late & set(got)) == want_b, (cap, sorted(got))
        assert all(everything[i] == got[i] for i in got)  # same seed index, same response
    four = kept(["evaluation.max_samples=4"])
    assert four == kept(["evaluation.max_samples=4"])
    others = {frozenset(kept(["evaluation.max_samples=4", f"data.seed={s}"])) for s in (1, 2, 3)}
    assert len(others | {frozenset(four)}) > 1  # the draw depends on data.seed


def test_uniweave_eval_of_a_task_nothing_can_score_exits_2(tmp_path, capsys):
    """The command line: `uniweave eval` with the quickstart recipe and no reward plugin exits
    2 with one line naming the key, before a model is built or anything written."""
    from uniweave.cli import main

    out = tmp_path / "eval"
    recipe = str(ROOT / "recipes" / "examples" / "own_data_tiny.yaml")
    data = [f"data.path={ROOT}/examples/colour_squares/train.jsonl"]
    data.append(f"data.test_path={ROOT}/examples/colour_squares/test.jsonl")
    argv = ["eval", recipe, "--random-init", "reward.plugins=[]", *data]
    assert main([*argv, f"evaluation.output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reward.plugins" in err[0] and "colour_qa" in err[0]
    assert not out.exists()
