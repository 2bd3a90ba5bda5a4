"""The config reference (issue 30 item 2): `uniweave config describe [KEY]` prints each
field's dotted key, type, default and description from the schema, and docs/config.md is
generated from the same function (this test fails when it is stale)."""

from __future__ import annotations

from pathlib import Path

from uniweave import cli
from uniweave.config import UniweaveConfig
from uniweave.config.introspect import dotted_keys
from uniweave.config.reference import field_docs, markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
REGENERATE = "python -m uniweave config describe --markdown > docs/config.md"


def test_docs_config_md_is_up_to_date():
    assert DOC.read_text() == markdown(), f"docs/config.md is stale: run `{REGENERATE}`"


def test_every_schema_key_is_described():
    plain = {
        d.key.replace("[sft]", "").replace("[grpo]", "").replace("[opd]", "") for d in field_docs()
    }
    listed = {k for k in plain if ".<i>." not in k}
    assert set(dotted_keys(UniweaveConfig)) <= listed
    assert all(d.type and d.default and d.description for d in field_docs())


def test_describe_one_key_prints_type_default_and_description(capsys):
    assert cli.main(["config", "describe", "trainer.optimizer.lr"]) == 0
    out = capsys.readouterr().out
    assert (
        out
        == "trainer.optimizer.lr\n  type: float (> 0.0)\n  default: 0.0001\n  Peak learning rate.\n"
    )


def test_describe_a_section_and_an_algorithm_variant(capsys):
    assert cli.main(["config", "describe", "algorithm.kl"]) == 0
    out = capsys.readouterr().out
    assert "algorithm[grpo].kl.type\n  type: one of 'none', 'k1', 'k2', 'k3', 'jsd'\n" in out
    assert "algorithm[grpo].kl.coef\n" in out
    assert cli.main(["config", "describe", "algorithm[opd].beta"]) == 0
    assert capsys.readouterr().out.startswith("algorithm[opd].beta\n  type: float (>= 0.0, <= 1.0)")
    assert cli.main(["config", "describe", "reward.plugins.<i>.name", "--markdown"]) == 0
    assert "| `reward.plugins.<i>.name` | str |" in capsys.readouterr().out


def test_describe_an_unknown_key_exits_2_with_one_line(capsys):
    assert cli.main(["config", "describe", "trainer.optimizer.learning_rate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainer.optimizer.learning_rate: no such config key" in err
    assert cli.main(["config", "describe", "trainer.learning_rate"]) == 2
    assert "did you mean 'trainer.optimizer.lr'?" in capsys.readouterr().err  # across sections


def test_describe_stays_light():
    import json
    import subprocess
    import sys

    code = (
        "import json, sys\nimport uniweave.cli\n"
        "assert uniweave.cli.main(['config', 'describe', 'run.seed']) == 0\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stdout.rstrip("\n").rsplit("\n", 1)[-1])
    assert not [m for m in modules if m.split(".")[0] in ("torch", "numpy", "transformers")]
