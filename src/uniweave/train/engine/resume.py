"""Resume and campaign policy: whether a checkpoint may be resumed under this run's config
and processes, what a resume records, and what a child run does first.

A resume is refused (ConfigError, a usage error, before anything is written) when the
config changed at a key `checkpoint.resume_mode` does not let change, when an input file
the checkpoint fingerprinted changed since (`check_resume`), or when the world size
changed while the model draws dropout masks per rank (`check_world_size_change`); it is
refused as a TrainingError when the checkpoint was trained against another objective
identity (`check_identity`: e.g. another teacher). What a resume lets through but that
computes the same updates in another order — a world-size change, an execution-only key —
goes into the checkpoint's record of execution changes (`execution_changes`). A child run
(`run.parent`, `uniweave.train.state.parent`) started under `rollout_limit_change`
re-measures the validation baseline first (`remeasures`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from uniweave.config import ConfigError, UniweaveConfig, config_hash, resume_conflicts
from uniweave.config.hashing import SCHEDULE_KEYS, check_extension, diff_configs, resumable_summary
from uniweave.core.status import status
from uniweave.train.engine.errors import TrainingError
from uniweave.train.engine.forward_mode import draws_dropout
from uniweave.train.state import checkpoint as ckpt
from uniweave.train.state.fingerprints import FINGERPRINTS, check_fingerprints


def check_resume(found: ckpt.Checkpoint, cfg: UniweaveConfig) -> None:
    """ConfigError (a usage error) naming the changed keys when the config `found` was
    saved under may not be resumed under `cfg` (`uniweave.config.resume_conflicts`, and
    `check_extension` under `epoch_extension`), or naming the file when an input it
    recorded changed since (`check_fingerprints`)."""
    check_fingerprints(found.state.get(FINGERPRINTS), cfg, str(found.path))
    if found.state.get("config_hash") == config_hash(cfg):
        return
    saved = found.state.get("config", {})
    refused = resume_conflicts(saved, cfg)
    if refused:
        mode = cfg.checkpoint.resume_mode
        schedule = [
            k for k in refused if any(k == p or k.startswith(p + ".") for p in SCHEDULE_KEYS)
        ]
        fix = "use a new run.output_dir for a new run"
        if schedule and mode == "strict":
            fix = (
                f"to extend or reschedule this run ({', '.join(schedule)}), set "
                "checkpoint.resume_mode=allow_schedule_changes (in a recipe: checkpoint: "
                f"{{resume_mode: allow_schedule_changes}}); else {fix}"
            )
        raise ConfigError(
            f"refusing to resume: the config changed at {', '.join(refused)} "
            f"(checkpoint.resume_mode={mode} allows only {resumable_summary(mode)} to "
            f"change); {fix}",
            source=str(found.path),
        )
    bad = check_extension(saved, cfg)
    if bad is not None:
        raise ConfigError(f"refusing to resume {found.path}: {bad[1]}", key=bad[0])


def check_world_size_change(found: ckpt.Checkpoint, world_size: int, model: nn.Module) -> None:
    """ConfigError when checkpoint `found`, written at another world size, cannot be
    resumed at `world_size` with the same logical schedule. The data cursor (the update
    number), the global batch and every per-row seed are functions of the update alone,
    and the objective is normalised by global counts, so only one thing depends on the rank
    count: dropout masks, drawn from each rank's own torch RNG stream in the order of its
    micro-batches (which rows a rank holds changes with the world size)."""
    saved = found.state.get("world_size")
    if saved is None or saved == world_size or not draws_dropout(model):
        return
    raise ConfigError(
        f"refusing to resume {found.path} at world size {world_size}: it was written at "
        f"{saved} and the model draws dropout masks from each rank's RNG stream, so the rows' "
        f"masks would depend on the rank count; resume at {saved} ranks or train without "
        "dropout",
        source=str(found.path),
    )


def check_identity(found: ckpt.Checkpoint, identity: Any) -> None:
    """TrainingError when `found` was trained against another objective identity
    (`Objective.identity`, written into every checkpoint)."""
    held = found.state.get("identity")
    if held != identity:
        raise TrainingError(
            f"refusing to resume {found.path}: it was trained against {held}, this run "
            f"has {identity}; use a new run.output_dir"
        )


def execution_changes(
    found: ckpt.Checkpoint, cfg: UniweaveConfig, world_size: int, from_parent: bool, say: bool
) -> list[dict[str, Any]]:
    """The checkpoint's record of execution changes plus this resume's, when the world size
    or (resuming in place) an allowed config key differs from the checkpoint's; with `say`
    (rank 0) it is printed. Only changes the resume check let through reach here, so a
    logical change is never recorded: it was refused."""
    changes = list(found.state.get("execution_changes", []))
    before = found.state.get("world_size")
    # a child's config differs from its parent's by design (its own record: "parent")
    keys = [] if from_parent else diff_configs(found.state.get("config", {}), cfg)
    moved = before is not None and before != world_size
    if not moved and not keys:
        return changes
    entry = {
        "update": found.update,
        "checkpoint": found.path.name,
        "world_size": [before, world_size],
        "config_keys": keys,
    }
    changes.append(entry)
    if say:
        what = [f"world size {before} -> {world_size}"] if moved else []
        what += [f"config {', '.join(keys)}"] if keys else []
        status(
            f"execution change at update {found.update}: {'; '.join(what)} (the same "
            "updates, computed in another order: float rounding, not bit for bit)"
        )
    return changes


def remeasures(cfg: UniweaveConfig, from_parent: bool, evaluates: bool) -> bool:
    """A child started from its parent under `rollout_limit_change` re-measures the
    validation metrics at the update it starts from (rank 0, when it validates;
    `evaluates`: this process has an evaluator)."""
    t = cfg.trainer
    return (
        from_parent
        and cfg.checkpoint.resume_mode == "rollout_limit_change"
        and evaluates
        and (t.eval_every > 0 or t.eval_every_epochs > 0)
    )
