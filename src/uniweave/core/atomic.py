"""Whole-or-nothing writes of files and directories: the one implementation.

A file `DIR/NAME` is written to the temporary ``DIR/.NAME.tmp``, flushed and fsynced,
renamed over `NAME` (`os.replace`, atomic on POSIX) and the directory fsynced, so a
reader sees the old content or the new, never a torn file (`atomic_write`,
`write_bytes_atomic`, `write_text_atomic`, `write_json_atomic`).

A directory `PARENT/NAME` is filled under a staging name ``PARENT/.NAME.tmp-new`` (or a
fresh ``.NAME.tmp-XXXXXXXX`` with `unique=True`, for writers that may race), every file
and directory under it is fsynced, an old `NAME` is renamed to ``.NAME.old.tmp`` and the
staging directory renamed into place, the parent fsynced, and the old one removed
(`write_dir_atomic`).

Permissions: what lands in place gets the permissions a plain `open` / `mkdir` would
under the process umask (files 0666 & ~umask, 0777 & ~umask when executable; directories
0777 & ~umask: 0644 / 0755 under umask 022), whatever the writer used (safetensors writes
0600, `tempfile.mkdtemp` 0700), so a teammate on shared storage can read a run
(`apply_umask`).

A Python exception while writing removes the temporary; a kill leaves it, and every
temporary name starts with a dot and holds ``.tmp`` (`is_temporary`), so whoever owns the
directory can find and remove them (`uniweave.train.state.checkpoint.tidy_run_dir`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TMP_MARK = ".tmp"
"""In the name of every temporary: ``.NAME.tmp`` files and ``.NAME.tmp-*`` /
``.NAME.old.tmp`` directories (a leading dot and ``.tmp`` in the name)."""


def is_temporary(path: Path) -> bool:
    """Whether `path` is named like the temporary of an atomic write."""
    return path.name.startswith(".") and TMP_MARK in path.name


def temporary_path(path: Path) -> Path:
    """``.NAME.tmp`` beside `path`: where `atomic_write` writes before the rename."""
    return path.with_name(f".{path.name}{TMP_MARK}")


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Fsync every file under `path`, then every directory, deepest first, `path` last."""
    for sub in sorted(path.rglob("*")):
        if sub.is_file():
            fsync_file(sub)
    for sub in sorted([p for p in path.rglob("*") if p.is_dir()] + [path], reverse=True):
        fsync_dir(sub)


def current_umask() -> int:
    """The process umask (read from /proc where it can be, without changing it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | Path) -> None:
    """Give `path` and everything under it (links are left alone) the permissions the
    process umask gives a new file or directory: directories 0777 & ~umask, files
    0666 & ~umask (0777 & ~umask when the owner may execute them)."""
    path = Path(path)
    mask = current_umask()
    for sub in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if sub.is_symlink():
            continue
        mode = sub.stat().st_mode
        full = 0o777 if sub.is_dir() or mode & 0o100 else 0o666
        os.chmod(sub, full & ~mask)


def remove(path: Path) -> None:
    """Delete a file, a link or a directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


@contextmanager
def atomic_write(path: str | Path, mode: str = "w", encoding: str | None = None) -> Iterator[IO]:
    """Open ``.NAME.tmp`` beside `path` in `mode` ("w" or "wb"; text is UTF-8 unless
    `encoding` says otherwise); on a clean exit flush, fsync, rename it to `path` and
    fsync the directory; on an exception remove it."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes whole files: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    tmp = temporary_path(path)
    if mode == "w" and encoding is None:
        encoding = "utf-8"
    try:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def write_text_atomic(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    with atomic_write(path, "w", encoding=encoding) as f:
        f.write(text)


def write_json_atomic(path: str | Path, data: Any, **dumps: Any) -> None:
    """`json.dumps(data, **dumps)` and a newline, atomically."""
    write_text_atomic(path, json.dumps(data, **dumps) + "\n")


def write_dir_atomic(
    parent: str | Path, name: str, write: Callable[[Path], object], unique: bool = False
) -> Path:
    """Write directory `parent/name` whole or not at all (module docstring): `write(tmp)`
    fills the empty staging directory, which is then fsynced and renamed into place; an
    old `name` is renamed ``.NAME.old.tmp`` first and removed after. The staging name is
    ``.NAME.tmp-new`` (a stale one, and a stale ``.NAME.old.tmp``, is removed first), or
    with `unique` a fresh ``.NAME.tmp-*`` (and ``.NAME.old.tmp-*``), so writers that may
    race never remove each other's. Returns `parent/name`."""
    parent = Path(parent)
    final = parent / name
    old: Path | None = None
    if unique:
        staging = Path(tempfile.mkdtemp(prefix=f".{name}{TMP_MARK}-", dir=parent))
    else:
        staging, old = parent / f".{name}{TMP_MARK}-new", parent / f".{name}.old{TMP_MARK}"
        for path in (staging, old):
            if path.exists():
                remove(path)
        staging.mkdir()
    try:
        write(staging)
        apply_umask(staging)
        fsync_tree(staging)
        if final.exists():
            if unique:
                old = Path(tempfile.mkdtemp(prefix=f".{name}.old{TMP_MARK}-", dir=parent))
            assert old is not None, "the old name is set in both branches above"
            os.replace(final, old)
        os.replace(staging, final)
    except BaseException:
        if staging.exists():
            remove(staging)
        raise
    fsync_dir(parent)
    if old is not None and old.exists():
        remove(old)
    return final
