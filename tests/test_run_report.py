"""Run reports and health alarms (issue 34 items 1-2, docs/reports.md).

- the paired verdicts against an independent numpy computation;
- a real GRPO run that lowers its held-out metric (an SFT model that answers one word,
  then GRPO at lr 0.5: Adam's first steps are ~lr per weight, which wrecks a tiny model)
  ends with "got worse" and the held-out alarm at the top of its report, while the SFT
  run before it ends "improved"; `uniweave report` rebuilds the same report, and `uniweave
  report A B` compares the two runs;
- the fixed-length trap: text-to-image rows of exactly the cap's length (a 4x4 grid, 16
  positions, max_new_tokens 16, length_semantics cap) end "cap", so truncation shaping
  overwrites every reward; the alarm fires within 3 updates.
"""

from __future__ import annotations

import base64
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from uniweave.cli import main
from uniweave.config import validate_config
from uniweave.eval.paired import compare
from uniweave.train.run import run_train

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = [
    "red",
    "green",
    "blue",
    "cat",
    "dog",
    "sun",
    "moon",
    "tree",
    "fish",
    "bird",
    "rock",
    "star",
]


# -- verdicts vs an independent paired computation ---------------------------------------


def _records(totals: np.ndarray, invalid: np.ndarray, task: str = "t") -> list[dict]:
    """Records of prompts i x members m with the given totals / invalid flags."""
    return [
        {
            "id": f"p{i}",
            "task": task,
            "member": m,
            "total": float(totals[i, m]),
            "passed": bool(totals[i, m] >= 0.5),
            "invalid": ["x"] if invalid[i, m] else [],
        }
        for i in range(totals.shape[0])
        for m in range(totals.shape[1])
    ]


def _numpy_verdict(before: np.ndarray, after: np.ndarray, higher: bool, z: float) -> tuple:
    d = after - before
    diff = float(d.mean())
    se = float(d.std(ddof=1) / np.sqrt(d.size))
    if diff != 0 and abs(diff) > z * se:
        return diff, se, "improved" if (diff > 0) == higher else "got worse"
    return diff, se, "no detectable change"


@pytest.mark.parametrize("shift", [0.3, -0.3, 0.01, 0.0])
def test_verdicts_match_an_independent_paired_computation(shift):
    rng = np.random.default_rng(7)
    n, m = 40, 3
    before = rng.uniform(0, 1, (n, m))
    after = np.clip(before + shift + rng.normal(0, 0.2, (n, m)), 0, 1)
    inv_b, inv_a = rng.uniform(size=(n, m)) < 0.2, rng.uniform(size=(n, m)) < 0.2 + shift
    got = {p.metric: p for p in compare(_records(before, inv_b), _records(after, inv_a), 2.0)}
    per = {
        "mean@n": (before.mean(1), after.mean(1), True),
        "pass@n": ((before >= 0.5).any(1) * 1.0, (after >= 0.5).any(1) * 1.0, True),
        "invalid_frac": (inv_b.mean(1), inv_a.mean(1), False),
    }
    for metric, (b, a, higher) in per.items():
        diff, se, verdict = _numpy_verdict(b, a, higher, 2.0)
        p = got[metric]
        # bound: float64 sums of <= 40 values in [-1, 1]: 40 x 2^-53 ~ 4e-15, inside 1e-12
        assert p.n == n and abs(p.diff - diff) < 1e-12 and abs(p.se - se) < 1e-12
        assert p.verdict == verdict, (metric, p)
    if shift == 0.3:
        assert got["mean@n"].verdict == "improved" and got["invalid_frac"].verdict == "got worse"
    if shift == -0.3:
        assert got["mean@n"].verdict == "got worse" and got["invalid_frac"].verdict == "improved"


def test_verdicts_pair_only_shared_prompts_and_need_two():
    one = np.array([[0.0]]), np.array([[1.0]])
    flags = np.zeros((1, 1), dtype=bool)
    (p, *_) = compare(_records(one[0], flags), _records(one[1], flags), 2.0)
    assert p.n == 1 and p.verdict == "no detectable change"  # SE undefined with one pair
    a = _records(np.zeros((3, 1)), np.zeros((3, 1), dtype=bool))
    b = _records(np.ones((5, 1)), np.zeros((5, 1), dtype=bool))
    (p, *_) = compare(a, b, 2.0)
    assert p.n == 3 and p.diff == 1.0 and p.se == 0.0 and p.verdict == "improved"


# -- a GRPO run that makes its model worse --------------------------------------------------


def _dataset(root: Path) -> Path:
    rows = []
    for i in range(36):
        split = "train" if i < 24 else "val"
        text = f"is {WORDS[i % len(WORDS)]} {i} here ?"
        rows.append(
            {
                "id": f"q{i}",
                "messages": [
                    {"role": "user", "content": text},
                    {"role": "assistant", "content": "yes"},
                ],
                "answer": "yes",
                "task": "yes",
                "split": split,
            }
        )
    path = root / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _base(root: Path) -> dict:
    return {
        "run": {"device": "cpu", "seed": 0},
        "model": {
            "tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
        },
        "data": {"path": str(_dataset(root)), "tasks": ["yes"], "val_size": 12, "test_size": 0},
        "rollout": {"max_new_tokens": 4},
        "reward": {"plugins": [{"name": "text_exact", "tasks": ["yes"]}]},
        "checkpoint": {"every_updates": 0},
        "logging": {"tensorboard": False, "progress_bar": False},
    }


class _Sources(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.srcs += [v for k, v in attrs if k in ("src", "href") and v is not None]


def _check_self_contained(page: str) -> int:
    """Every src/href of the page is an inline data URI holding a decodable PNG; returns
    how many images it holds."""
    parser = _Sources()
    parser.feed(page)
    for src in parser.srcs:
        assert src.startswith("data:image/png;base64,"), src[:60]
        Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).verify()
    return len(parser.srcs)


def test_a_grpo_run_that_lowers_its_heldout_metric_says_so(tmp_path, capsys):
    base = _base(tmp_path)
    sft = validate_config(
        {
            **base,
            "run": {**base["run"], "output_dir": str(tmp_path / "sft")},
            "trainer": {
                "optimizer": {"lr": 1e-2},
                "total_updates": 16,
                "global_batch_size": 8,
                "micro_batch_size": 8,
                "eval_every": 16,
            },
        }
    )
    sft_dir = run_train(sft)
    grpo = validate_config(
        {
            **base,
            "run": {**base["run"], "output_dir": str(tmp_path / "grpo")},
            "model": {"path": str(sft_dir / "model")},  # its own sizes and codec
            "algorithm": {"name": "grpo", "group_size": 4},
            "trainer": {
                "optimizer": {"lr": 0.5},
                "scheduler": {"warmup_steps": 0},
                "total_updates": 3,
                "global_batch_size": 8,
                "micro_batch_size": 8,
                "eval_every": 3,
            },
        }
    )
    grpo_dir = run_train(grpo)
    err = capsys.readouterr().err
    assert re.search(r"^health alarm: heldout_drop at update 3: val/yes/mean@n fell", err, re.M)

    sft_report = json.loads((sft_dir / "report.json").read_text())
    sft_v = {(v["split"], v["metric"]): v for v in sft_report["verdicts"]}
    assert sft_v["val", "mean@n"]["verdict"] == "improved"

    report = json.loads((grpo_dir / "report.json").read_text())
    v = {(r["split"], r["metric"]): r for r in report["verdicts"]}
    worse = v["val", "mean@n"]
    assert worse["verdict"] == "got worse" and worse["before"] > worse["after"]
    assert any(a["name"] == "heldout_drop" for a in report["alarms"])
    assert report["parent"]["config_hash"] == (sft_dir / "config_hash").read_text().strip()

    md = (grpo_dir / "report.md").read_text()
    alarms = md[md.index("## Alarms") : md.index("## Verdicts")]
    assert "heldout_drop at update 3" in alarms
    assert "val yes mean@n: got worse" in md and "test |diff| > 2 SE" in md
    assert md.index("## Alarms") < md.index("## Verdicts") < md.index("## Held-out")
    assert "## Training curves" in md and "## Gallery (val)" in md

    page = (grpo_dir / "report.html").read_text()
    assert _check_self_contained(page) >= 1  # curves.png, inline
    assert '<img alt="curves.png" src="data:image/png;base64,' in page
    assert 'class="worse"' in page

    # `uniweave report RUN_DIR` rebuilds the same report from the run directory
    before = md
    (grpo_dir / "report.md").unlink()
    assert main(["report", str(grpo_dir)]) == 0
    assert (grpo_dir / "report.md").read_text() == before
    # `uniweave report A B`: the GRPO model against the SFT model it started from
    assert main(["report", str(sft_dir), str(grpo_dir), "--out", str(tmp_path / "cmp")]) == 0
    cmp = (tmp_path / "cmp" / "compare.md").read_text()
    assert re.search(r"\| yes \| mean@n \| 1\.000 \| 0\.\d+ \| -[^|]+\| got worse \|", cmp), cmp
    _check_self_contained((tmp_path / "cmp" / "compare.html").read_text())
    assert main(["report", str(tmp_path / "nowhere")]) == 2


# -- the fixed-length trap ---------------------------------------------------------------


def test_the_fixed_length_trap_fires_its_alarm_within_three_updates(
    tmp_path, capsys, small_vq_dir, classifier_dir
):
    cfg = validate_config(
        {
            "run": {"device": "cpu", "seed": 0, "output_dir": str(tmp_path / "trap")},
            "model": {
                "tiny": {
                    "hidden_size": 16,
                    "num_layers": 1,
                    "num_heads": 2,
                    "intermediate_size": 32,
                },
                "codec": {"path": str(small_vq_dir), "codebook_size": 16},
            },
            "data": {"tasks": ["t2i"], "train_size": 8, "val_size": 0, "test_size": 0},
            # 16 = the 4x4 grid: the image fills the cap exactly and ends "cap"
            "rollout": {"max_new_tokens": 16, "length_semantics": "cap"},
            "algorithm": {"name": "grpo", "group_size": 4},
            "reward": {"plugins": [{"name": "digit_classifier", "path": str(classifier_dir)}]},
            "trainer": {"total_updates": 3, "global_batch_size": 8, "micro_batch_size": 8},
            "checkpoint": {"every_updates": 0},
            "logging": {"tensorboard": False, "progress_bar": False},
        }
    )
    with pytest.warns(UserWarning, match="overwrote 100% of the rewards"):
        run_train(cfg, stop_after=1)
    err = capsys.readouterr().err
    fired = re.findall(r"^health alarm: truncation_overwrite at update (\d+):", err, re.M)
    assert fired == ["1"]
    # resumed: the logged update is replayed silently, the still-true alarm is not repeated
    with pytest.warns(UserWarning, match="overwrote 100% of the rewards"):
        run_dir = run_train(cfg)
    assert "truncation_overwrite" not in capsys.readouterr().err
    report = json.loads((run_dir / "report.json").read_text())
    trap = [a for a in report["alarms"] if a["name"] == "truncation_overwrite"]
    assert len(trap) == 1 and trap[0]["update"] == 1 and trap[0]["value"] == 1.0
    md = (run_dir / "report.md").read_text()
    assert "truncation_overwrite at update" in md[: md.index("## Verdicts")]


# -- an alarm once per run ------------------------------------------------------------------


def test_an_alarm_prints_once_and_the_report_lists_when_it_fired_again(tmp_path, capsys):
    """The zero-variance share crosses `health.zero_variance_share` (0.75) at updates 2, 5,
    9 and 14 of 16 and clears in between: the run prints the alarm once (at 2), a resumed
    run replays the logged updates and prints nothing, and the report lists it once,
    "again at updates 5, 9, 14"."""
    from uniweave.eval.run_report import write_report
    from uniweave.train.engine.metrics import METRICS
    from uniweave.train.run import HealthWatch

    cfg = validate_config({"run": {"output_dir": str(tmp_path)}})
    (tmp_path / "config.yaml").write_text(json.dumps(cfg.model_dump(mode="json")))
    fires = {2, 5, 9, 14}
    stream = [
        (u, {"loss": 1.0, "adv/frac_zero_std_groups": 1.0 if u in fires else 0.25})
        for u in range(1, 17)
    ]

    def feed(updates) -> str:
        watch = HealthWatch(cfg, tmp_path)  # a process: a resume replays what was logged
        for u, metrics in updates:
            watch.update(u, metrics)
            with (tmp_path / METRICS).open("a") as f:
                f.write(json.dumps({"update": u, **metrics}) + "\n")
        return capsys.readouterr().err

    first = feed(stream[:10])
    lines = re.findall(r"^health alarm: zero_variance at update (\d+):", first, re.M)
    assert lines == ["2"]
    assert "zero_variance" not in feed(stream[10:])  # resumed at update 11: fires at 14
    summary = write_report(tmp_path)
    (alarm,) = summary["alarms"]
    assert (alarm["update"], alarm["again_at"]) == (2, [5, 9, 14])
    md = (tmp_path / "report.md").read_text()
    section = md[md.index("## Alarms (1)") : md.index("## Verdicts")]
    assert section.count("zero_variance at update") == 1 and "again at updates 5, 9, 14" in section
    page = (tmp_path / "report.html").read_text()
    assert "Alarms (1)" in page and "again at updates 5, 9, 14" in page
