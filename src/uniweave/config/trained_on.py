"""What a trained model was trained on, recorded beside its weights and checked by `eval`.

A run's exported `model/` directory holds `trained_on.json`:

    {"tasks": [...], "algorithm": "sft", "config_hash": "...",
     "data": {"data.path": {"path": "...", "digest": "..."} | null}}

`tasks` are the run's `data.tasks`; `data` the training rows (`data.path`: its resolved
path and the SHA-256 digest of its files' content hashes, `uniweave.config.fingerprint`;
null: the embedded digits). A model that starts another run keeps its own record only
until that run exports: the new `model/` records the new run.

`uniweave eval` (`mismatch_warnings`) compares the record of `model.path` with the
evaluation's config and warns, one line each, when it asks for a task the model was not
trained on, or reads `data.path` rows whose digest differs from the training rows'
(another dataset, or the same file changed since). A warning, not a refusal: evaluating
a model off its training tasks is a legitimate question (transfer, a baseline), but it
should never happen by a forgotten override. A model directory without the record (a
hub checkpoint, an older export) is evaluated without a check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from uniweave.config.fingerprint import path_identity
from uniweave.config.resolved import data_tasks
from uniweave.config.schema import UniweaveConfig

TRAINED_ON = "trained_on.json"


def _data_record(path: str | None) -> dict[str, str] | None:
    if path is None:
        return None
    return path_identity(path)


def trained_on(cfg: UniweaveConfig, config_hash: str) -> dict[str, Any]:
    """The record of a run that trains with `cfg` (module docstring)."""
    return {
        "tasks": list(data_tasks(cfg.data)),
        "algorithm": cfg.algorithm.name,
        "config_hash": config_hash,
        "data": {"data.path": _data_record(cfg.data.path)},
    }


def write_trained_on(model_dir: Path, cfg: UniweaveConfig, config_hash: str) -> None:
    """Write the record into `model_dir` (inside an atomic export: no rename of its own)."""
    text = json.dumps(trained_on(cfg, config_hash), indent=2, sort_keys=True) + "\n"
    (Path(model_dir) / TRAINED_ON).write_text(text)


def read_trained_on(model_dir: str | Path | None) -> dict[str, Any] | None:
    """The record of `model_dir`, or None when it has none. ValueError naming the file
    when it is not a JSON object with `tasks` and `data`."""
    if model_dir is None:
        return None
    path = Path(model_dir) / TRAINED_ON
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from None
    if not isinstance(record, dict) or not {"tasks", "data"} <= record.keys():
        raise ValueError(f"{path}: not a trained_on record (needs 'tasks' and 'data')")
    return record


def mismatch_warnings(cfg: UniweaveConfig) -> list[str]:
    """One line per way the evaluation `cfg` asks about rows that `model.path` was not
    trained on (module docstring); [] without a record."""
    try:
        record = read_trained_on(cfg.model.path)
    except ValueError as err:
        return [f"{err}; the model's training tasks are not checked"]
    if record is None:
        return []
    out = []
    trained = list(record["tasks"])
    other = [t for t in data_tasks(cfg.data) if t not in trained]
    if other:
        out.append(
            f"model.path {cfg.model.path} was trained on tasks {trained}; this evaluation "
            f"asks for {other}, which it never saw (data.tasks)"
        )
    saved = record["data"].get("data.path")
    if saved is not None and cfg.data.path is not None:
        now = _data_record(cfg.data.path)
        if now is not None and now["digest"] != saved["digest"]:
            where = "changed since" if now["path"] == saved["path"] else "differ from"
            out.append(
                f"data.path {cfg.data.path}: these rows {where} the rows model.path "
                f"{cfg.model.path} was trained on ({saved['path']})"
            )
    return out
