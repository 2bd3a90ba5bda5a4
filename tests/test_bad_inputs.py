"""Every mistake is one line naming its culprit, and touches nothing (issue 18).

Each case runs the real CLI (`python -m uniweave train ...`; `eval`, `generate`, `probe` and
`data export` too, issue 30: one error contract) in its own scratch directory
and asserts: the exit code; stderr is exactly one line `uniweave: error: ...` holding the
culprit's fragments (file, file:line, dotted key); no traceback; and then either, for a
fresh `run.output_dir`, that nothing was created (the output directory does not exist
and the scratch directory holds only the inputs the case wrote), or, for an existing
run (a private copy of one short checkpointed run made once for the module), that every
file of the run is byte-for-byte unchanged (config.yaml, config_hash, checkpoints,
metrics, model). The subprocesses run a few at a time; almost all fail in the preflight
before any model is built. Each case is its own process forked from a server that imported
uniweave once (`trainer_helpers.ForkedCLI`): the exit code, stderr and cwd are the child's
own, as with `python -m uniweave`, without paying Python's and torch's start-up per case.
Only the selected cases' processes start (`-k exact_length` runs one).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from PIL import Image
from suggestions import proposals
from trainer_helpers import ForkedCLI, run_cli

from uniweave.codecs import build_codec
from uniweave.config import validate_config
from uniweave.data.digits_images import load_split
from uniweave.models.build import build_model

WORKERS = 3

pytestmark = pytest.mark.slow


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file (and '<dir>' for every directory) under root."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "<dir>" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def tiny(out: Path, w: SimpleNamespace, **sections) -> dict:
    """A small valid SFT config on the pre-fitted codec, with `sections` merged in."""
    cfg = {
        "run": {"name": "bad", "seed": 1, "output_dir": str(out), "device": "cpu"},
        "model": {
            "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32},
            "codec": {"path": str(w.codec), "codebook_size": 16},
        },
        "data": {"tasks": ["t2i"], "train_size": 4, "val_size": 0, "test_size": 0},
        "trainer": {"total_updates": 2, "global_batch_size": 4, "micro_batch_size": 2},
        "checkpoint": {"every_updates": 1, "keep_last": 0},
        "logging": {"tensorboard": False, "progress_bar": False},
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    if cfg["model"].get("path") is not None:
        loaded(cfg, cfg["model"]["path"])
    return cfg


def loaded(cfg: dict, path: str) -> dict:
    """`cfg` with model.path `path`: a saved model ships its codec, so the pre-fitted
    codec's directory goes (model.codec.path does not act next to model.path; the sizes
    stay, the saved models' own)."""
    cfg["model"]["path"] = path
    cfg["model"]["codec"] = {k: v for k, v in cfg["model"]["codec"].items() if k != "path"}
    return cfg


def row(word: str, **extra) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"say {word}"},
            {"role": "assistant", "content": word},
        ],
        "task": "say",
        **extra,
    }


GOOD_ROWS = [row(w) for w in ("one", "two", "three", "four")]


def image_row(path: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image", "path": path}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "seven"},
        ],
        "task": "say",
    }  # fmt: skip


def rows_file(d: Path, bad: dict | str, name: str = "rows.jsonl") -> Path:
    """GOOD_ROWS with `bad` as the third line (a dict is dumped as JSON, a str kept)."""
    lines = [json.dumps(r) for r in GOOD_ROWS]
    lines.insert(2, bad if isinstance(bad, str) else json.dumps(bad))
    path = d / name
    path.write_text("\n".join(lines) + "\n")
    return path


def own(out: Path, w: SimpleNamespace, path: Path | str, **data) -> dict:
    return tiny(out, w, data={"path": str(path), "tasks": ["say"], "train_size": 0, **data})


def write(d: Path, cfg: dict | str, name: str = "c.yaml") -> str:
    path = d / name
    path.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg))
    return name


GRPO = {
    "data": {"tasks": ["i2t_mc"], "train_size": 4},
    "rollout": {"max_new_tokens": 3},
    "algorithm": {"name": "grpo", "group_size": 2},
    "reward": {"plugins": [{"name": "mc_exact"}]},
}


def grpo(out: Path, w: SimpleNamespace, **reward) -> dict:
    return tiny(out, w, **{**GRPO, "reward": {**GRPO["reward"], **reward}})


@dataclass(frozen=True)
class Case:
    """`make(d, out, w)` writes the case's inputs into scratch dir `d` and returns the
    arguments after `uniweave <command>` (default `train`); `out` is the run directory to
    name."""

    id: str
    culprit: tuple[str, ...]
    make: Callable[[Path, Path, SimpleNamespace], list[str]]
    code: int = 2
    existing: bool = False
    command: tuple[str, ...] = ("train",)


def cfg_case(id: str, culprit: tuple[str, ...], build: Callable, *over: str, **kw) -> Case:
    """A case whose input is one config file `c.yaml` (`build(out, w)`) and overrides."""
    return Case(id, culprit, lambda d, out, w: [write(d, build(out, w)), *over], **kw)


def _dir_config(d: Path, out: Path, w) -> list[str]:
    (d / "conf").mkdir()
    return ["conf"]


def _base_missing(d: Path, out: Path, w) -> list[str]:
    return [write(d, {"defaults": "base.yaml", **tiny(out, w)})]


def _output_is_file(d: Path, out: Path, w) -> list[str]:
    (d / "taken").write_text("not a directory\n")
    return [write(d, tiny(d / "taken", w))]


def _rows_case(bad: dict | str, **data) -> Callable:
    def make(d: Path, out: Path, w) -> list[str]:
        return [write(d, own(out, w, rows_file(d, bad), **data))]

    return make


def _empty_rows(d: Path, out: Path, w) -> list[str]:
    (d / "rows.jsonl").write_text("\n\n")
    return [write(d, own(out, w, d / "rows.jsonl"))]


def _csv_rows(d: Path, out: Path, w) -> list[str]:
    (d / "rows.csv").write_text("a,b\n")
    return [write(d, own(out, w, d / "rows.csv"))]


def _empty_shard_dir(d: Path, out: Path, w) -> list[str]:
    (d / "shards").mkdir()
    (d / "shards" / "notes.txt").write_text("no rows here\n")
    return [write(d, own(out, w, d / "shards"))]


def _bad_second_shard(d: Path, out: Path, w) -> list[str]:
    (d / "shards").mkdir()
    (d / "shards" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GOOD_ROWS))
    (d / "shards" / "b.jsonl").write_text(json.dumps(row("five")) + "\n" + '{"messages": 3}\n')
    return [write(d, own(out, w, d / "shards"))]


def _bad_val_file(d: Path, out: Path, w) -> list[str]:
    rows_file(d, row("five"))
    (d / "val.jsonl").write_text(json.dumps(row("six", split="train")) + "\n")
    return [write(d, own(out, w, d / "rows.jsonl", val_path=str(d / "val.jsonl")))]


def _image_case(kind: str) -> Callable:
    def make(d: Path, out: Path, w) -> list[str]:
        (d / "img").mkdir()
        if kind == "big":
            Image.fromarray(np.zeros((16, 16), dtype=np.uint8)).save(d / "img" / "x.png")
        elif kind == "garbage":
            (d / "img" / "x.png").write_text("not a png")
        return [write(d, own(out, w, rows_file(d, image_row("img/x.png"))))]

    return make


def _model_path(kind: str) -> Callable:
    def make(d: Path, out: Path, w) -> list[str]:
        model = d / "model"
        if kind == "truncated":
            shutil.copytree(w.saved, model)
            weights = model / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:-100])
        elif kind == "header":
            shutil.copytree(w.saved, model)
            weights = model / "model.safetensors"
            weights.write_bytes(struct.pack("<Q", 10**9) + b"{}")
        elif kind == "no_kind":
            model.mkdir()
            (model / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
        cfg = tiny(out, w, model={"path": str(model)})
        return [write(d, cfg)]

    return make


def _codec_truncated(d: Path, out: Path, w) -> list[str]:
    shutil.copytree(w.codec, d / "codec")
    weights = next((d / "codec").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:40])
    cfg = tiny(out, w)
    cfg["model"]["codec"]["path"] = str(d / "codec")
    return [write(d, cfg)]


def _corrupt_all_checkpoints(d: Path, out: Path, w) -> list[str]:
    for weights in (out / "checkpoints").glob("update-*/model.safetensors"):
        weights.write_bytes(weights.read_bytes()[:-8])
    return [write(d, tiny(out, w))]


def _overrides(*over: str) -> Callable:
    return lambda d, out, w: [write(d, tiny(out, w)), *over]


def _grpo_row_without_answer(d: Path, out: Path, w) -> list[str]:
    """GRPO on own rows scored by text_exact, whose third row has no `answer`."""
    lines = [json.dumps(row(word, answer=word)) for word in ("one", "two", "four")]
    lines.insert(2, json.dumps(row("three")))
    (d / "rows.jsonl").write_text("\n".join(lines) + "\n")
    cfg = own(out, w, d / "rows.jsonl")
    cfg.update(
        algorithm={"name": "grpo", "group_size": 2},
        reward={"plugins": [{"name": "text_exact"}]},
        rollout={"max_new_tokens": 3},
    )
    return [write(d, cfg)]


def _no_config(d: Path, out: Path, w) -> list[str]:
    return []


def _answered_rows(d: Path, bad: dict) -> Path:
    """Rows with answers (digits: words of the word tokenizer), `bad` as the third line."""
    lines = [json.dumps(row(word, answer=word)) for word in ("1", "2", "4")]
    lines.insert(2, json.dumps(bad))
    (d / "rows.jsonl").write_text("\n".join(lines) + "\n")
    return d / "rows.jsonl"


def _opd(out: Path, w: SimpleNamespace, teacher: Path, **sections) -> dict:
    """OPD toward `teacher` (the same tokenizer as the student's: the word one)."""
    return tiny(out, w, algorithm={"name": "opd", "teacher": {"path": str(teacher)}}, **sections)


def _teacher_with_another_codec(d: Path, out: Path, w) -> list[str]:
    """OPD toward the saved model with its codec swapped for one of the same size fitted
    on other images: the same code would mean another image."""
    teacher = d / "teacher"
    shutil.copytree(w.saved, teacher)
    shutil.rmtree(teacher / "codec")
    codec = build_codec("vq", codebook_size=16, n_init=1, max_iter=20)
    codec.fit(load_split("train").images[300:600], seed=1).save_pretrained(teacher / "codec")
    return [write(d, _opd(out, w, teacher))]


def _big_image_for_a_saved_model(d: Path, out: Path, w) -> list[str]:
    """A 16x16 image for the saved tiny model (model.path), whose codec reads 8x8."""
    (d / "img").mkdir()
    Image.fromarray(np.zeros((16, 16), dtype=np.uint8)).save(d / "img" / "x.png")
    cfg = own(out, w, rows_file(d, image_row("img/x.png")))
    loaded(cfg, str(w.saved))
    return [write(d, cfg)]


def _exact_text_rows(d: Path, out: Path, w) -> list[str]:
    """GRPO under length_semantics exact on rows whose answers are text."""
    cfg = own(out, w, _answered_rows(d, row("3", answer="3")))
    cfg.update(
        algorithm={"name": "grpo", "group_size": 2},
        reward={"plugins": [{"name": "text_exact"}]},
        rollout={"length_semantics": "exact", "max_new_tokens": 16},
    )
    return [write(d, cfg)]


def _image_beyond_max_grid(d: Path, out: Path, w) -> list[str]:
    """OPD on rows whose third asks for a 40x40 image (rollout.max_grid_side is 32)."""
    big = {"type": "generate_image", "height": 40, "width": 40}
    turns = [{"role": "user", "content": "draw"}, {"role": "assistant", "content": [big]}]
    cfg = own(out, w, _answered_rows(d, {"messages": turns, "task": "say"}), tokenizer="word")
    cfg["algorithm"] = {"name": "opd", "teacher": {"path": str(w.saved)}}
    return [write(d, cfg)]


def _privileged_row_without_answer(d: Path, out: Path, w) -> list[str]:
    cfg = own(out, w, _answered_rows(d, row("3")), tokenizer="word")
    cfg["algorithm"] = {"name": "opd", "teacher": {"path": str(w.saved), "privilege": "answer"}}
    return [write(d, cfg)]


def _opd_row_without_answer(d: Path, out: Path, w) -> list[str]:
    """OPD's prompts verified by text_exact (routing correct_only): the third row has no
    answer."""
    cfg = own(out, w, _answered_rows(d, row("3")), tokenizer="word")
    cfg["algorithm"] = {"name": "opd", "teacher": {"path": str(w.saved)}, "routing": "correct_only"}
    cfg["reward"] = {"plugins": [{"name": "text_exact"}]}
    return [write(d, cfg)]


# -- eval, generate, probe, data export: the same contract (issue 30) --------------------


def _scored(out: Path, w: SimpleNamespace, rows: Path, **data) -> dict:
    """A config `uniweave eval` / `probe` take: the saved tiny model, own rows with answers
    scored by text_exact, the word tokenizer."""
    cfg = own(out, w, rows, **data)
    loaded(cfg, str(w.saved))
    cfg["reward"] = {"plugins": [{"name": "text_exact"}]}
    return cfg


def _split_file(d: Path, name: str, bad: dict) -> Path:
    """`name` (e.g. test.jsonl): answered rows of no split field, `bad` as the third."""
    lines = [json.dumps(row(word, answer=word)) for word in ("1", "2", "4")]
    lines.insert(2, json.dumps(bad))
    (d / name).write_text("\n".join(lines) + "\n")
    return d / name


def _eval_test_file_missing_on_the_command_line(d: Path, out: Path, w) -> list[str]:
    cfg = _scored(out, w, _answered_rows(d, row("3", answer="3")))
    return [write(d, cfg), "evaluation.split=test", "data.test_path=gone.jsonl"]


def _eval_test_image_missing_on_the_command_line(d: Path, out: Path, w) -> list[str]:
    _split_file(d, "test.jsonl", {**image_row("img/x.png"), "answer": "7"})
    cfg = _scored(out, w, _answered_rows(d, row("3", answer="3")))
    return [write(d, cfg), "evaluation.split=test", "data.test_path=test.jsonl"]


def _test_row_without_answer(d: Path, out: Path, w) -> list[str]:
    """A test file named in the YAML whose third row has no answer for text_exact."""
    test = _split_file(d, "test.jsonl", row("3"))
    cfg = _scored(out, w, _answered_rows(d, row("3", answer="3")), test_path=str(test), test_size=4)
    cfg["evaluation"] = {"split": "test"}
    return [write(d, cfg)]


def _eval_tasks_on_the_command_line(d: Path, out: Path, w) -> list[str]:
    cfg = _scored(out, w, _answered_rows(d, row("3", answer="3")), val_path=None)
    return [write(d, cfg), "data.tasks=[nope]", "evaluation.split=train"]


def _probe_bad_val_row_on_the_command_line(d: Path, out: Path, w) -> list[str]:
    _split_file(d, "val.jsonl", {"task": "say"})
    cfg = _scored(out, w, _answered_rows(d, row("3", answer="3")))
    return [write(d, cfg), "data.val_path=val.jsonl"]


def _generate_args(d: Path, out: Path, w, *extra: str) -> list[str]:
    cfg = tiny(out, w, model={"path": str(w.saved)})
    return [write(d, cfg), "--prompt", "which digit?", "--n", "1", *extra]


def _generate_big_image(d: Path, out: Path, w) -> list[str]:
    Image.fromarray(np.zeros((16, 16), dtype=np.uint8)).save(d / "big.png")
    return _generate_args(d, out, w, "--image", "big.png")


def _generate_model_truncated(d: Path, out: Path, w) -> list[str]:
    args = _model_path("truncated")(d, out, w)
    return [*args, "--prompt", "draw the digit 7", "--n", "1"]


def _probe_model_truncated(d: Path, out: Path, w) -> list[str]:
    cfg = _scored(out, w, _answered_rows(d, row("3", answer="3")))
    shutil.copytree(w.saved, d / "model")
    weights = d / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    loaded(cfg, str(d / "model"))
    return [write(d, cfg)]


def _export_into(kind: str) -> Callable:
    def make(d: Path, out: Path, w) -> list[str]:
        target = d / "data"
        if kind == "file":
            target.write_text("not a directory\n")
        else:
            target.mkdir()
            (target / "notes.txt").write_text("mine\n")
        return ["--task", "t2i", "--split", "val", "--n", "2", "--out", "data"]

    return make


def _train_val_image_missing_on_the_command_line(d: Path, out: Path, w) -> list[str]:
    _split_file(d, "val.jsonl", {**image_row("img/x.png"), "answer": "7"})
    cfg = own(out, w, rows_file(d, row("five")), val_size=2)
    cfg["trainer"]["eval_every"] = 1
    cfg["reward"] = {"plugins": [{"name": "text_exact"}]}
    return [write(d, cfg), "data.val_path=val.jsonl"]


def _output_dir_not_a_run(d: Path, out: Path, w) -> list[str]:
    out.mkdir()
    (out / "thesis.tex").write_text("mine\n")
    return [write(d, tiny(out, w))]


CASES: list[Case] = [
    # -- the config file ---------------------------------------------------------------
    cfg_case("empty_file", ("c.yaml", "empty config file"), lambda out, w: ""),
    cfg_case("comment_only_file", ("c.yaml", "empty config file"), lambda out, w: "# hi\n"),
    cfg_case(
        "yaml_syntax", ("c.yaml:3:1", "YAML syntax error"), lambda out, w: "run:\n  - [1, 2\n"
    ),
    cfg_case("top_level_list", ("c.yaml", "top level must be a mapping"), lambda o, w: "- 1\n"),
    cfg_case("duplicate_key", ("c.yaml", "duplicate key 'run'"), lambda o, w: "run: {}\nrun: {}\n"),
    cfg_case(
        "unknown_key",
        ("c.yaml", "trainer.lerning_rate", "unknown key"),
        lambda out, w: tiny(out, w, trainer={"lerning_rate": 1e-3}),
    ),
    cfg_case(
        "wrong_type",
        ("c.yaml", "trainer.total_updates"),
        lambda out, w: tiny(out, w, trainer={"total_updates": "many"}),
    ),
    cfg_case(
        "negative_updates",
        ("c.yaml", "trainer.total_updates"),
        lambda out, w: tiny(out, w, trainer={"total_updates": -1}),
    ),
    cfg_case(
        "micro_batch_does_not_divide",
        ("c.yaml", "trainer.micro_batch_size", "does not divide"),
        lambda out, w: tiny(out, w, trainer={"micro_batch_size": 3}),
    ),
    cfg_case(
        "unknown_algorithm",
        ("c.yaml", "algorithm.name", "did you mean 'grpo'"),
        lambda out, w: tiny(out, w, algorithm={"name": "grpoo"}),
    ),
    cfg_case(
        "opd_without_teacher",
        ("c.yaml", "algorithm.teacher.path", "teacher checkpoint directory"),
        lambda out, w: tiny(out, w, algorithm={"name": "opd"}),
    ),
    cfg_case(
        "unknown_model_kind",
        ("c.yaml", "model.kind", "unknown model kind"),
        lambda out, w: tiny(out, w, model={"kind": "gpt9"}),
    ),
    cfg_case(
        "kind_needs_a_path",
        ("c.yaml", "model.path", "loads a local checkpoint"),
        lambda out, w: tiny(out, w, model={"kind": "janus_pro"}),
    ),
    cfg_case(
        "bad_device", ("c.yaml", "run.device"), lambda out, w: tiny(out, w, run={"device": "tpu"})
    ),
    Case("base_file_missing", ("c.yaml", "defaults", "base file not found"), _base_missing),
    Case("output_dir_is_a_file", ("c.yaml", "run.output_dir", "not a directory"), _output_is_file),
    # -- numbers that cannot reach the tensors ------------------------------------------
    cfg_case(
        "lr_overflows_float32",
        ("c.yaml", "trainer.optimizer.lr", "overflows float32"),
        lambda out, w: tiny(out, w, trainer={"optimizer": {"lr": 1e39}}),
    ),
    cfg_case(
        "lr_nan",
        ("c.yaml", "trainer.optimizer.lr"),
        lambda out, w: "trainer:\n  optimizer:\n    lr: .nan\n",
    ),
    cfg_case(
        "eps_infinite",
        ("c.yaml", "trainer.optimizer.eps"),
        lambda out, w: "trainer:\n  optimizer:\n    eps: .inf\n",
    ),
    cfg_case(
        "seed_overflows_int64",
        ("c.yaml", "run.seed", "overflows int64"),
        lambda out, w: tiny(out, w, run={"seed": 2**70}),
    ),
    cfg_case(
        "reward_weight_overflows",
        ("c.yaml", "reward.plugins.0.weight", "overflows float32"),
        lambda out, w: grpo(out, w, plugins=[{"name": "mc_exact", "weight": 1e300}]),
    ),
    # -- the command line ---------------------------------------------------------------
    Case("no_config_argument", ("the following arguments are required",), _no_config),
    Case("missing_config_file", ("nope.yaml", "file not found"), lambda d, o, w: ["nope.yaml"]),
    Case("config_is_a_directory", ("conf", "is a directory"), _dir_config),
    Case("unknown_flag", ("unrecognized arguments: --fast",), _overrides("--fast")),
    Case("override_without_equals", ("<command line>", "no '='"), _overrides("trainer.lr")),
    Case(
        "override_unknown_key",
        ("<command line>", "rollout.temprature", "did you mean 'rollout.temperature'"),
        _overrides("rollout.temprature=0.5"),
    ),
    Case(
        "override_wrong_type",
        ("<command line>", "trainer.total_updates"),
        _overrides("trainer.total_updates=abc"),
    ),
    Case(
        "override_lr_overflow",
        ("<command line>", "trainer.optimizer.lr", "overflows float32"),
        _overrides("trainer.optimizer.lr=1e39"),
    ),
    Case(
        "override_lr_nan",
        ("<command line>", "trainer.optimizer.lr"),
        _overrides("trainer.optimizer.lr=nan"),
    ),  # fmt: skip
    # -- dataset files and rows ---------------------------------------------------------
    Case(
        "dataset_missing",
        ("nope.jsonl", "dataset file not found", "data.path"),
        lambda d, out, w: [write(d, own(out, w, d / "nope.jsonl"))],
    ),
    Case("dataset_wrong_suffix", ("rows.csv", "unsupported dataset file"), _csv_rows),
    Case("dataset_empty", ("rows.jsonl", "empty dataset"), _empty_rows),
    Case("shard_dir_without_rows", ("shards", "holds no"), _empty_shard_dir),
    Case("bad_row_in_second_shard", ("b.jsonl:2", "messages"), _bad_second_shard),
    Case("row_not_json", ("rows.jsonl:3",), _rows_case("{not json")),
    Case("row_without_messages", ("rows.jsonl:3", "messages"), _rows_case({"task": "say"})),
    Case(
        "row_bad_role",
        ("rows.jsonl:3", "role", "robot"),
        _rows_case({"messages": [{"role": "robot", "content": "x"}], "task": "say"}),
    ),
    Case("row_unknown_field", ("rows.jsonl:3", "colour"), _rows_case(row("five", colour="red"))),
    Case(
        "row_duplicate_id",
        ("rows.jsonl:3", "duplicate id"),
        lambda d, out, w: [write(d, own(out, w, rows_file(d, row("x", id="rows-1"))))],
    ),
    Case(
        "row_without_task",
        ("rows.jsonl:3", "task", "default_task"),
        _rows_case({k: v for k, v in row("five").items() if k != "task"}),
    ),
    Case(
        "row_without_assistant_turn",
        ("rows.jsonl:3", "no assistant turn"),
        _rows_case({"messages": [{"role": "user", "content": "hi"}], "task": "say"}),
    ),
    Case(
        "no_rows_of_a_task",
        ("rows.jsonl", "no train rows of task 'draw'"),
        lambda d, out, w: [write(d, own(out, w, rows_file(d, row("5")), tasks=["say", "draw"]))],
    ),
    Case("val_file_with_a_train_row", ("val.jsonl:1", "split"), _bad_val_file),
    # -- images -------------------------------------------------------------------------
    Case("image_missing", ("rows.jsonl:3", "img/x.png", "not found"), _image_case("missing")),
    Case("image_unreadable", ("rows.jsonl:3", "cannot read image"), _image_case("garbage")),
    Case("image_wrong_size", ("rows.jsonl:3", "16"), _image_case("big")),
    # -- model and codec weights --------------------------------------------------------
    Case(
        "model_path_missing",
        ("model.path", "not found"),
        lambda d, out, w: [write(d, tiny(out, w, model={"path": str(d / "gone")}))],
    ),
    Case(
        "model_weights_truncated",
        ("model/model.safetensors", "truncated", "model.path"),
        _model_path("truncated"),
    ),
    Case(
        "model_header_too_long",
        ("model/model.safetensors", "truncated", "model.path"),
        _model_path("header"),
    ),
    Case(
        "model_dir_without_kind",
        ("model", "not a uniweave model directory"),
        _model_path("no_kind"),
    ),
    Case("codec_weights_truncated", ("codec", "safetensors", "model.codec.path"), _codec_truncated),
    # -- reward settings ----------------------------------------------------------------
    cfg_case(
        "misspelt_reward_plugin",
        ("c.yaml", "reward.plugins.0.name", "did you mean 'mc_exact'"),
        lambda out, w: grpo(out, w, plugins=[{"name": "mc_exakt"}]),
    ),
    cfg_case(
        "all_reward_weights_zero",
        ("c.yaml", "reward.plugins", "weight 0"),
        lambda out, w: grpo(out, w, plugins=[{"name": "mc_exact", "weight": 0}]),
    ),
    cfg_case(
        "unknown_plugin_option",
        ("c.yaml", "reward.plugins.0.kwargs.strict"),
        lambda out, w: grpo(out, w, plugins=[{"name": "mc_exact", "kwargs": {"strict": True}}]),
    ),
    cfg_case(
        "plugin_path_missing",
        ("gone: not found", "reward.plugins.0.path in c.yaml"),
        lambda out, w: grpo(out, w, plugins=[{"name": "digit_classifier", "path": "gone"}]),
    ),
    cfg_case(
        "grpo_without_plugins",
        ("c.yaml", "reward.plugins", "at least one"),
        lambda out, w: grpo(out, w, plugins=[]),
    ),
    Case("grpo_row_without_answer", ("rows.jsonl:3", "answer"), _grpo_row_without_answer),
    Case(
        "plugin_override_misspelt",
        ("<command line>", "reward.plugins.0.name"),
        lambda d, out, w: [write(d, grpo(out, w)), "reward.plugins.0.name=mc_exakt"],
    ),
    # -- what the model, its codec and the teacher say (issue 29) ------------------------
    cfg_case(
        "exact_length_off_the_codec_grid",
        ("c.yaml", "rollout.max_new_tokens", "codec's 4x4 grid", "must be 16, got 5"),
        lambda out, w: tiny(
            out,
            w,
            data={"tasks": ["t2i"]},
            rollout={"length_semantics": "exact", "max_new_tokens": 5},
            algorithm={"name": "grpo", "group_size": 2},
            reward={"plugins": [{"name": "digit_classifier"}]},
        ),
    ),
    cfg_case(
        "uniar_heads_off_the_mrope_sections",
        ("c.yaml", "model.tiny.num_heads", "divisible by 4", "24 / 4 = 6"),
        lambda out, w: tiny(
            out,
            w,
            model={
                "kind": "uniar",
                "visual_head": "bsq",
                "tiny": {"hidden_size": 24, "num_heads": 4, "num_layers": 1, "mixer_kernel": 0},
                "codec": {"path": None},
            },
        ),
    ),
    cfg_case(
        "uniar_with_a_mixer",
        ("model.tiny.mixer_kernel", "has no mixer"),
        lambda out, w: tiny(
            out, w, model={"kind": "uniar", "visual_head": "bsq", "codec": {"path": None}}
        ),
    ),
    Case(
        "teacher_with_another_codec",
        ("algorithm.teacher.path", "c.yaml", "image codec differs"),
        _teacher_with_another_codec,
    ),
    cfg_case(
        "prefix_sharing_with_the_conv_prior",
        ("c.yaml", "algorithm.share_prompt_prefix", "tiny model at", "does not support it"),
        lambda out, w: tiny(
            out,
            w,
            **{
                **GRPO,
                "model": {"path": str(w.saved)},
                "algorithm": {**GRPO["algorithm"], "share_prompt_prefix": True},
            },
        ),
    ),
    cfg_case(
        "codec_path_of_another_head",
        ("c.yaml", "model.codec.path", "holds a vq codec", "model.visual_head is bsq"),
        lambda out, w: tiny(out, w, model={"visual_head": "bsq"}),
    ),
    cfg_case(
        "model_path_of_another_head",
        ("c.yaml", "model.visual_head", "a vq head"),
        lambda out, w: tiny(out, w, model={"path": str(w.saved), "visual_head": "bsq"}),
    ),
    Case(
        "image_wrong_size_for_a_model_path",
        ("rows.jsonl:3", "16", "data.path in c.yaml"),
        _big_image_for_a_saved_model,
    ),
    Case(
        "exact_on_a_text_row",
        ("rows.jsonl:1", "not one image", "rollout.length_semantics in c.yaml"),
        _exact_text_rows,
    ),
    Case(
        "image_answer_beyond_max_grid_side",
        ("rows.jsonl:3", "40x40", "rollout.max_grid_side"),
        _image_beyond_max_grid,
    ),
    Case(
        "privileged_teacher_row_without_answer",
        ("rows.jsonl:3", "answer: missing", "algorithm.teacher.privilege in c.yaml"),
        _privileged_row_without_answer,
    ),
    Case(
        "opd_row_without_answer", ("rows.jsonl:3", "answer", "text_exact"), _opd_row_without_answer
    ),
    cfg_case(
        "ray_workers_beyond_num_cpus",
        ("ray.rollout_cpus", "ask for 2 CPUs", "has 1"),
        lambda out, w: tiny(
            out, w, **{**GRPO, "rollout": {**GRPO["rollout"], "workers": 2}, "ray": {"num_cpus": 1}}
        ),
    ),
    # -- eval, generate, probe, data export: the same contract (issue 30) ----------------
    Case(
        "eval_test_file_missing_on_the_command_line",
        ("gone.jsonl", "dataset file not found", "data.test_path in <command line>"),
        _eval_test_file_missing_on_the_command_line,
        command=("eval",),
    ),
    Case(
        "eval_test_image_missing_on_the_command_line",
        ("test.jsonl:3", "img/x.png", "not found", "data.test_path in <command line>"),
        _eval_test_image_missing_on_the_command_line,
        command=("eval",),
    ),
    Case(
        "eval_test_row_without_answer",
        ("test.jsonl:3", "answer: missing", "data.test_path in c.yaml"),
        _test_row_without_answer,
        command=("eval",),
    ),
    Case(
        "eval_task_list_on_the_command_line",
        ("no train rows of task 'nope'", "data.tasks in <command line>"),
        _eval_tasks_on_the_command_line,
        command=("eval",),
    ),
    Case(
        "eval_model_path_missing",
        ("gone", "not found", "model.path in <command line>"),
        lambda d, out, w: [
            write(d, tiny(out, w)),
            f"model.path={d / 'gone'}",
            "model.codec.path=null",  # the saved model ships its codec
        ],
        command=("eval",),
    ),
    Case(
        "train_task_list_on_the_command_line",
        # the error lists the labels the file has, with their row counts
        (
            "no train rows of task 'nope'",
            "train rows' tasks: say (5)",
            "data.tasks in <command line>",
        ),
        lambda d, out, w: [write(d, own(out, w, rows_file(d, row("five")))), "data.tasks=[nope]"],
    ),
    Case(
        "train_test_row_without_answer",
        ("test.jsonl:3", "answer: missing", "data.test_path in c.yaml"),
        _test_row_without_answer,
    ),
    Case(
        "train_val_image_missing_on_the_command_line",
        ("val.jsonl:3", "img/x.png", "data.val_path in <command line>"),
        _train_val_image_missing_on_the_command_line,
    ),
    Case(
        "output_dir_not_a_run",
        ("c.yaml", "run.output_dir", "not a uniweave run", "thesis.tex"),
        _output_dir_not_a_run,
    ),
    Case(
        "probe_bad_val_row_on_the_command_line",
        ("val.jsonl:3", "messages", "data.val_path in <command line>"),
        _probe_bad_val_row_on_the_command_line,
        command=("probe",),
    ),
    Case(
        "probe_model_truncated",
        ("model/model.safetensors", "truncated", "model.path in c.yaml"),
        _probe_model_truncated,
        command=("probe",),
    ),
    Case(
        "generate_image_missing",
        ("<command line>", "--image", "gone.png", "not found"),
        lambda d, out, w: _generate_args(d, out, w, "--image", "gone.png"),
        command=("generate",),
    ),
    Case(
        "generate_image_wrong_size",
        ("<command line>", "--image", "16x16", "data.image_resize"),
        _generate_big_image,
        command=("generate",),
    ),
    Case(
        "generate_answer_without_task",
        ("<command line>", "--answer", "--task"),
        lambda d, out, w: _generate_args(d, out, w, "--answer", "7"),
        command=("generate",),
    ),
    Case(
        "generate_model_truncated",
        ("model/model.safetensors", "truncated", "model.path in c.yaml"),
        _generate_model_truncated,
        command=("generate",),
    ),
    Case(
        "data_export_into_a_full_directory",
        ("<command line>", "--out", "not empty"),
        _export_into("full"),
        command=("data", "export"),
    ),
    Case(
        "data_export_onto_a_file",
        ("<command line>", "--out", "not a directory"),
        _export_into("file"),
        command=("data", "export"),
    ),
    # -- an existing run: refused resumes and bad inputs leave it as it was -------------
    Case(
        "resume_with_changed_lr",
        ("refusing to resume", "trainer.optimizer.lr", "checkpoints/update-000002"),
        lambda d, out, w: [write(d, tiny(out, w)), "trainer.optimizer.lr=0.5"],
        existing=True,
    ),
    Case(
        "resume_with_changed_model",
        ("refusing to resume", "model.tiny.hidden_size"),
        lambda d, out, w: [write(d, tiny(out, w)), "model.tiny.hidden_size=32"],
        existing=True,
    ),
    Case(
        "resume_with_more_updates_under_strict",
        (
            "refusing to resume",
            "trainer.total_updates",
            "resume_mode=strict",
            "resume_mode: allow_schedule_changes",
        ),
        lambda d, out, w: [write(d, tiny(out, w)), "trainer.total_updates=3"],
        existing=True,
    ),
    Case(
        "resume_with_a_bad_row",
        ("rows.jsonl:3", "messages"),
        lambda d, out, w: [write(d, own(out, w, rows_file(d, {"task": "say"})))],
        existing=True,
    ),
    Case(
        "resume_with_a_misspelt_plugin",
        ("c.yaml", "reward.plugins.0.name"),
        lambda d, out, w: [write(d, grpo(out, w, plugins=[{"name": "mc_exakt"}]))],
        existing=True,
    ),
    Case(
        "resume_with_overflowing_lr",
        ("<command line>", "trainer.optimizer.lr"),
        lambda d, out, w: [write(d, tiny(out, w)), "trainer.optimizer.lr=1e39"],
        existing=True,
    ),
    Case(
        "resume_with_a_truncated_model_path",
        ("model/model.safetensors", "truncated"),
        _model_path("truncated"),
        existing=True,
    ),
    Case(
        "resume_with_every_checkpoint_corrupt",
        ("no intact checkpoint", "checkpoints"),
        _corrupt_all_checkpoints,
        existing=True,
    ),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory, small_vq_dir) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("bad_inputs")
    w = SimpleNamespace(root=root, codec=small_vq_dir)
    w.saved = root / "saved"
    build_model(validate_config(tiny(root / "unused", w))).save_pretrained(w.saved)
    w.run = root / "run"
    (root / "run.yaml").write_text(yaml.safe_dump(tiny(w.run, w)))
    done = run_cli(["train", str(root / "run.yaml")])
    assert done.returncode == 0, done.stderr[-2000:]
    assert (w.run / "checkpoints" / "update-000002").is_dir()
    return w


def _run_case(case: Case, w: SimpleNamespace, cli: ForkedCLI) -> dict:
    d = w.root / "cases" / case.id
    d.mkdir(parents=True)
    out = d / "run" if case.existing else d / "out"
    if case.existing:
        shutil.copytree(w.run, out)
    args = case.make(d, out, w)
    before = snapshot(out) if case.existing else None
    inputs = snapshot(d)
    env = {**os.environ, "CI": "true", "OMP_NUM_THREADS": "1"}
    done = cli.run([*case.command, *args], cwd=d, env=env)
    return {
        "done": done,
        "out": out,
        "before": before,
        "after": snapshot(out) if out.exists() else None,
        "inputs": inputs,
        "now": snapshot(d),
    }


def _selected(request) -> list[Case]:
    """The cases whose `test_bad_input` items this session runs (all of them unless
    deselected, e.g. by `-k`): only those start a CLI process."""
    ids = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and "case" in params:
            ids.add(params["case"].id)
    return [c for c in CASES if c.id in ids]


@pytest.fixture(scope="module")
def results(world, request) -> dict[str, dict]:
    cli = ForkedCLI()
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {c.id: pool.submit(_run_case, c, world, cli) for c in _selected(request)}
        return {k: f.result() for k, f in futures.items()}


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, results):
    r = results[case.id]
    done = r["done"]
    assert "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    assert done.returncode == case.code, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("uniweave: error: "), done.stderr
    for fragment in case.culprit:
        assert fragment in lines[0], (fragment, lines[0])
    if case.existing:
        assert r["after"] == r["before"], lines[0]
    else:  # nothing written: no run directory (unless the case made it), no other file
        assert "out" in r["inputs"] or not r["out"].exists(), lines[0]
        assert r["now"] == r["inputs"], lines[0]


def test_every_proposed_fix_is_accepted_or_changes_the_message(results, world):
    """Every refusal of the matrix that proposes a change (`set KEY=VALUE`, `pass --FLAG`:
    tests/suggestions.py), rerun from fresh inputs with that change appended to its
    command: exit 0, or another error (the next problem, never the same one)."""
    cases = {c.id: c for c in CASES}
    cli = ForkedCLI()
    walked = []
    for case_id, r in sorted(results.items()):
        line = r["done"].stderr.strip()
        for change in proposals(line):
            case = cases[case_id]
            d = world.root / "fixes" / f"{case_id}-{len(walked)}"
            d.mkdir(parents=True)
            out = d / "run" if case.existing else d / "out"
            if case.existing:
                shutil.copytree(world.run, out)
            args = case.make(d, out, world)
            env = {**os.environ, "CI": "true", "OMP_NUM_THREADS": "1"}
            again = cli.run([*case.command, *args, *change], cwd=d, env=env)
            after = again.stderr.strip().splitlines()
            assert again.returncode == 0 or after[-1:] != [line], (case_id, change, line)
            walked.append((case_id, change, again.returncode))
    if len(results) == len(CASES):  # the whole matrix ran: these cases propose a fix
        proposing = {"resume_with_more_updates_under_strict", "image_wrong_size"}
        assert {c for c, _, _ in walked} >= proposing, walked
    # the fixes this matrix proposes are whole: each one is accepted
    assert all(code == 0 for _, _, code in walked), walked


def test_a_valid_rerun_of_a_copied_run_is_accepted(world, tmp_path):
    """The existing-run cases are refused for their mistake, not for being a copy: the
    same config at the copy's path resumes (run.output_dir may change) and finishes."""
    out = tmp_path / "copy"
    shutil.copytree(world.run, out)
    cfg = copy.deepcopy(tiny(out, world))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    done = run_cli(["train", str(tmp_path / "c.yaml")])
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "DONE").read_text()) == {"updates": 2}
