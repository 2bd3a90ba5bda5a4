"""Config identity: a stable hash, a dotted-key diff, YAML dumping, resume compatibility."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel

from uniweave.config.methods import method

ConfigLike = BaseModel | Mapping[str, Any]

SHORT_HASH_LEN = 12
# Keys that cannot alter the objective, changeable on any resume: where the run lives,
# checkpoint cadence, logging and progress, health-alarm thresholds (they only watch), and execution-only settings — how a global
# batch is split into micro-batches (the objective is normalised by global counts; the
# invariance tests in tests/test_trainer.py prove it), how many rows the rollout engine
# decodes together (per-row seeds), activation recomputation and deterministic kernels,
# whether rollouts and rewards run in Ray workers (`rollout.workers`, `reward.workers`,
# `ray`: the same engine batches and scores, tests/test_ray_workers.py), and how many
# local workers `uniweave train` spawns (`trainer.world_size`; under torchrun the world size
# is not in the config at all): the data cursor and per-row seeds are functions of the
# update alone, so a checkpoint resumes at another rank count (DCP reshards; the resume
# records it, tests/test_reshard.py), unless dropout draws rank-local masks, and how many
# evaluation workers share a device (the same records, tests/test_eval_workers.py).
# These change how the numbers are computed, not what is computed: a resume under a
# changed one agrees with the uninterrupted run to float rounding, not bit for bit.
ALWAYS_RESUMABLE = (
    "run.output_dir",
    "run.parent",
    "run.deterministic",
    "checkpoint.every_updates",
    "checkpoint.every_minutes",
    "checkpoint.every_epochs",
    "checkpoint.keep_last",
    "checkpoint.resume_mode",
    "logging",
    "health",
    "trainer.micro_batch_size",
    "trainer.micro_token_budget",
    "trainer.gradient_checkpointing",
    "rollout.batch_size",
    "trainer.collective_timeout_s",
    "trainer.world_size",
    "rollout.workers",
    "reward.workers",
    "ray",
    "evaluation.workers_per_gpu",
)
# Additionally changeable under checkpoint.resume_mode = allow_schedule_changes.
SCHEDULE_KEYS = (
    "trainer.total_updates",
    "trainer.scheduler",
    "trainer.eval_every",
    "trainer.eval_every_epochs",
)
# The rollout caps (`rollout_limit_change`): how long a sampled row or image may grow.
ROLLOUT_CAP_KEYS = ("rollout.max_new_tokens", "rollout.max_grid_side")
# Execution-only keys beyond ALWAYS_RESUMABLE (`execution_change`): DDP's reducer flags
# and FSDP2's resharding (how gradients are reduced and parameters gathered, not what).
EXECUTION_KEYS = (
    "trainer.micro_batch_size",
    "trainer.micro_token_budget",
    "trainer.gradient_checkpointing",
    "trainer.ddp",
    "trainer.fsdp.reshard_after_forward",
)
# checkpoint.resume_mode -> the keys it lets change on top of ALWAYS_RESUMABLE, in place
# or against a run.parent checkpoint (the one home of these sets; docs/campaigns.md).
# epoch_extension: a longer run on a constant learning rate (the schedule itself may not
# change, and must be constant or warmup_constant: `check_extension`); a new run name.
RESUME_MODES: dict[str, tuple[str, ...]] = {
    "strict": (),
    "allow_schedule_changes": SCHEDULE_KEYS,
    "epoch_extension": ("trainer.total_updates", "run.name"),
    "rollout_limit_change": ROLLOUT_CAP_KEYS,
    "execution_change": EXECUTION_KEYS,
}
CONSTANT_LR_SCHEDULES = ("constant", "warmup_constant")


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
    the micro-batch size); every other mode also the keys `RESUME_MODES` gives it
    (`allow_schedule_changes`: total_updates, the lr schedule, eval cadence; ...), and
    any mode the method's own `resumable_keys` (`uniweave.config.methods`; the built-in
    methods have none).
    """
    mode = current.checkpoint.resume_mode  # type: ignore[attr-defined]  # a UniweaveConfig (this module sits below the schema)
    algo = current.algorithm  # type: ignore[attr-defined]  # a UniweaveConfig (this module sits below the schema)
    own = tuple(f"algorithm.{key}" for key in method(algo.name).resumable_keys)
    allowed = ALWAYS_RESUMABLE + RESUME_MODES[mode] + own
    return [k for k in diff_configs(saved, current) if not _under(k, allowed)]


def check_extension(saved: ConfigLike, current: BaseModel) -> tuple[str, str] | None:
    """Under `epoch_extension`, (key, why) when the run is not a longer constant-LR run
    of `saved`: the schedule must be constant (or past-warmup constant) and
    `trainer.total_updates` may only grow. None otherwise (and for every other mode)."""
    if current.checkpoint.resume_mode != "epoch_extension":  # type: ignore[attr-defined]  # a UniweaveConfig (this module sits below the schema)
        return None
    trainer = current.trainer  # type: ignore[attr-defined]  # a UniweaveConfig (this module sits below the schema)
    if trainer.scheduler.name not in CONSTANT_LR_SCHEDULES:
        return (
            "trainer.scheduler.name",
            f"epoch_extension extends a constant learning rate; '{trainer.scheduler.name}' "
            "depends on total_updates",
        )
    before = flatten(as_plain(saved)).get("trainer.total_updates")
    if isinstance(before, int) and trainer.total_updates < before:
        return (
            "trainer.total_updates",
            f"epoch_extension only lengthens a run ({before} -> {trainer.total_updates})",
        )
    return None


def resumable_summary(mode: str) -> str:
    """The keys `mode` lets change on resume, for messages."""
    return ", ".join(ALWAYS_RESUMABLE + RESUME_MODES[mode])


def to_yaml(cfg: ConfigLike) -> str:
    """The resolved config as YAML in schema order; loading it back gives the same config."""
    return yaml.safe_dump(as_plain(cfg), sort_keys=False, default_flow_style=False)
