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
`log_once` logs a summary (conversion counts, left-out rows of a split) once per run.
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


_SAID: dict[tuple[str, int, str], logging.LogRecord] = {}
"""What `log_once` logged in this run: (logger, level, message) -> its record."""


def log_once(logger: logging.Logger, level: int, message: str) -> None:
    """Log `message` unless the same logger said it at the same level in this run (since
    the process began or the last run log closed): a run reads its rows for preflight,
    training, the baseline and every evaluation, and a summary of them said again at each
    read is noise. What was said before the run log opened (preflight) goes into it when
    it opens."""
    key = (logger.name, level, message)
    if key not in _SAID:
        _SAID[key] = logger.makeRecord(logger.name, level, "", 0, "%s", (message,), None)
        if logger.isEnabledFor(level):
            logger.handle(_SAID[key])


def open_run_log(path: Path) -> Callable[[], None]:
    """Append status lines and `uniweave.*` log messages (INFO and above) to `path` until
    the returned function is called (module docstring)."""
    package = logging.getLogger("uniweave")
    to_file = logging.FileHandler(path, mode="a", encoding="utf-8")
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    for record in _SAID.values():  # said once before the log opened (preflight's reads)
        if record.name.startswith("uniweave.") and record.levelno >= logging.INFO:
            to_file.handle(record)
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
        _SAID.clear()  # the run is over: the next one says its summaries again
        package.setLevel(level)
        package.removeHandler(to_file)
        to_file.close()
        if console is not None:
            package.removeHandler(console)

    return close
