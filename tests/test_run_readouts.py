"""What a run shows a person, checked on what real runs write (issue 51 items 3 and 6).

- Progress lines: a 3-update SFT, OPD and GRPO run each on the tiny model prints one
  plain line per update (no terminal under pytest); each carries the loss and every
  figure its method's spec declares (`MethodSpec.progress`), with the value that update's
  record in metrics.jsonl holds. A declared key the method never logs fails here (the
  line once looked for a reward key GRPO does not write).
- Curves (`uniweave.eval.curves`): the panels chosen from those runs' metrics have no
  duplicate and no constant curve, name each left-out metric, and GRPO with a KL term
  draws its KL; `curves.png` is drawn with the report.
- The report's gallery: report.md shows the same images as report.html (files that
  exist, relative to the run), and a prompt holding `<b>&` is escaped in both.
- A run's summaries of the rows it reads (a split's left-out rows, conversion counts) are
  said once, and reach train.log.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from eval_fixtures import make_dataset, write_config
from PIL import Image
from trainer_helpers import grpo_config, opd_config, tiny_config

from uniweave.config import load_config, validate_config
from uniweave.config.methods import method
from uniweave.eval.curves import COUNTS, select
from uniweave.eval.records import printable
from uniweave.train.engine.metrics import read_metrics
from uniweave.train.run import run_train

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on 1 thread

FAST = {"logging": {"every": 1, "tensorboard": False, "progress_bar": False}}


def _config(name: str, run, assets, tmp_path) -> dict:
    if name == "sft":
        return tiny_config(
            run,
            assets["vq"],
            data={"tasks": ["t2i", "i2t_mc"], "train_size": 4},
            trainer={"total_updates": 3, "global_batch_size": 4, "micro_batch_size": 4},
            **FAST,
        )
    if name == "grpo":  # text-to-image, the classifier's reward: groups differ, it learns
        cfg = grpo_config(run, assets, **FAST)
        cfg["trainer"]["total_updates"] = 3
        return cfg
    # OPD distilling every row (routing all), scored by the kit's rewards
    teacher = tmp_path / "teacher"
    validated = validate_config(opd_config(tmp_path / "x", assets, seed=9))
    from uniweave.models.build import build_model

    build_model(validated).save_pretrained(teacher)
    cfg = opd_config(run, {**assets, "teacher_vq": teacher})
    cfg["trainer"]["total_updates"] = 3
    cfg["logging"] = FAST["logging"]
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_vq_dir, classifier_dir) -> dict[str, tuple[Path, str]]:
    """method -> (run directory, what the run printed on stdout) of a real 3-update run."""
    assets = {"vq": small_vq_dir, "clf": classifier_dir}
    out = {}
    for name in ("sft", "opd", "grpo"):
        tmp = tmp_path_factory.mktemp(name)
        cfg = validate_config(_config(name, tmp / "run", assets, tmp))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            out[name] = (run_train(cfg), printed.getvalue())
    return out


@pytest.mark.parametrize("name", ["sft", "opd", "grpo"])
def test_a_real_runs_progress_lines_show_its_methods_figures(runs, name):
    run, printed = runs[name]
    shown = [ln for ln in printed.splitlines() if ln.startswith("update ")]
    records = {r["update"]: r for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    assert sorted(records) == [1, 2, 3] and len(shown) == 3
    fields = method(name).progress
    assert (name == "sft") == (not fields)  # SFT's figure is its loss
    for line in shown:
        m = records[int(line.split()[1].split("/")[0])]
        assert line.startswith(f"update {m['update']}/3  loss {m['loss']:.4f}  "), line
        for label, key, fmt in fields:
            assert key in m, (name, key, sorted(m))  # the method logs what it declares
            assert f"  {label} {m[key]:{fmt}}  " in line, (label, line)


@pytest.mark.parametrize("name", ["sft", "opd", "grpo"])
def test_curves_of_a_real_run_have_no_duplicate_and_no_constant(runs, name):
    run, _ = runs[name]
    records = read_metrics(run / "metrics.jsonl")
    curves = select(records)
    drawn = [s.key for s in curves.series]
    assert drawn and len(drawn) == len(set(drawn)) and drawn[0] == "loss"
    points = [s.points for s in curves.series]
    assert len(points) == len(set(points))  # no two curves with the same values
    for s in curves.series:
        assert len(set(s.values)) > 1, s.key  # never a flat line
        assert not s.key.endswith(COUNTS)
        assert s.points == tuple(
            (r["update"], r[s.key]) for r in records if isinstance(r.get(s.key), (int, float))
        )
    titles = [p.title for p in curves.panels]
    assert len(titles) == len(set(titles))  # one panel per signal
    # what was left out is named, with its value or the curve it equals
    for key, value in curves.constant:
        assert {r[key] for r in records if key in r} == {value}
        assert f"{key} = {value:.4g}" in curves.caption()
    for key, same in curves.duplicate:
        assert same in drawn and f"{key} (= {same})" in curves.caption()
    if name == "grpo":  # its KL term (k3, coef 0.05): the policy moves off the reference
        assert "policy/kl_ref_mean" in drawn and "KL to the reference" in titles
    if name == "opd":
        assert "opd/jsd" in drawn
    summary = json.loads((run / "report.json").read_text())
    assert summary["curves_left_out"]["constant"] == dict(curves.constant)
    with Image.open(run / "curves.png") as img:
        assert img.format == "PNG"
        rows = -(-len(curves.panels) // 3)
        assert img.size[1] > 250 * rows  # 3 in (300 px) per row of panels


def test_report_md_shows_the_html_gallery_and_both_escape_text(tmp_path):
    """An own-data SFT run whose prompts hold `<b>&`: the baseline and final evaluation
    galleries of report.md link the same image files report.html embeds (the prompt
    images), each a file of the run; the prompt is HTML-escaped in both."""
    data = make_dataset(tmp_path / "data", 6)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    for row in rows:
        row["messages"][0]["content"][1]["text"] = "Which colour is <b>&</b> the square?"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        "algorithm.name=sft",
        "trainer.total_updates=2",
        "trainer.global_batch_size=2",
        "trainer.micro_batch_size=2",
        "trainer.scheduler.warmup_steps=0",
        "data.val_size=0",
        "data.test_size=2",
        "logging.tensorboard=false",
    ]
    run = run_train(load_config(write_config(tmp_path, data), overrides))
    md = (run / "report.md").read_text()
    page = (run / "report.html").read_text()
    gallery_md = md[md.index("## Gallery (test)") :]
    gallery_html = page[page.index("<h2>Gallery (test)</h2>") :]
    linked = re.findall(r'<img width="64" alt="([^"]+)" src="([^"]+)">', gallery_md)
    embedded = re.findall(r'<img width="64" alt="([^"]+)" src="data:image/png', gallery_html)
    assert linked and [alt for alt, _ in linked] == embedded
    for alt, src in linked:
        assert (run / src).is_file() and src.endswith(alt) and src.startswith("evals/test-")
    assert {src.split("/")[1] for _, src in linked} == {
        "test-update-000000",
        "test-update-000002",
    }
    md_shown = "Which colour is &lt;b>&amp;&lt;/b> the square?"  # `<` and `&` as entities
    html_shown = "Which colour is &lt;b&gt;&amp;&lt;/b&gt; the square?"
    assert gallery_md.count(md_shown) == len(linked) == gallery_html.count(html_shown)
    assert "<b>" not in gallery_md and "<b>" not in gallery_html


def test_printable_shows_control_characters_as_escapes():
    # a sampled control byte (the BPE decodes it as one) and the replacement character
    # the tokenizer puts for undecodable bytes
    assert printable("ci\x19rcle\ufffd\x1e\n\tok\x7f") == "ci\\x19rcle\ufffd\\x1e\n\tok\\x7f"


def test_a_runs_summaries_are_said_once_and_reach_its_log(tmp_path, caplog):
    """An own-data SFT run whose file also holds rows of another task: preflight, training,
    the baseline and the final evaluation each read the rows, yet the left-out rows of each
    split and the image conversion counts are said once, and train.log holds them (said
    during preflight, before the log opened)."""
    data = make_dataset(tmp_path / "data", 8)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    for row in rows[:4]:
        row["task"] = "other"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        "algorithm.name=sft",
        "trainer.total_updates=2",
        "trainer.global_batch_size=2",
        "trainer.micro_batch_size=2",
        "trainer.scheduler.warmup_steps=0",
        "data.val_size=0",
        "data.test_size=2",
        "logging.tensorboard=false",
    ]
    with caplog.at_level("INFO", logger="uniweave"):
        run = run_train(load_config(write_config(tmp_path, data), overrides))
    said = [r.getMessage() for r in caplog.records]
    log = (run / "train.log").read_text()
    for split in ("train", "test"):
        line = f"data.path ({split}): left out rows of tasks not in data.tasks (other: 2)"
        assert said.count(line) == 1 and log.count(line) == 1, (split, said)
    counts = [m for m in said if "images for a greyscale" in m]
    assert len(counts) == 1 and log.count(counts[0]) == 1
