"""A trained model records what it was trained on; `uniweave eval` warns when asked about
other tasks or other rows (uniweave.config.trained_on)."""

from __future__ import annotations

import json
import subprocess
import sys

from eval_fixtures import make_dataset, write_config

from uniweave.config import load_config
from uniweave.config.fingerprint import digest, fingerprint
from uniweave.config.trained_on import TRAINED_ON, mismatch_warnings
from uniweave.train.run import run_train

TRAIN = [
    "algorithm.name=sft",
    "trainer.total_updates=2",
    "trainer.global_batch_size=2",
    "trainer.micro_batch_size=2",
    "trainer.scheduler.warmup_steps=0",
    "data.val_size=0",
    "data.test_size=0",
    "checkpoint.every_updates=2",
]


def _relabel(path, task):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "task": task}) + "\n" for r in rows))


def test_eval_warns_on_tasks_and_rows_the_model_was_not_trained_on(tmp_path):
    data = make_dataset(tmp_path / "data", 6)
    config = write_config(tmp_path, data)
    run = run_train(load_config(config, TRAIN))
    record = json.loads((run / "model" / TRAINED_ON).read_text())
    assert record["tasks"] == ["colour_qa"] and record["algorithm"] == "sft"
    assert record["config_hash"] == (run / "config_hash").read_text().strip()
    assert record["data"]["data.path"] == {
        "path": str(data.resolve()),
        "digest": digest(fingerprint(data)),
    }

    model = f"model.path={run / 'model'}"
    # the same tasks and rows: nothing to say
    assert mismatch_warnings(load_config(config, [model])) == []
    # another dataset, with another task label: two warnings, through the command
    other = make_dataset(tmp_path / "other", 4)
    _relabel(other, "shade_qa")
    args = [
        model,
        f"data.path={other}",
        "data.tasks=[shade_qa]",
        "reward.plugins.0.tasks=[shade_qa]",
        f"evaluation.output_dir={tmp_path / 'eval'}",
        "evaluation.split=train",
    ]
    cmd = [sys.executable, "-m", "uniweave", "eval", str(config), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (
        "was trained on tasks ['colour_qa']; this evaluation asks for ['shade_qa']" in done.stderr
    )
    assert f"data.path {other}: these rows differ from the rows" in done.stderr
    # the training file itself, changed since: the rows warning says so
    with data.open("a") as f:
        f.write(data.read_text().splitlines()[0].replace('"sq0"', '"sq99"') + "\n")
    (warning,) = mismatch_warnings(load_config(config, [model]))
    assert f"data.path {data}: these rows changed since the rows" in warning


def test_a_model_without_a_record_is_not_checked(tmp_path):
    data = make_dataset(tmp_path / "data", 2)
    (tmp_path / "m").mkdir()
    cfg = load_config(write_config(tmp_path, data), [f"model.path={tmp_path / 'm'}"])
    assert mismatch_warnings(cfg) == []
    (tmp_path / "m" / TRAINED_ON).write_text("[1, 2]\n")
    (line,) = mismatch_warnings(cfg)
    assert "not a trained_on record" in line and "not checked" in line


def test_config_yaml_and_inspect_record_the_loaded_model_s_sizes(tmp_path, capsys, caplog):
    """With model.path, the run's config.yaml, `inspect` and `inspect --sources` show the
    sizes the model directory records, not the config's model.tiny that it does not have
    (a config without model.tiny: the defaults, 4 layers of width 128; the model has 1 of
    width 32). A size given explicitly that the model does not have does not act: exit 2
    naming the key and where it was given."""
    from uniweave import cli

    data = make_dataset(tmp_path / "data", 4)
    config = write_config(tmp_path, data)
    first = run_train(load_config(config, TRAIN))
    saved = json.loads((first / "model" / "uniweave_model.json").read_text())["config"]
    assert (saved["hidden_size"], saved["num_layers"]) == (32, 1)
    loaded = tmp_path / "loaded.yaml"  # the same config without its model.tiny sizes
    text = config.read_text()
    loaded.write_text("".join(x for x in text.splitlines(True) if not x.startswith("model:")))
    capsys.readouterr()
    given = [*TRAIN, f"model.path={first / 'model'}", "model.tiny.hidden_size=48"]
    assert cli.main(["inspect", str(config), *given]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "uniweave: error: <command line>: model.tiny.hidden_size: acts only for a model "
        f"built from the config (model.path null); model.path {first / 'model'} is loaded "
        "with its own sizes (hidden_size 32)"
    ]
    assert cli.main(["inspect", str(config), *given[:-1], "model.tiny.hidden_size=32"]) == 0
    config = loaded
    other = [*TRAIN, f"model.path={first / 'model'}", f"run.output_dir={tmp_path / 'second'}"]
    capsys.readouterr()
    with caplog.at_level("WARNING", logger="uniweave.models.registry"):
        assert cli.main(["inspect", str(config), *other, "--sources"]) == 0
    out = capsys.readouterr().out
    record = f"{first / 'model'}/uniweave_model.json"
    for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
        line = next(x for x in out.splitlines() if x.startswith(f"model.tiny.{key}: "))
        assert line.split("#")[0].split(": ")[1].strip() == str(saved[key]), line
        assert line.rstrip().endswith(f"# {record}"), line
    assert "model.tiny.hidden_size 128 -> 32, model.tiny.num_layers 4 -> 1" in caplog.text
    hashed = out.splitlines()[-1]
    assert cli.main(["inspect", str(config), *other]) == 0
    plain = capsys.readouterr().out
    assert "    hidden_size: 32\n    num_layers: 1\n" in plain
    assert plain.splitlines()[-1] == hashed  # --sources and plain agree on the config

    assert cli.main(["train", str(config), *other]) == 0
    written = (tmp_path / "second" / "config.yaml").read_text()
    assert "    hidden_size: 32\n    num_layers: 1\n" in written
    assert f"hash: {(tmp_path / 'second' / 'config_hash').read_text().strip()}" == hashed
