"""Hub ids where a model directory is expected: `model.path`, the model directories of
the method (its spec's `model_dirs`: OPD's `algorithm.teacher.path`) and
`reward.plugins[i].path` may name a Hugging Face hub repository
(`deepseek-community/Janus-Pro-1B`) instead of a local directory.

A value is a hub id when it is `org/name` (one slash, no leading `.`, `/` or `~`) and no
local file or directory of that name, nor a local directory `org`, exists: a local path
always wins. A hub id is resolved through `huggingface_hub.snapshot_download`, the local
cache first (`local_files_only=True`: `models--org--name/refs/main` ->
`snapshots/<rev>/`, in `HF_HUB_CACHE` / `HF_HOME`), then, unless `HF_HUB_OFFLINE` is set,
the hub itself. When neither gives it, a ConfigError names the key and the id, in one
line. The resolved value is the snapshot directory, so every later check and loader
reads a plain local directory (the printed config and its hash show that directory).

The CLI resolves once, right after loading the config (`resolve_hub_ids`), before any
check reads the paths; the Python API takes local directories only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, overload

from uniweave.config.errors import ConfigError
from uniweave.config.methods import get_key, method, with_key

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
TRUE = {"1", "ON", "YES", "TRUE"}


def is_hub_id(value: str) -> bool:
    """`org/name` with neither the path nor `org` present locally (module docstring)."""
    if not HUB_ID.fullmatch(value):
        return False
    return not (Path(value).exists() or Path(value.split("/")[0]).is_dir())


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` as huggingface_hub reads it (1/ON/YES/TRUE), at call time."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in TRUE


@overload
def resolve(value: str, key: str) -> str: ...
@overload
def resolve(value: None, key: str) -> None: ...
def resolve(value: str | None, key: str) -> str | None:
    """`value` unchanged unless it is a hub id; then its local snapshot directory
    (module docstring). ConfigError naming `key` and the id when it cannot be had."""
    if value is None or not is_hub_id(value):
        return value
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    cache = os.environ.get("HF_HUB_CACHE") or (
        str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else HF_HUB_CACHE
    )
    try:
        return snapshot_download(value, cache_dir=cache, local_files_only=True)
    except Exception:  # noqa: BLE001 - any miss falls through to the hub or the error below
        pass
    where = f"not a local directory, and hub id {value!r} is not in the hub cache {cache}"
    if hub_offline():
        raise ConfigError(f"{where} (HF_HUB_OFFLINE is set)", key=key)
    try:
        return snapshot_download(value, cache_dir=cache)
    except Exception as err:  # noqa: BLE001 - network, auth, missing repo: one line each
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{where} nor reachable on the hub ({reason[:200]})", key=key) from None


def resolve_hub_ids(cfg: Any) -> Any:
    """`cfg` with every model-directory key that names a hub id replaced by its local
    snapshot directory (`resolve`); `cfg` itself when none does."""
    update: dict[str, Any] = {}
    path = resolve(cfg.model.path, "model.path")
    if path != cfg.model.path:
        update["model"] = cfg.model.model_copy(update={"path": path})
    algo = cfg.algorithm
    for dotted in method(algo.name).model_dirs:  # OPD: teacher.path
        value = get_key(algo, dotted)
        path = resolve(value, f"algorithm.{dotted}")
        if path != value:
            algo = with_key(algo, dotted, path)
    if algo is not cfg.algorithm:
        update["algorithm"] = algo
    plugins = list(cfg.reward.plugins)
    changed = False
    for i, plugin in enumerate(plugins):
        path = resolve(plugin.path, f"reward.plugins.{i}.path")
        if path != plugin.path:
            plugins[i] = plugin.model_copy(update={"path": path})
            changed = True
    if changed:
        update["reward"] = cfg.reward.model_copy(update={"plugins": plugins})
    return cfg.model_copy(update=update) if update else cfg
