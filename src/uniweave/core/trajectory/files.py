"""Lists of trajectories on disk: `save_trajectories` / `load_trajectories`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from uniweave.core.atomic import atomic_write
from uniweave.core.trajectory.stream import Trajectory


def save_trajectories(path: str | Path, trajs: Sequence[Trajectory]) -> None:
    """Write `trajs` (their `to_state`, with the class name of each) to `path` atomically:
    a temporary file, fsynced, then renamed (`uniweave.core.atomic`)."""
    path = Path(path)
    payload = [{"kind": type(t).__name__, "state": t.to_state()} for t in trajs]
    with atomic_write(path, "wb") as f:
        torch.save(payload, f)


def load_trajectories(path: str | Path, kinds: Sequence[type[Trajectory]] = ()) -> list[Trajectory]:
    """The trajectories `save_trajectories` wrote (loaded with ``weights_only=True``: no
    code runs). `kinds` are the Trajectory subclasses the file may hold besides
    `Trajectory` (e.g. `uniweave.rollout.RolloutTrajectory`); ValueError naming the path for
    an unreadable file or an unknown kind."""
    path = Path(path)
    known: list[type[Trajectory]] = [Trajectory, *kinds]
    classes = {c.__name__: c for c in known}
    try:
        payload = torch.load(path, weights_only=True)
    except Exception as err:  # any unreadable file gets the same one line
        raise ValueError(f"{path}: not a readable trajectory file ({err})") from None
    out = []
    for k, item in enumerate(payload):
        cls = classes.get(str(item.get("kind"))) if isinstance(item, dict) else None
        if cls is None:
            raise ValueError(f"{path}: entry {k} has an unknown kind; known: {sorted(classes)}")
        try:
            out.append(cls.from_state(item["state"]))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: entry {k}: {err}") from None
    return out
