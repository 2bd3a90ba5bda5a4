"""Every suggested fix works (issue 51): a refusal or warning that proposes a change
(`set KEY=VALUE ...`, `pass --FLAG`) leads, once the change is applied as written, to an
accepted config, or at least to another message (the next problem, never the same one).

`test_every_proposal_in_the_source_is_walked` scans src/uniweave for the proposals a
message can make and requires each to be walked here (`WALKED`) or named with the test
that applies it (`APPLIED_ELSEWHERE`). Each walk triggers the message with a small config
(config-level checks and the preflight: nothing is trained), parses the proposal out of
the message text (`proposals`), applies it mechanically (the KEY=VALUE pairs as command-line
overrides, a flag as an argument) and checks again. tests/test_bad_inputs.py does the same
over its whole matrix of bad inputs through the CLI.
"""

from __future__ import annotations

import json
import logging
import re
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from PIL import Image
from suggestions import proposals

from uniweave import cli
from uniweave.config import ConfigError, load_config
from uniweave.data.loader import DatasetError

SRC = Path(__file__).resolve().parents[1] / "src" / "uniweave"


def test_proposals_parse_as_a_user_reads_them():
    assert proposals("x; set data.val_size=0 trainer.eval_every=0 to silence this)") == [
        ["data.val_size=0", "trainer.eval_every=0"]
    ]
    assert proposals("labels (e.g. set data.tasks=[a,b])") == [["data.tasks=[a,b]"]]
    assert proposals("(set data.over_length=drop to leave such rows out)") == [
        ["data.over_length=drop"]
    ]
    assert proposals("pass --on-error zero to score") == [["--on-error", "zero"]]
    assert proposals("set it or pass --preset (a | b)") == [["--preset"]]
    assert proposals("set trainer.eval_every or keep_best null") == []


# -- the source scan -------------------------------------------------------------------

PROPOSING = re.compile(r"\bset (?:[a-z_]+\.)+[a-z_]+=|\bset (?:%s|\{key\}=)|\bpass --[a-z]")
JOINED = re.compile(r"[\"']\s*\n\s*[rf]*[\"']")  # adjacent string literals: one message

WALKED: dict[tuple[str, str], str] = {}
"""(source file, text of the proposing line) -> the walk below that applies it."""

APPLIED_ELSEWHERE = {
    ("eval/geneval/score.py", "pass --on-error zero"): (
        "runtime detector failures: tests/test_geneval_detectors.py::"
        "test_a_failing_model_is_a_detection_error_naming_the_images runs the flag"
    ),
    ("eval/geneval/command.py", "pass --clip-path"): (
        "asks for the user's CLIP model path (no value to apply): "
        "tests/test_geneval_eval.py passes one"
    ),
    ("train/methods/sft/source.py", "set data.over_length=drop"): (
        "needs serialised rows (a model's tokenizer): tests/test_knobs.py's "
        "data.max_sequence_tokens probe trains with data.over_length=drop"
    ),
    ("train/preflight.py", "set rollout.length_semantics=cap"): (
        "tests/test_bad_inputs.py::test_every_proposed_fix_is_accepted_or_changes_the_message "
        "applies it to the exact_length cases of the matrix"
    ),
    ("train/methods/sft/objective.py", "student_full_view=sequential"): (
        "a model with active dropout: tests/test_ig_full_view.py::"
        "test_fused_refuses_a_model_with_active_dropout computes the loss with it"
    ),
    ("train/distributed/parallel.py", "set trainer.parallel=ddp"): (
        "an FSDP2 without set_reduce_scatter_unused_params (torch < 2.13): not this torch; "
        "ddp is trained by tests/test_parallel.py"
    ),
    ("train/state/fingerprints.py", "set {key}={recorded}"): (
        "tests/test_campaigns.py::test_a_dataset_path_naming_another_file_is_refused_as_"
        "another_file resumes with the proposed data.path"
    ),
}


def walks(*sites: tuple[str, str]):
    def register(fn):
        for site in sites:
            WALKED[site] = fn.__name__
        return fn

    return register


def test_every_proposal_in_the_source_is_walked():
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for line in JOINED.sub("", path.read_text()).splitlines():
            if PROPOSING.search(line) and not line.lstrip().startswith("#"):
                found.add((rel, line.strip()))
    claimed = {**WALKED, **APPLIED_ELSEWHERE}
    unclaimed = sorted(
        (rel, line) for rel, line in found if not any(rel == f and s in line for f, s in claimed)
    )
    assert not unclaimed, f"a message proposes a change no walk applies: {unclaimed}"
    stale = [k for k in claimed if not any(k[0] == rel and k[1] in line for rel, line in found)]
    assert not stale, f"walked proposals no message makes any more: {stale}"
    assert len(found) >= 12


# -- the walks ---------------------------------------------------------------------------


def _write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def _refusal(check, config, overrides=()) -> str | None:
    """The message `check(load_config(config, overrides))` refuses with; None if accepted."""
    try:
        check(load_config(config, list(overrides)))
    except (ConfigError, DatasetError, ValueError) as err:
        return str(err)
    return None


def _walk(check, config, overrides=()) -> str:
    """Trigger, apply every proposal of the message, check again: accepted or another
    message. Returns the first message (for the caller's own assertions)."""
    first = _refusal(check, config, overrides)
    assert first is not None, "the case does not trigger its message"
    found = proposals(first)
    assert found, f"no proposal parsed out of: {first}"
    for change in found:
        again = _refusal(check, config, [*overrides, *change])
        assert again != first, f"applying {change} gives the same message: {first}"
    return first


def _valid(cfg) -> None:  # load_config validated it
    return None


def _rows(tmp: Path, rows: list[dict], name: str = "rows.jsonl") -> Path:
    path = tmp / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _qa(i: int, task: str = "shape_qa", answer: str = "circle", image: str | None = None, **kw):
    user = [{"type": "text", "text": "Which shape?"}]
    if image:
        user.insert(0, {"type": "image", "path": image})
    return {
        "id": f"r{i}",
        "task": task,
        "answer": answer,
        "messages": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": answer},
        ],
        **kw,
    }


def _sft(tmp: Path, data: dict, **sections) -> dict:
    cfg = {
        "run": {"output_dir": str(tmp / "run"), "device": "cpu"},
        "model": {"tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2}},
        "data": {"val_size": 0, "test_size": 0, **data},
        "trainer": {"total_updates": 2, "global_batch_size": 2, "micro_batch_size": 2},
    }
    cfg.update(sections)
    return cfg


def _preflight(cfg) -> None:
    from uniweave.data.rows import resolve_tasks
    from uniweave.train.preflight import preflight

    preflight(resolve_tasks(cfg))


@walks(("config/schema.py", "evaluation.greedy=false"))
def test_greedy_with_several_rollouts(tmp_path):
    cfg = _write(tmp_path / "c.yaml", {"evaluation": {"rollouts_per_sample": 4}})
    assert _refusal(_valid, cfg, ["evaluation.greedy=false"]) is None
    _walk(_valid, cfg)


@walks(("config/schema.py", "set model.tiny.mixer_kernel=0"))
def test_continuous_batching_with_the_conv_prior(tmp_path):
    grpo = {
        "algorithm": {"name": "grpo", "group_size": 2},
        "data": {"tasks": ["i2t_mc"]},
        "reward": {"plugins": [{"name": "mc_exact"}]},
        "rollout": {"continuous_batching": True, "batch_size": 4},
    }
    cfg = _write(tmp_path / "c.yaml", grpo)
    assert _refusal(_valid, cfg, ["model.tiny.mixer_kernel=0"]) is None
    _walk(_valid, cfg)


@walks(("config/trainer.py", "set trainer.scheduler.name=warmup_constant"))
def test_warmup_on_a_constant_schedule(tmp_path):
    cfg = _write(tmp_path / "c.yaml", {"trainer": {"scheduler": {"name": "constant"}}})
    message = _walk(_valid, cfg, ["trainer.scheduler.warmup_steps=3"])
    (change,) = proposals(message)
    assert _refusal(_valid, cfg, ["trainer.scheduler.warmup_steps=3", *change]) is None


@walks(("config/trainer.py", "also set trainer.scheduler.warmup_steps="))
def test_warmup_longer_than_the_run(tmp_path):
    sched = {"name": "warmup_cosine", "warmup_steps": 10}
    cfg = _write(tmp_path / "c.yaml", {"trainer": {"scheduler": sched}})
    message = _walk(_valid, cfg, ["trainer.total_updates=5"])
    (change,) = proposals(message)
    assert _refusal(_valid, cfg, ["trainer.total_updates=5", *change]) is None


@walks(("models/uniar/tiny.py", "set model.tiny.mixer_kernel=0"))
def test_uniar_built_with_the_conv_prior(tmp_path):
    from uniweave.models import check_model_config

    def check(cfg):
        check_model_config(cfg.model)

    cfg = _write(tmp_path / "c.yaml", {"model": {"kind": "uniar", "visual_head": "bsq"}})
    assert _refusal(check, cfg, ["model.tiny.mixer_kernel=0"]) is None
    _walk(check, cfg)


@walks(("data/images.py", "set data.image_resize=resize"))
def test_images_of_another_size(tmp_path):
    pixels = np.zeros((16, 16, 3), dtype=np.uint8)
    pixels[4:12, 4:12] = (200, 40, 40)
    Image.fromarray(pixels).save(tmp_path / "square.png")
    rows = _rows(tmp_path, [_qa(i, image="square.png") for i in range(3)])
    cfg = _write(tmp_path / "c.yaml", _sft(tmp_path, {"path": str(rows), "tasks": ["shape_qa"]}))
    assert "16x16" in _walk(_preflight, cfg)
    assert _refusal(_preflight, cfg, ["data.image_resize=resize"]) is None


@walks(("data/rows.py", "set data.tokenizer=bpe"))
def test_words_outside_the_word_tokenizer(tmp_path):
    rows = _rows(tmp_path, [_qa(i) for i in range(3)])
    data = {"path": str(rows), "tasks": ["shape_qa"], "tokenizer": "word"}
    cfg = _write(tmp_path / "c.yaml", _sft(tmp_path, data))
    _walk(_preflight, cfg)
    assert _refusal(_preflight, cfg, ["data.tokenizer=bpe"]) is None


@walks(("data/rows.py", "e.g. set data.tasks=["))
def test_rows_of_several_tasks_without_data_tasks(tmp_path):
    rows = _rows(tmp_path, [_qa(i, task=("shape_qa", "colour_qa")[i % 2]) for i in range(4)])
    cfg = _write(tmp_path / "c.yaml", _sft(tmp_path, {"path": str(rows)}))
    message = _walk(_preflight, cfg)
    assert "colour_qa (2), shape_qa (2)" in message
    assert _refusal(_preflight, cfg, ["data.tasks=[colour_qa,shape_qa]"]) is None


@walks(("train/run.py", "(set %s to silence this)"))
def test_no_val_rows_for_a_recipe_that_validates(tmp_path, caplog):
    """shapes_grpo inherits val_size 12 and eval_every 10: on rows without val rows it
    warns, and the overrides it proposes give a config that validates and warns no more."""
    from uniweave.train.run import _rows_of

    rows = _rows(tmp_path, [_qa(i, answer="circle square".split()[i % 2]) for i in range(4)])
    base = [f"data.path={rows}", "data.tasks=[shape_qa]", "reward.plugins.0.tasks=[shape_qa]"]

    def warning(overrides):
        caplog.clear()
        cfg = load_config("examples/shapes_grpo", base + overrides)
        with caplog.at_level(logging.WARNING, logger="uniweave.train.run"):
            assert _rows_of(cfg, "val", cfg.data.val_size) is False
        return caplog.text.strip()

    message = warning([])
    assert "no val rows" in message and "to silence this" in message, message
    (change,) = proposals(message)
    assert "data.val_size=0" in change and "trainer.eval_every=0" in change, change
    assert warning(change) == ""  # validates (no ConfigError) and is silent


@walks(("train/engine/resume.py", "checkpoint.resume_mode=allow_schedule_changes"))
def test_resume_with_a_longer_schedule(tmp_path):
    from uniweave.config.hashing import config_hash
    from uniweave.train.engine.resume import check_resume

    config = _write(tmp_path / "c.yaml", _sft(tmp_path, {"tasks": ["t2i"]}))
    saved = load_config(config)
    found = SimpleNamespace(
        path=tmp_path / "run" / "checkpoints" / "update-000002",
        state={"config": saved.model_dump(mode="json"), "config_hash": config_hash(saved)},
    )
    longer = ["trainer.total_updates=4"]
    _walk(lambda cfg: check_resume(found, cfg), config, longer)
    fix = "checkpoint.resume_mode=allow_schedule_changes"
    assert _refusal(lambda cfg: check_resume(found, cfg), config, [*longer, fix]) is None


@walks(("cli.py", "or pass --random-init"))
def test_eval_without_model_path(tmp_path):
    config = _write(tmp_path / "c.yaml", {"data": {"tasks": ["t2i"]}})

    def refused(args: list[str]) -> str | None:
        ns = Namespace(
            config=str(config),
            overrides=[a for a in args if "=" in a],
            random_init="--random-init" in args,
            command="eval",
        )
        try:
            cli.load_weights_config(ns)
        except ConfigError as err:
            return str(err)
        return None

    first = refused([])
    assert first is not None and proposals(first), first
    for change in proposals(first):
        if change == ["--random-init"]:
            assert refused(change) is None
        else:  # model.path=runs/NAME/model: a placeholder the user fills in
            assert change == ["model.path=runs/NAME/model"], change


@walks(("plan.py", "pass --preset"))
def test_plan_without_model_path(tmp_path, capsys):
    config = _write(tmp_path / "c.yaml", {"model": {"kind": "uniar", "visual_head": "bsq"}})
    assert cli.main(["plan", str(config)]) == 2
    message = capsys.readouterr().err
    changes = [c for c in proposals(message) if c[0] == "--preset"]
    assert changes, message
    listed = re.search(r"--preset \(([^)]*)\)", message).group(1).split(" | ")
    codes = [cli.main(["plan", str(config), "--preset", p]) for p in listed]
    assert 0 in codes, (listed, codes)  # the preset of the config's kind is accepted


@walks(("data/export.py", "pass --overwrite"))
def test_export_into_a_folder_that_is_not_empty(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    args = ["data", "export", "--task", "i2t_mc", "--split", "test", "--n", "2", "--out", str(out)]
    assert cli.main(args) == 2
    message = capsys.readouterr().err
    (change,) = proposals(message)
    assert cli.main([*args, *change]) == 0


@walks(("rewards/service.py", "set reward.on_error=zero"))
def test_a_failing_reward_plugin():
    """A plugin that fails (a judge whose endpoint refuses connections): the refusal's
    `set reward.on_error=zero`, applied to the reward config, scores the rows 0."""
    from uniweave.config.overrides import apply_overrides
    from uniweave.config.schema import RewardConfig
    from uniweave.core.sample import Sample, TextPart
    from uniweave.rewards import RewardError, build_reward_service

    plugin = {
        "name": "answer_judge",
        "kwargs": {"base_url": "http://127.0.0.1:9", "model": "j", "timeout": 0.5, "retries": 0},
    }
    raw = {"reward": {"plugins": [plugin]}}
    samples = [Sample(id="q0", task="i2t_open", parts=[TextPart("?", "user")], answer="7")]
    ended = [SimpleNamespace(sample_id="q0", finish_reason="eos", length_semantics="cap")]
    responses = [[TextPart("seven", "assistant")]]

    def score(data):
        return build_reward_service(RewardConfig(**data["reward"])).score(samples, ended, responses)

    with pytest.raises(RewardError) as err:
        score(raw)
    (change,) = proposals(str(err.value))
    apply_overrides(raw, change, {})
    assert score(raw).total.tolist() == [0.0]


def test_did_you_mean_renames_the_key_or_replaces_the_value(tmp_path):
    """A misspelt key or value: the suggestion put in its place is accepted."""
    cfg = _write(tmp_path / "c.yaml", {"data": {"tasks": ["t2i"]}})
    for wrong in ("trainer.optimiser.lr=1e-3", "algorithm.name=sfd", "run.devise=cpu"):
        message = _refusal(_valid, cfg, [wrong])
        m = re.search(r"(?:^|: )([a-z_.0-9]+): .*; did you mean '([^']+)'\?$", message)
        assert m, message
        key, meant = m.group(1), m.group(2)
        lhs, value = wrong.split("=", 1)
        fixed = lhs.replace(key, meant, 1) + "=" + value if "." in meant else f"{lhs}={meant}"
        assert _refusal(_valid, cfg, [fixed]) is None, (wrong, message, fixed)
