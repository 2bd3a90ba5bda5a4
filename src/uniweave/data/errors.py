"""`DatasetError`: a dataset file or row that cannot be used, and the config key that named it.

Its `str()` is the one-line "FILE[:LINE]: FIELD: what was expected, got what"; `key` is
the dotted config key that pointed at the file (`data.path`, `data.val_path`,
`data.test_path`, or `data.tasks` for a task with no rows), set where it is known
(`uniweave.data.rows.split_rows`) so the command line can name the file or `<command line>`
that set that key. This module imports nothing, so the CLI can catch it cheaply.
"""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset file or row is malformed; the message names the file, line and field,
    `key` the config key that named the file (None when not known)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def keyed(self, key: str) -> DatasetError:
        """This error, its `key` set to `key` unless one is already known."""
        if self.key is None:
            self.key = key
        return self
