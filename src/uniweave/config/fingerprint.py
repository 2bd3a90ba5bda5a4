"""Fingerprints of the files a run reads: what a checkpoint records and a resume checks.

A file's fingerprint is ``{"size", "sha256"}`` and, for a safetensors file, also
``"header_sha256"`` (the SHA-256 of its 8-byte length and JSON header, read on every call:
cheap, and it changes with any tensor's name, dtype, shape or offsets). The content hash
is the expensive part: it is computed once per file version and kept in a cache file,
keyed by the resolved path and valid while the file's size, mtime (ns) and inode are
unchanged (a file replaced by another — a new inode — or rewritten in place — a new
mtime — is hashed again). The cache lives in ``$UNIWEAVE_CACHE_DIR/fingerprints.json``
(default ``$XDG_CACHE_HOME/uniweave``, else ``~/.cache/uniweave``); losing it costs only time.
A cache that cannot be written is reported once (a warning), never an error: the
fingerprints themselves are always computed from the files.

A directory's fingerprint maps every file under it (relative POSIX name, sorted) to the
file's fingerprint; `digest` reduces such a map to one SHA-256 (names and content hashes,
not paths: a copied directory has the same digest); `path_identity` pairs it with the
resolved path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

CACHE_FILE = "fingerprints.json"
HEADER_BYTES = 8
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def cache_path() -> Path:
    """Where content hashes are cached (module docstring)."""
    root = os.environ.get("UNIWEAVE_CACHE_DIR")
    if root:
        return Path(root) / CACHE_FILE
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "uniweave" / CACHE_FILE


def file_sha256(path: Path) -> str:
    """SHA-256 hex digest of a file's bytes, read in 1 MiB blocks (the one file hash:
    fingerprints, checkpoint manifests, rollout inventories)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _header_sha256(path: Path, size: int) -> str | None:
    """SHA-256 of a safetensors file's length prefix and JSON header (None when the file
    is too short to hold the header it declares; the preflight names such files)."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            return None
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or HEADER_BYTES + n > size:
            return None
        return hashlib.sha256(head + f.read(n)).hexdigest()


class _Cache:
    """The content-hash cache of one `fingerprint` call (read once, written once)."""

    def __init__(self) -> None:
        self.path = cache_path()
        try:
            self.entries: dict[str, Any] = json.loads(self.path.read_text())
            if not isinstance(self.entries, dict):
                self.entries = {}
        except (OSError, ValueError):
            self.entries = {}
        self.dirty = False

    def sha256(self, path: Path, stat: os.stat_result) -> str:
        key = str(path.resolve())
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
        entry = self.entries.get(key)
        if isinstance(entry, dict) and entry.get("stamp") == stamp and "sha256" in entry:
            return str(entry["sha256"])
        value = file_sha256(path)
        self.entries[key] = {"stamp": stamp, "sha256": value}
        self.dirty = True
        return value

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # a per-process temporary: runs (and ranks) sharing the cache never collide
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            if str(self.path) not in _warned:
                _warned.add(str(self.path))
                logger.warning("fingerprint cache %s not written (%s)", self.path, exc)


def _file(path: Path, cache: _Cache) -> dict[str, Any]:
    stat = path.stat()
    out: dict[str, Any] = {"size": stat.st_size, "sha256": cache.sha256(path, stat)}
    if path.suffix == ".safetensors":
        out["header_sha256"] = _header_sha256(path, stat.st_size)
    return out


def fingerprint(path: str | Path) -> dict[str, dict[str, Any]]:
    """{relative name: file fingerprint} of every file under directory `path`, or
    {name: fingerprint} of a single file (module docstring). FileNotFoundError when
    `path` does not exist."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root}: not found")
    cache = _Cache()
    try:
        if root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file())
            return {p.relative_to(root).as_posix(): _file(p, cache) for p in files}
        return {root.name: _file(root, cache)}
    finally:
        cache.save()


def digest(files: dict[str, dict[str, Any]]) -> str:
    """One SHA-256 over a `fingerprint` map's names and content hashes."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name]["sha256"].encode() + b"\n")
    return h.hexdigest()


def path_identity(path: str | Path) -> dict[str, str]:
    """{"path": the resolved path, "digest": `digest(fingerprint(path))`}: what a file or
    directory is, by content (a copy has the same digest), from the cached content hashes
    (the one file identity: OPD's teacher in every checkpoint, `trained_on.json`'s data
    files). FileNotFoundError when `path` does not exist."""
    return {"path": str(Path(path).resolve()), "digest": digest(fingerprint(path))}


def changed_files(
    saved: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]]
) -> list[tuple[str, str]]:
    """(name, what) for each file that differs between two `fingerprint` maps: missing,
    added, or changed (size, header, content), in name order."""
    out = []
    for name in sorted(set(saved) | set(current)):
        if name not in current:
            out.append((name, "missing"))
        elif name not in saved:
            out.append((name, "added"))
        else:
            a, b = saved[name], current[name]
            for field in ("size", "header_sha256", "sha256"):
                if a.get(field) != b.get(field):
                    what = {"size": "size", "header_sha256": "safetensors header"}.get(
                        field, "content"
                    )
                    out.append((name, f"{what} changed"))
                    break
    return out
