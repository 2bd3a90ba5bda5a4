"""Run status: one channel for the console and the run directory's `train.log`.

`status(line)` prints a status line (progress, "training N updates into ...", resume
points, evaluations, health alarms) to stdout — stderr with `err=True` — and hands it
to the logger `uniweave.status` at INFO. `open_run_log(path)` is what a training
process (rank 0) holds open while it runs: every status line and every message of a `uniweave.*`
logger at INFO or above (the data loader's conversion counts, left-out rows, warnings)
is appended to `path`, one timestamped line each, so a run that was started in a
terminal that is gone still says what it did. The console is unchanged by it: status
lines are printed as before and warnings still reach stderr as plain messages (when the
application has configured no logging of its own, a stderr handler at WARNING stands in
for Python's last-resort one). In a terminal the progress bar replaces the per-update
lines on screen; the log gets them at every `logging.every` update either way.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

STATUS = logging.getLogger("uniweave.status")
"""The logger status lines go to (INFO); `run_log` writes it to the run's train.log."""

RUN_LOG = "train.log"


def status(line: str, err: bool = False) -> None:
    """Print `line` (stdout, or stderr with `err`) and log it (module docstring)."""
    print(line, file=sys.stderr if err else sys.stdout, flush=True)
    STATUS.info("%s", line)


def log_only(line: str) -> None:
    """Put `line` in the run log without printing it (a line the console shows another
    way, e.g. under the progress bar)."""
    STATUS.info("%s", line)


def open_run_log(path: Path) -> Callable[[], None]:
    """Append status lines and `uniweave.*` log messages (INFO and above) to `path` until
    the returned function is called (module docstring)."""
    package = logging.getLogger("uniweave")
    to_file = logging.FileHandler(path, mode="a", encoding="utf-8")
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    console = None
    if not logging.getLogger().handlers and not package.handlers:
        # the last-resort handler stops applying once `package` has a handler: keep
        # warnings on stderr exactly as it printed them
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter("%(message)s"))
        package.addHandler(console)
    package.addHandler(to_file)
    level = package.level
    package.setLevel(logging.INFO)

    def close() -> None:
        package.setLevel(level)
        package.removeHandler(to_file)
        to_file.close()
        if console is not None:
            package.removeHandler(console)

    return close
