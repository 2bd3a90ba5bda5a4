"""The `uniweave` command line, mostly through real subprocesses of the installed entry point."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from uniweave import cli
from uniweave.config import config_hash, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "recipes" / "examples"
SCRIPT = Path(sys.executable).with_name("uniweave")
ENTRY = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "uniweave"]


def run_cli(args: list[str], cwd: Path, entry: list[str] = ENTRY) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*entry, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


# (name, files {relative path: text}, argv after "inspect", fragments the message must contain)
# Each run also gets `run.output_dir=<tmp>/out/run`, which must not exist afterwards.
BAD_CONFIGS = [
    (
        "unknown_top_level",
        {"c.yaml": "runn: {name: x}\n"},
        ["c.yaml"],
        ["c.yaml: runn: unknown key", "did you mean 'run'?"],
    ),
    (
        "unknown_section_key",
        {"c.yaml": "trainer: {total_update: 5}\n"},
        ["c.yaml"],
        ["c.yaml: trainer.total_update: unknown key", "did you mean 'trainer.total_updates'?"],
    ),
    (
        "unknown_nested_key",
        {"c.yaml": "algorithm:\n  name: grpo\n  kl: {type: k3, kind: k2}\n"},
        ["c.yaml"],
        ["c.yaml: algorithm.kl.kind: unknown key", "expected a key of algorithm.kl: type, coef"],
    ),
    (
        "wrong_type",
        {"c.yaml": "trainer: {total_updates: lots}\n"},
        ["c.yaml"],
        ["c.yaml: trainer.total_updates: invalid value 'lots'", "expected int (> 0)"],
    ),
    (
        "bad_enum",
        {"c.yaml": "trainer: {precision: fp16}\n"},
        ["c.yaml"],
        ["c.yaml: trainer.precision: invalid value 'fp16'", "expected one of 'fp32', 'bf16'"],
    ),
    (
        "typo_suggestion",
        {"c.yaml": "trainer:\n  optimizer:\n    lerning_rate: 1.0e-4\n"},
        ["c.yaml"],
        [
            "c.yaml: trainer.optimizer.lerning_rate: unknown key",
            "did you mean 'trainer.optimizer.lr'?",
        ],
    ),
    (
        "bad_override_syntax",
        {"c.yaml": ""},
        ["c.yaml", "trainer.optimizer.lr"],
        [
            "<command line>: bad override 'trainer.optimizer.lr': no '='",
            "expected dotted.key=value",
        ],
    ),
    (
        "override_unknown_key",
        {"c.yaml": "run: {}\n"},
        ["c.yaml", "rollout.temprature=0.5"],
        ["<command line>: rollout.temprature: unknown key", "did you mean 'rollout.temperature'?"],
    ),
    ("missing_file", {}, ["nope.yaml"], ["nope.yaml: file not found"]),
    (
        "yaml_syntax_error",
        {"c.yaml": "run:\n  name: x\n  seed: [1, 2\n"},
        ["c.yaml"],
        ["c.yaml:4:1: YAML syntax error"],
    ),
    (
        "incompatible_rollout_logp_with_ppo_epochs",
        {
            "c.yaml": "algorithm: {name: grpo, old_logp_source: rollout, updates_per_batch: 2}\n"
            "reward: {plugins: [{name: mc_exact}]}\n"
        },
        ["c.yaml"],
        ["c.yaml: algorithm.old_logp_source: 'rollout' requires updates_per_batch=1 (got 2)"],
    ),
    (
        "opd_failure_replay_without_a_verifier_routing",
        {
            "c.yaml": "algorithm: {name: opd, teacher: {path: /teacher}, "
            "gt_replay: {mode: failure, budget: 2}}\n"
        },
        ["c.yaml"],
        ["c.yaml: algorithm.gt_replay.mode: 'failure' needs a verifier routing"],
    ),
    (
        "information_gain_without_directions",
        {
            "c.yaml": "algorithm: {name: sft, information_gain: {weight: 1, "
            "text_to_visual_weight: 0, visual_to_text_weight: 0}}\n"
        },
        ["c.yaml"],
        ["c.yaml: algorithm.information_gain.weight: weight=1.0 has no effect"],
    ),
    (
        "negative_batch_size",
        {"c.yaml": "trainer: {global_batch_size: -8}\n"},
        ["c.yaml"],
        ["c.yaml: trainer.global_batch_size: invalid value -8", "greater than 0"],
    ),
    (
        "inheritance_loop",
        {"a.yaml": "defaults: b.yaml\n", "b.yaml": "defaults: [a.yaml]\n"},
        ["a.yaml"],
        ["b.yaml: defaults: inheritance loop: a.yaml -> b.yaml -> a.yaml"],
    ),
    (
        "bad_algorithm_name",
        {"c.yaml": "algorithm: {name: ppo}\n"},
        ["c.yaml"],
        ["c.yaml: algorithm.name: unknown name 'ppo'", "expected one of 'sft', 'grpo', 'opd'"],
    ),
    (
        "error_in_base_file_names_the_base",
        {"base.yaml": "trainer: {micro_batch_size: 0}\n", "c.yaml": "defaults: base.yaml\n"},
        ["c.yaml"],
        ["base.yaml: trainer.micro_batch_size: invalid value 0"],
    ),
]


@pytest.mark.parametrize(
    ("files", "argv", "fragments"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_config_exits_2_with_one_line_and_creates_nothing(tmp_path, files, argv, fragments):
    out = tmp_path / "out" / "run"
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    before = sorted(tmp_path.rglob("*"))
    proc = run_cli(["inspect", *argv, f"run.output_dir={out}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("uniweave: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not (tmp_path / "runs").exists()
    assert sorted(tmp_path.rglob("*")) == before


def test_debug_shows_the_traceback(tmp_path):
    proc = run_cli(["--debug", "inspect", "nope.yaml"], cwd=tmp_path)
    assert proc.returncode == 2
    assert (
        "Traceback" in proc.stderr
        and "nope.yaml: file not found (nor a packaged recipe" in proc.stderr
    )
    assert cli.main(["inspect", "nope.yaml", "--debug"]) == 2  # also after the subcommand


def test_inspect_prints_yaml_and_a_hash_stable_across_processes(tmp_path):
    config = str(EXAMPLES / "grpo_tiny.yaml")
    first = run_cli(["inspect", config, "run.name=123"], cwd=tmp_path)
    second = run_cli(
        ["inspect", config, "run.name=123"],
        cwd=tmp_path,
        entry=[sys.executable, "-m", "uniweave.cli"],
    )
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout
    body, last = first.stdout.rstrip("\n").rsplit("\n", 1)
    expected = config_hash(load_config(config, ["run.name=123"]))
    assert last == f"hash: {expected}"
    assert "name: '123'" in body and "name: grpo" in body
    changed = run_cli(["inspect", config, "run.name=124"], cwd=tmp_path)
    assert changed.stdout.rsplit("\n", 2)[-2] != last
    assert list(tmp_path.iterdir()) == []  # inspect creates nothing


# Run in a fresh process: `--help` and `inspect` of a digits recipe, then list what they
# imported. Checking a config reads the model kinds' `kind.json` (no model package) and
# the parser's `data export` options come from the config layer (no numpy, PIL, torch).
LIGHT_IMPORTS = """
import json, sys
import uniweave.cli
assert uniweave.cli.main(["--help"]) == 0
assert uniweave.cli.main(["inspect", "recipes/digits/sft_vq.yaml"]) == 0
print(json.dumps(sorted(sys.modules)))
"""
HEAVY = ("torch", "transformers", "numpy", "PIL", "tokenizers", "safetensors", "peft", "sklearn")


def test_help_and_inspect_import_no_model_and_no_torch():
    proc = subprocess.run(
        [sys.executable, "-c", LIGHT_IMPORTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "\nhash: " in proc.stdout
    modules = json.loads(proc.stdout.rstrip("\n").rsplit("\n", 1)[-1])
    models = [m for m in modules if m.startswith("uniweave.models.")]
    assert models == ["uniweave.models.registry"], models
    assert [m for m in modules if m.split(".")[0] in HEAVY] == []
    # the method registry's specs (uniweave.config.methods) are the one part of train a
    # config check loads: the packages and each method's spec module, nothing else
    specs = {"uniweave.train", "uniweave.train.methods"}
    specs |= {
        f"uniweave.train.methods.{m}{s}" for m in ("sft", "grpo", "opd") for s in ("", ".spec")
    }
    assert not [
        m
        for m in modules
        if m.startswith(("uniweave.core", "uniweave.train", "uniweave.codecs")) and m not in specs
    ]


@pytest.mark.parametrize("argv", [[], ["inspect"], ["train"], ["generate"], ["eval"]])
def test_help_for_every_subcommand(argv, capsys):
    assert cli.main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: uniweave {' '.join(argv)}".rstrip())
    if argv:
        assert "CONFIG" in out and "KEY=VALUE" in out and "--debug" in out


def test_help_via_subprocess(tmp_path):
    proc = run_cli(["train", "--help"], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: uniweave train")


def test_eval_checks_the_config_first(tmp_path, capsys):
    out = tmp_path / "run"
    config = str(EXAMPLES / "sft_tiny.yaml")
    assert cli.main(["eval", config, f"run.output_dir={out}", "trainer.lr=1"]) == 2
    assert "trainer.lr: unknown key" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [[], ["frobnicate"], ["inspect"], ["inspect", "c.yaml", "--nope"], ["--nope", "eval", "c"]],
)
def test_usage_errors_exit_2_with_one_line(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("uniweave: error: ") and err.count("\n") == 1


def test_a_new_subcommand_plugs_into_the_dispatch_table(capsys):
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--times", type=int, default=1)

    def boom(args: argparse.Namespace) -> int:
        raise RuntimeError(f"exploded {args.times} time(s)\nsecond line")

    commands = [*cli.COMMANDS, cli.Command("boom", "fail on purpose", configure, boom)]
    assert cli.main(["boom", "--times", "2"], commands=commands) == 1
    err = capsys.readouterr().err
    assert err == "uniweave: error: RuntimeError: exploded 2 time(s) second line\n"
    assert cli.main(["--debug", "boom"], commands=commands) == 1
    assert "Traceback" in capsys.readouterr().err
    assert cli.main(["boom"]) == 2  # not in the default table


@pytest.mark.parametrize(
    "argv", [["eval"], ["generate", "--prompt", "draw the digit 7", "--out", "OUT"]]
)
def test_generate_and_eval_refuse_random_weights_without_random_init(tmp_path, argv, capsys):
    """Without model.path, `eval` and `generate` would use freshly initialised weights:
    refused (exit 2, one line naming model.path and --random-init) before anything is
    built or written, unless --random-init asks for them."""
    out = tmp_path / "out"
    config = str(EXAMPLES / "sft_tiny.yaml")
    command, *rest = [str(out) if a == "OUT" else a for a in argv]
    assert cli.main([command, config, *rest, f"run.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"uniweave: error: {config}: model.path: not set"
    )
    assert "--random-init" in err and not out.exists()


def test_overrides_may_follow_an_option():
    parser = cli.build_parser()
    args = cli._parse(parser, ["eval", "c.yaml", "a=1", "--random-init", "b=2"])
    assert args.random_init and args.overrides == ["a=1", "b=2"]


def test_inspect_sources_names_who_set_each_value(tmp_path, capsys):
    """`inspect --sources`: one `key: value  # source` line per value, the source being
    the file that set it (a base file's key, the child's own), `<command line>` for an
    override, or `default`; the hash is the plain inspect's."""
    (tmp_path / "base.yaml").write_text("trainer: {optimizer: {lr: 0.01}, total_updates: 7}\n")
    (tmp_path / "own.yaml").write_text(
        "defaults: base.yaml\ntrainer: {total_updates: 9}\nreward: {plugins: [{name: mc_exact}]}\n"
    )
    own = str(tmp_path / "own.yaml")
    assert cli.main(["inspect", "--sources", own, "run.seed=3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    got = {k: (v, src) for k, v, src in (re_line(line) for line in lines[:-1])}
    assert got["trainer.optimizer.lr"] == ("0.01", str(tmp_path / "base.yaml"))
    assert got["trainer.total_updates"] == ("9", own)
    assert got["run.seed"] == ("3", "<command line>")
    assert got["trainer.grad_clip"][1] == "default"
    assert got["reward.plugins"][1] == own and "mc_exact" in got["reward.plugins"][0]
    assert lines[-1] == f"hash: {config_hash(load_config(own, ['run.seed=3']))}"


def re_line(line: str) -> tuple[str, str, str]:
    body, source = line.rsplit("  # ", 1)
    key, value = body.rstrip().split(": ", 1)
    return key, value, source


def test_a_run_refuses_a_directory_that_is_not_a_run(tmp_path):
    """`run.output_dir` may be new, empty, a uniweave run, or hold only what uniweave writes
    there before a run (eval-<split>/, classifier/, generations/, codec/, tokenizer/,
    evals/, temporaries); anything else is refused naming the key and what it holds."""
    from uniweave.config import ConfigError
    from uniweave.train.preflight import check_run_dir

    out = tmp_path / "out"
    check_run_dir(out)
    out.mkdir()
    for name in ("eval-test", "classifier", "generations", "codec", "tokenizer", "evals"):
        (out / name).mkdir()
        check_run_dir(out)
    (out / ".config.yaml.tmp").write_text("half")
    check_run_dir(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as info:
        check_run_dir(out)
    assert info.value.key == "run.output_dir" and "notes.txt" in str(info.value)
    (out / "config.yaml").write_text("run: {}\n")  # a uniweave run (its record) is resumed
    check_run_dir(out)


def test_config_yaml_records_absolute_paths_beside_the_given_ones(tmp_path, monkeypatch):
    """The comment lines resolve each relative path from the working directory; the
    record loads back to the same config (comments are ignored)."""
    from uniweave.train.run import absolute_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(
        "run: {output_dir: runs/x}\ndata: {path: d/rows.jsonl, test_path: /abs/t.jsonl}\n"
        "algorithm: {name: sft}\nreward: {plugins: [{name: text_exact}]}\n"
    )
    cfg = load_config(tmp_path / "c.yaml")
    text = absolute_paths(cfg)
    assert f"#   run.output_dir: runs/x -> {tmp_path / 'runs' / 'x'}\n" in text
    assert f"#   data.path: d/rows.jsonl -> {tmp_path / 'd' / 'rows.jsonl'}\n" in text
    assert "/abs/t.jsonl" not in text  # already absolute
    assert all(line.startswith("#") for line in text.splitlines())
    record = tmp_path / "config.yaml"
    from uniweave.config import to_yaml

    record.write_text(to_yaml(cfg) + text)
    assert config_hash(load_config(record)) == config_hash(cfg)


CLOSED_PIPE = """
import os, sys
from uniweave import cli
read_end, write_end = os.pipe()
os.close(read_end)  # no reader left: every write to the pipe fails with EPIPE
os.dup2(write_end, 1)
sys.stdout = os.fdopen(1, "w")
code = cli.main(["config", "describe"])
print("exit", code, file=sys.stderr)
sys.exit(code)
"""


def test_a_closed_pipe_ends_the_command_quietly():
    """`uniweave config describe | head -1` once the reader has gone: the command ends as
    a SIGPIPE'd process would (141), with no traceback and no error line. The child's
    stdout is a pipe whose read end is already closed, so the failure does not depend on
    how much a reader took before leaving."""
    proc = subprocess.run(
        [sys.executable, "-c", CLOSED_PIPE], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == "exit 141\n"


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory, small_vq_dir) -> Path:
    """A tiny model (width 16, one layer, the session's 16-code VQ codec), saved: a
    model.path."""
    from uniweave.config import validate_config
    from uniweave.models.build import build_model

    sizes = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32}
    codec = {"path": str(small_vq_dir), "codebook_size": 16}
    path = tmp_path_factory.mktemp("saved_tiny") / "model"
    build_model(validate_config({"model": {"tiny": sizes, "codec": codec}})).save_pretrained(path)
    return path


def test_a_missing_model_path_is_named_before_its_codec_path(tmp_path, capsys):
    """With no model directory at model.path, a model.codec.path next to it is not compared
    with one: the error names model.path (the loader's), nothing is written."""
    config = tmp_path / "c.yaml"
    out = tmp_path / "run"
    config.write_text(f"run: {{output_dir: {out}}}\n")
    missing = tmp_path / "no_model"
    capsys.readouterr()
    argv = ["train", str(config), f"model.path={missing}", "model.codec.path=/nonexistent"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"uniweave: error: {missing}: not found (model.path in <command line>)"
    ]
    assert not out.exists()


@pytest.fixture(scope="module")
def saved_uniar(tmp_path_factory) -> Path:
    """A tiny UniAR (the test sizes, a random 16-bit BSQ codec), saved: a model.path."""
    from model_fixtures import UNIAR_SIZES, random_bsq_codec

    from uniweave.models.uniar.tiny import build_tiny_uniar

    path = tmp_path_factory.mktemp("saved_uniar") / "model"
    build_tiny_uniar(random_bsq_codec(16, 2, 1), UNIAR_SIZES, seed=0).save_pretrained(path)
    return path


def test_a_uniar_model_path_checks_model_tiny_against_its_qwen_config(
    tmp_path, capsys, saved_uniar
):
    """With a UniAR model.path, `model.tiny` is what the directory's Qwen3-VL config.json
    records: a recipe's sizes equal to it (and mixer_kernel 0, Qwen3-VL has no mixer) are
    accepted and the config records the loaded sizes; a size it does not have exits 2
    naming the key (it would be ignored)."""
    from model_fixtures import UNIAR_SIZES

    config = tmp_path / "c.yaml"
    config.write_text(
        f"run: {{output_dir: {tmp_path / 'run'}}}\nmodel: {{kind: uniar, visual_head: bsq}}\n"
    )
    base = ["inspect", str(config), f"model.path={saved_uniar}"]
    capsys.readouterr()
    assert cli.main([*base, "model.tiny.mixer_kernel=0"]) == 0
    shown = capsys.readouterr().out
    for name, value in (("hidden_size", UNIAR_SIZES.hidden_size), ("num_layers", 2)):
        assert f"model.tiny.{name} = {value}" in shown or f"{name}: {value}" in shown
    wrong = 96  # neither the model's width nor the default (a default is filled, not refused)
    assert cli.main([*base, f"model.tiny.hidden_size={wrong}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "uniweave: error: <command line>: model.tiny.hidden_size: acts only for a model built "
        f"from the config (model.path null); model.path {saved_uniar} is loaded with its own "
        f"sizes (hidden_size {UNIAR_SIZES.hidden_size})"
    ]


@pytest.mark.parametrize(
    ("override", "key", "what"),
    [
        ("model.tiny.hidden_size=256", "model.tiny.hidden_size", "its own sizes (hidden_size 16)"),
        (
            "model.codec.path=/nonexistent",
            "model.codec.path",
            "its own image codec ({saved}/codec, not /nonexistent)",
        ),
    ],
)
def test_train_refuses_a_model_setting_that_model_path_ignores(
    tmp_path, capsys, saved_tiny, small_vq_dir, override, key, what
):
    """A model.path checkpoint is loaded as saved: a `model.tiny` size it does not have and
    `model.codec.path` do not act, and `uniweave train` refuses them (exit 2, one line
    naming the key) before it writes anything; the same model.path alone, with a setting
    back at its default, or with the size the model has, is accepted."""
    config = tmp_path / "c.yaml"
    out = tmp_path / "run"
    config.write_text(f"run: {{output_dir: {out}}}\n")
    capsys.readouterr()
    assert cli.main(["train", str(config), f"model.path={saved_tiny}", override]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"uniweave: error: <command line>: {key}: acts only for a model built from the config "
        f"(model.path null); model.path {saved_tiny} is loaded with "
        + what.format(saved=saved_tiny)
    ]
    assert not out.exists()
    for fine in (
        "model.tiny.hidden_size=128",
        "model.tiny.hidden_size=16",
        "model.codec.path=null",
        f"model.codec.path={small_vq_dir}",  # the codec the model was built with: the same bytes
    ):
        assert cli.main(["inspect", str(config), f"model.path={saved_tiny}", fine]) == 0
