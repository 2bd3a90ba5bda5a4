"""The README's commands, run as written.

- The command lists (between `<!-- commands -->` and `<!-- /commands -->` in README.md,
  docs/cli.md and docs/architecture.md) name exactly the CLI's commands.
- The wheel: built from this checkout, installed by the README's install block
  (`<!-- ci: install -->`) into a fresh virtual environment outside the checkout, then
  `uniweave recipes` and the README's quickstart block (`<!-- ci: quickstart -->`) run in
  an empty temporary folder, and what they print contains the README's output block
  (`<!-- ci: output -->`, in order; `...` in a line matches anything).

The fresh environment gets the dependencies, not uniweave, from this test's own
environment: a folder of links to its site-packages entries minus uniweave's own, named
by a `.pth` file (a `.pth` line only extends `sys.path`; the `.pth` files inside it, the
development install's among them, are not run). `pip install` then finds every
dependency satisfied and installs the wheel alone, offline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from uniweave.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMAND_DOCS = (README, ROOT / "docs" / "cli.md", ROOT / "docs" / "architecture.md")


def marked_block(text: str, marker: str) -> list[str]:
    """The lines of the fenced block right after `<!-- ci: marker -->`."""
    m = re.search(rf"<!-- ci: {marker} -->\n```[a-z]*\n(.*?)\n```", text, re.S)
    assert m, f"README.md has no fenced block after <!-- ci: {marker} -->"
    return m.group(1).splitlines()


def test_command_lists_equal_the_cli():
    names = {c.name for c in COMMANDS}
    for doc in COMMAND_DOCS:
        text = doc.read_text()
        m = re.search(r"<!-- commands -->\n(.*?)<!-- /commands -->", text, re.S)
        assert m, f"{doc.relative_to(ROOT)} has no <!-- commands --> list"
        listed = set(re.findall(r"\buniweave ([a-z][a-z-]*)", m.group(1)))
        assert listed == names, (doc.relative_to(ROOT), sorted(listed ^ names))


def _fresh_venv(tmp: Path) -> Path:
    """A virtual environment that sees this one's dependencies but not uniweave."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    deps = tmp / "deps"
    deps.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        if entry.name.startswith(("uniweave", "__editable__")) or entry.suffix == ".pth":
            continue
        (deps / entry.name).symlink_to(entry)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "_uniweave_test_deps.pth").write_text(f"{deps}\n")
    return venv


def _run(lines: list[str], cwd: Path, env: dict[str, str]) -> str:
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=cwd,
        env={**env, "PYTHONUNBUFFERED": "1"},  # stdout and stderr in the order printed
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{script}\n{out[-4000:]}"
    return out


def _contains_in_order(out: str, expected: list[str]) -> None:
    lines = out.splitlines()
    at = 0
    for want in expected:
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")))
        while at < len(lines) and not pattern.search(lines[at]):
            at += 1
        assert at < len(lines), f"README output line not printed (in order): {want!r}\n{out}"
        at += 1


@pytest.mark.slow
def test_the_wheel_installs_outside_the_checkout_and_runs_the_quickstart(tmp_path):
    text = README.read_text()
    install, quickstart = marked_block(text, "install"), marked_block(text, "quickstart")
    expected = marked_block(text, "output")

    work = tmp_path / "work"  # an empty folder outside the checkout: no recipes, no data
    (work / "dist").mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(work / "dist"), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    venv = _fresh_venv(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{env['PATH']}")
    out = _run(install, work, env)
    assert re.search(r"^uniweave \d+\.\d+\.\d+", out, re.M), out

    where = _run(["python -c 'import uniweave; print(uniweave.__file__)'"], work, env)
    assert where.strip().startswith(str(venv)), where  # the wheel, not the checkout

    listing = _run(["uniweave recipes"], work, env)
    assert "examples/own_data_tiny" in listing and "digits/sft_vq" in listing
    assert str(venv) in listing  # the recipes the wheel installed

    out = _run(quickstart, work, env)
    _contains_in_order(out, expected)
    assert (work / "runs" / "own_data" / "model").is_dir()
    assert sorted(p.name for p in work.iterdir()) == ["dist", "runs"]
