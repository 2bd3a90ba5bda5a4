"""What a run keeps besides its checkpoints: saved rollouts and the best checkpoint.

Rollouts (`checkpoint.save_rollouts`, GRPO/OPD): after update N (1-based, as checkpoint
names count) rank 0 writes ``rollouts/update-NNNNNN.pt`` — the batch's trajectories in
`save_trajectories` format (`load_trajectories(path, [RolloutTrajectory])` reads them back)
— and ``rollouts/update-NNNNNN.json``: the per-row record the batch source gives (rewards,
advantages, routing, replay selection; `BatchSource.rollout_record`) with the ``.pt``'s
size and SHA-256. A checkpoint at update u links the rollout files of updates 1..u
(`state.json` ``rollouts``: their names and the SHA-256 of their inventory, one line
``name size sha256`` per file, sorted). A resume from u deletes the files of later updates
and refuses to go on when the files of updates ≤ u no longer match that inventory.

Best checkpoint (`checkpoint.keep_best`): ``checkpoints/best.json`` names the checkpoint
whose evaluation scored best so far (metric, mode, value, update, checkpoint); pruning
never removes it (`uniweave.train.state.checkpoint.prune` reads it), and every later
checkpoint's `state.json` carries the same record, so a resume restores it even if the
process died between committing a checkpoint and writing ``best.json``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from uniweave.config.fingerprint import file_sha256 as file_sha256  # re-exported
from uniweave.core.atomic import write_text_atomic
from uniweave.core.trajectory import Trajectory, save_trajectories

ROLLOUTS = "rollouts"
BEST = "best.json"
_ROLLOUT_FILE = re.compile(r"^update-(\d{6,})\.(pt|json)$")


# -- rollouts ---------------------------------------------------------------------------


def write_rollout(
    run_dir: Path, update: int, trajectories: Sequence[Trajectory], record: dict[str, Any]
) -> dict[str, tuple[int, str]]:
    """Write update `update`'s rollout files (module docstring) atomically; return their
    inventory entries {name: (size, sha256)}."""
    root = Path(run_dir) / ROLLOUTS
    root.mkdir(parents=True, exist_ok=True)
    stem = f"update-{update:06d}"
    pt = root / f"{stem}.pt"
    save_trajectories(pt, trajectories)
    entries = {pt.name: (pt.stat().st_size, file_sha256(pt))}
    meta = {
        "update": update,
        "trajectories": {
            "file": pt.name,
            "n": len(trajectories),
            "size": entries[pt.name][0],
            "sha256": entries[pt.name][1],
        },  # fmt: skip
        **record,
    }
    js = root / f"{stem}.json"
    write_text_atomic(js, json.dumps(meta, indent=1, sort_keys=True) + "\n")
    entries[js.name] = (js.stat().st_size, file_sha256(js))
    return entries


def _rollout_files(run_dir: Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / ROLLOUTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _ROLLOUT_FILE.match(path.name)
        if m and path.is_file():
            found.append((int(m.group(1)), path))
    return sorted(found, key=lambda x: x[1].name)


def rollout_inventory(run_dir: Path, last_update: int) -> dict[str, tuple[int, str]]:
    """{name: (size, sha256)} of the rollout files of updates ≤ `last_update` on disk."""
    return {
        p.name: (p.stat().st_size, file_sha256(p))
        for n, p in _rollout_files(run_dir)
        if n <= last_update
    }


def inventory_sha256(entries: dict[str, tuple[int, str]]) -> str:
    """SHA-256 of the inventory: one line ``name size sha256`` per file, sorted by name."""
    lines = "".join(f"{n} {s} {h}\n" for n, (s, h) in sorted(entries.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def truncate_rollouts(run_dir: Path, last_update: int) -> list[Path]:
    """Delete the rollout files of updates after `last_update`; return what went."""
    doomed = [p for n, p in _rollout_files(run_dir) if n > last_update]
    for path in doomed:
        path.unlink()
    return doomed


# -- best checkpoint ----------------------------------------------------------------------


def better(value: float, best: dict[str, Any] | None, mode: str) -> bool:
    """Whether `value` improves on the record `best` (None: anything does) under `mode`."""
    if best is None:
        return True
    return value < best["value"] if mode == "min" else value > best["value"]


def write_best(checkpoint_root: Path, record: dict[str, Any] | None) -> None:
    """Write (or, for None, remove) ``checkpoints/best.json`` atomically."""
    path = Path(checkpoint_root) / BEST
    if record is None:
        path.unlink(missing_ok=True)
        return
    write_text_atomic(path, json.dumps(record, indent=1, sort_keys=True) + "\n")


def read_best(checkpoint_root: Path) -> dict[str, Any] | None:
    """The record of ``checkpoints/best.json``, or None without one (or unreadable)."""
    path = Path(checkpoint_root) / BEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
