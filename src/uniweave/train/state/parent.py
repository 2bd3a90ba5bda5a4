"""The checkpoint a child run starts from (`run.parent`, docs/campaigns.md) and what the
child records of it.

`parent_checkpoint` finds it — a checkpoint directory (verified) or a run directory's
newest intact checkpoint — and refuses one a child cannot start from; `parent_record` is
the child's link to it (path, manifest SHA-256, update), carried in every checkpoint of
the child. Whether the parent's config may be continued under the child's is the resume
check's (`uniweave.train.engine.resume.check_resume`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from uniweave.config import ConfigError, UniweaveConfig
from uniweave.config.methods import method
from uniweave.train.state import checkpoint as ckpt


def parent_checkpoint(cfg: UniweaveConfig) -> ckpt.Checkpoint:
    """The checkpoint `run.parent` names: a checkpoint directory (verified), or a run
    directory's newest intact checkpoint. ConfigError naming `run.parent` otherwise, and
    for a checkpoint inside a GRPO round (the spec's `updates_per_round`: GRPO's
    `algorithm.updates_per_batch` K > 1, update not a multiple of K: the round's rollouts stay in the parent's directory; not built)."""
    assert cfg.run.parent is not None, "called for a run with run.parent set"
    root = Path(cfg.run.parent)
    try:
        if (root / ckpt.STATE).is_file():
            found: ckpt.Checkpoint | None = ckpt.verify_checkpoint(root)
        elif not ckpt.checkpoint_dir(root).is_dir():
            raise ConfigError(f"{root}: neither a run directory nor a checkpoint", key="run.parent")
        else:
            found = ckpt.scan_checkpoints(root).latest
    except ckpt.CheckpointError as exc:
        raise ConfigError(f"{exc}", key="run.parent") from None
    if found is None:
        raise ConfigError(f"{root}: no intact checkpoint", key="run.parent")
    k = method(cfg.algorithm.name).updates_per_round(cfg.algorithm)
    if found.update % k:
        raise ConfigError(
            f"{found.path}: update {found.update} is inside a GRPO round "
            f"(algorithm.updates_per_batch={k}); a child starts only at a round boundary "
            "(a multiple of it)",
            key="run.parent",
        )
    return found


def parent_record(found: ckpt.Checkpoint) -> dict[str, str]:
    """What a child run records of its parent checkpoint: its path and the SHA-256 of its
    manifest (every file's size and SHA-256, canonical JSON)."""
    manifest = json.dumps(found.state["manifest"], sort_keys=True, separators=(",", ":"))
    return {
        "checkpoint": str(found.path.resolve()),
        "manifest_sha256": hashlib.sha256(manifest.encode()).hexdigest(),
        "update": str(found.update),
    }
