"""The wheel of this checkout installed in a fresh virtual environment, outside the
checkout: what `tests/conftest.py`'s session fixture `installed_uniweave` builds once for
the tests that run uniweave as a user does (tests/test_readme_commands.py,
tests/test_own_data_path.py).

The wheel is built from this checkout (`python -m build --no-isolation --wheel`) into
`<work>/dist`, and the README's install block (`<!-- ci: install -->`) installs it from
`<work>`. The fresh environment gets the dependencies, not uniweave, from this test's own
environment: a folder of links to its site-packages entries minus uniweave's own, named by
a `.pth` file (a `.pth` line only extends `sys.path`; the `.pth` files inside it, the
development install's among them, are not run). `pip install` then finds every dependency
satisfied and installs the wheel alone, offline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@dataclass(frozen=True)
class Installed:
    """work: the folder the install block ran in (it holds only `dist/`); env: the
    environment whose `uniweave` is the installed wheel; install_output: what the install
    block printed."""

    work: Path
    env: dict[str, str]
    install_output: str

    def run(self, lines: list[str], cwd: Path) -> str:
        """`lines` as one bash script (`set -euo pipefail`) in `cwd` with this install;
        stdout and stderr together; AssertionError with the tail on a non-zero exit."""
        return run_script(lines, cwd, self.env)


def marked_block(text: str, marker: str) -> list[str]:
    """The lines of the fenced block right after `<!-- ci: marker -->`."""
    m = re.search(rf"<!-- ci: {marker} -->\n```[a-z]*\n(.*?)\n```", text, re.S)
    assert m, f"README.md has no fenced block after <!-- ci: {marker} -->"
    return m.group(1).splitlines()


def fresh_venv(tmp: Path) -> Path:
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


def run_script(lines: list[str], cwd: Path, env: dict[str, str]) -> str:
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


def install_wheel(tmp: Path) -> Installed:
    """Build the wheel into `tmp/work/dist`, make `tmp/venv` and run the README's install
    block in `tmp/work` (module docstring)."""
    work = tmp / "work"  # an empty folder outside the checkout: no recipes, no data
    (work / "dist").mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(work / "dist"), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    venv = fresh_venv(tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{env['PATH']}")
    out = run_script(marked_block(README.read_text(), "install"), work, env)
    return Installed(work, env, out)
