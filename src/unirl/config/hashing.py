"""Config identity: a stable hash, a dotted-key diff, YAML dumping, resume compatibility."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel

ConfigLike = BaseModel | Mapping[str, Any]

SHORT_HASH_LEN = 12
# Keys that cannot alter the objective, changeable on any resume: where the run lives,
# checkpoint cadence, logging and progress, health-alarm thresholds (they only watch), and execution-only settings — how a global
# batch is split into micro-batches (the objective is normalised by global counts; the
# invariance tests in tests/test_trainer.py prove it), how many rows the rollout engine
# decodes together (per-row seeds), activation recomputation and deterministic kernels,
# and whether rollouts and rewards run in Ray workers (`rollout.workers`,
# `reward.workers`, `ray`: the same engine batches and scores, tests/test_ray_workers.py).
# These change how the numbers are computed, not what is computed: a resume under a
# changed one agrees with the uninterrupted run to float rounding, not bit for bit.
ALWAYS_RESUMABLE = (
    "run.output_dir",
    "run.deterministic",
    "checkpoint.every_updates",
    "checkpoint.every_minutes",
    "checkpoint.keep_last",
    "checkpoint.resume_mode",
    "logging",
    "health",
    "trainer.micro_batch_size",
    "trainer.micro_token_budget",
    "trainer.gradient_checkpointing",
    "rollout.batch_size",
    "trainer.collective_timeout_s",
    "rollout.workers",
    "reward.workers",
    "ray",
)
# Additionally changeable under checkpoint.resume_mode = allow_schedule_changes.
SCHEDULE_KEYS = ("trainer.total_updates", "trainer.scheduler", "trainer.eval_every")


def as_plain(cfg: ConfigLike) -> dict[str, Any]:
    """The fully resolved config as JSON-compatible data (`model_dump(mode="json")`)."""
    if isinstance(cfg, BaseModel):
        return cfg.model_dump(mode="json")
    return json.loads(json.dumps(dict(cfg)))


def canonical_json(cfg: ConfigLike) -> str:
    """JSON with sorted keys and compact separators: the bytes the hash is taken over."""
    return json.dumps(as_plain(cfg), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def config_hash(cfg: ConfigLike) -> str:
    """sha256 hex digest (64 chars) of `canonical_json(cfg)`."""
    return hashlib.sha256(canonical_json(cfg).encode("utf-8")).hexdigest()


def short_hash(cfg: ConfigLike) -> str:
    """The first 12 hex chars of `config_hash(cfg)` (for run names and log lines)."""
    return config_hash(cfg)[:SHORT_HASH_LEN]


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{dotted key: leaf}`; mappings recurse, lists are leaves (they replace as a whole)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def diff_configs(a: ConfigLike, b: ConfigLike) -> list[str]:
    """Dotted keys whose resolved values differ between `a` and `b` (keys of `a` first,
    then keys only in `b`); empty when `config_hash(a) == config_hash(b)`."""
    flat_a, flat_b = flatten(as_plain(a)), flatten(as_plain(b))
    missing = object()
    keys = list(flat_a) + [k for k in flat_b if k not in flat_a]
    return [k for k in keys if flat_a.get(k, missing) != flat_b.get(k, missing)]


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def resume_conflicts(saved: ConfigLike, current: BaseModel) -> list[str]:
    """Changed keys that forbid resuming a run saved with `saved` under `current`.

    `checkpoint.resume_mode` of `current` decides: `strict` allows only `ALWAYS_RESUMABLE`
    keys to change (paths, checkpoint cadence, logging, execution-only settings such as
    the micro-batch size); `allow_schedule_changes` also
    allows `SCHEDULE_KEYS` (total_updates, the lr schedule, eval cadence).
    """
    allowed = ALWAYS_RESUMABLE
    if current.checkpoint.resume_mode == "allow_schedule_changes":  # type: ignore[attr-defined]
        allowed = ALWAYS_RESUMABLE + SCHEDULE_KEYS
    return [k for k in diff_configs(saved, current) if not _under(k, allowed)]


def resumable_summary(mode: str) -> str:
    """The keys `mode` lets change on resume, for messages."""
    keys = ALWAYS_RESUMABLE + (SCHEDULE_KEYS if mode == "allow_schedule_changes" else ())
    return ", ".join(keys)


def to_yaml(cfg: ConfigLike) -> str:
    """The resolved config as YAML in schema order; loading it back gives the same config."""
    return yaml.safe_dump(as_plain(cfg), sort_keys=False, default_flow_style=False)
