"""`uniweave inspect RUN_DIR`: every entry of a run directory explained
(uniweave.train.layout), and docs/architecture.md naming each of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from eval_fixtures import make_dataset, write_config

from uniweave.config import load_config
from uniweave.train.layout import RUN_ENTRIES, describe_run_dir
from uniweave.train.run import run_train

DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_inspect_explains_every_entry_of_a_run_directory(tmp_path):
    data = make_dataset(tmp_path / "data", 6)
    overrides = [
        "algorithm.name=sft",
        "trainer.total_updates=2",
        "trainer.global_batch_size=2",
        "trainer.micro_batch_size=2",
        "trainer.scheduler.warmup_steps=0",
        "data.val_size=0",
        "data.test_size=2",
        "checkpoint.every_updates=2",
    ]
    run = run_train(load_config(write_config(tmp_path, data), overrides))
    (run / "notes.txt").write_text("mine\n")  # a user's file
    (run / ".model.tmp-new").mkdir()  # what a kill during the export leaves
    cmd = [sys.executable, "-m", "uniweave", "inspect", str(run)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines()}
    present = sorted(p.name + ("/" if p.is_dir() else "") for p in run.iterdir())
    assert sorted(lines) == present
    for name, line in lines.items():
        if name == "notes.txt":
            assert "not written by uniweave" in line
        elif name == ".model.tmp-new/":
            assert "interrupted atomic write" in line
        else:  # every entry the run wrote has its own description
            assert RUN_ENTRIES[name.rstrip("/")] in line, name
    assert {"model/", "checkpoints/", "train.log", "DONE", "report.md"} <= lines.keys()
    n = len(list((run / "checkpoints").iterdir()))
    assert (run / "checkpoints" / "update-000002").is_dir()
    assert f"[{n} entries]" in lines["checkpoints/"]
    assert [n for n, _ in describe_run_dir(run)] == present

    # `inspect RUN | head -1`: a reader that leaves before the command writes (the read
    # end of its stdout pipe closed at once; it imports for seconds first) ends it quietly,
    # as SIGPIPE would (141), with no traceback and no error line
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.close()
    assert child.wait(timeout=300) == 141
    assert child.stderr.read() == ""


def test_the_docs_name_every_run_directory_entry():
    text = DOCS.read_text()
    missing = [name for name in RUN_ENTRIES if f"`{name}" not in text]
    assert not missing, f"docs/architecture.md §5 does not name {missing}"
