"""The README's commands, run as written.

- The command lists (between `<!-- commands -->` and `<!-- /commands -->` in README.md,
  docs/cli.md and docs/architecture.md) name exactly the CLI's commands.
- The wheel: built from this checkout, installed by the README's install block
  (`<!-- ci: install -->`) into a fresh virtual environment outside the checkout, then
  `uniweave recipes` and the README's quickstart block (`<!-- ci: quickstart -->`) run in
  an empty temporary folder, and what they print contains the README's output block
  (`<!-- ci: output -->`, in order; `...` in a line matches anything).

The wheel and its environment are the session fixture `installed_uniweave`
(tests/installed.py), shared with tests/test_own_data_path.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from installed import marked_block

from uniweave.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMAND_DOCS = (README, ROOT / "docs" / "cli.md", ROOT / "docs" / "architecture.md")


def test_command_lists_equal_the_cli():
    names = {c.name for c in COMMANDS}
    for doc in COMMAND_DOCS:
        text = doc.read_text()
        m = re.search(r"<!-- commands -->\n(.*?)<!-- /commands -->", text, re.S)
        assert m, f"{doc.relative_to(ROOT)} has no <!-- commands --> list"
        listed = set(re.findall(r"\buniweave ([a-z][a-z-]*)", m.group(1)))
        assert listed == names, (doc.relative_to(ROOT), sorted(listed ^ names))


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
def test_the_wheel_installs_outside_the_checkout_and_runs_the_quickstart(installed_uniweave):
    text = README.read_text()
    quickstart, expected = marked_block(text, "quickstart"), marked_block(text, "output")
    work, run = installed_uniweave.work, installed_uniweave.run
    assert re.search(r"^uniweave \d+\.\d+\.\d+", installed_uniweave.install_output, re.M)

    where = run(["python -c 'import uniweave; print(uniweave.__file__)'"], work)
    venv = installed_uniweave.env["VIRTUAL_ENV"]
    assert where.strip().startswith(venv), where  # the wheel, not the checkout

    listing = run(["uniweave recipes"], work)
    assert "examples/own_data_tiny" in listing and "digits/sft_vq" in listing
    assert venv in listing  # the recipes the wheel installed

    out = run(quickstart, work)
    _contains_in_order(out, expected)
    assert (work / "runs" / "own_data" / "model").is_dir()
    assert sorted(p.name for p in work.iterdir()) == ["dist", "runs"]
