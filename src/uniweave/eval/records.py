"""Per-sample evaluation records, committed one at a time so a killed run resumes.

`results.jsonl` holds one JSON object per line, keyed by (id, member). A record is
committed by one `write` of its whole line followed by `fsync`; images it names are
written (to a temporary name, fsynced, renamed) before it. On open, a trailing line
without its newline (a write cut short by a kill) is cut off, so the file is always
whole records; `done` is the set of keys already there, which a re-run skips, so a
killed and re-run evaluation ends with every (id, member) exactly once.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from uniweave.core.atomic import atomic_write

RESULTS = "results.jsonl"
IMAGES = "images"


def file_stem(text: str) -> str:
    """`text` with every character outside [A-Za-z0-9_.-] replaced by "_"."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def printable(text: str) -> str:
    """`text` as the run report and the evaluation pages show it: control characters (but
    newline and tab) as `\\xNN` / `\\uNNNN` escapes. Bytes a byte-level tokenizer cannot
    decode already read as U+FFFD (it decodes with replacement) and stay so; a sampled
    control byte would otherwise print as nothing or garble the line."""
    return "".join(
        c if c in "\n\t" or unicodedata.category(c) != "Cc" else ascii(c)[1:-1] for c in text
    )


def write_png(path: Path, pixels: np.ndarray) -> None:
    """float [H, W] or [H, W, 3] in [0, 1] -> 8-bit PNG, atomically (tmp + fsync + rename)."""
    levels = np.round(np.clip(np.asarray(pixels, dtype=np.float32), 0.0, 1.0) * 255.0)
    with atomic_write(path, "wb") as f:
        Image.fromarray(levels.astype(np.uint8)).save(f, format="PNG")


class ResultLog:
    """The append-only record file of one evaluation directory (module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        (directory / IMAGES).mkdir(parents=True, exist_ok=True)
        self.path = directory / RESULTS
        self.records = self._recover()
        self.done = {(r["id"], r["member"]) for r in self.records}

    def _recover(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(len(whole))
                os.fsync(f.fileno())
        return [json.loads(line) for line in whole.decode("utf-8").splitlines() if line]

    def image_path(self, sample_id: str, member: int, k: int, kind: str = "out") -> str:
        """Relative path of image k of a record (`kind` "out" generated, "in" prompt)."""
        return f"{IMAGES}/{file_stem(sample_id)}-{member}-{kind}{k}.png"

    def commit(self, record: dict[str, Any], images: dict[str, np.ndarray]) -> None:
        """Write `images` (relative path -> pixels), then append `record` atomically."""
        for rel, pixels in images.items():
            write_png(self.directory / rel, pixels)
        line = (json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.records.append(record)
        self.done.add((record["id"], record["member"]))
