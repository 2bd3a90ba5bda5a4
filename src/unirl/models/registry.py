"""Model kinds by name, and loading a model directory by the kind its config records."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from unirl.models.base import UnifiedModel

MODEL_CONFIG = "unirl_model.json"
_LOADERS: dict[str, Callable[[Path], UnifiedModel]] = {}


def register_model(kind: str, loader: Callable[[Path], UnifiedModel]) -> None:
    """Register `loader(path) -> UnifiedModel` for model directories of `kind`."""
    _LOADERS[kind] = loader


def _ensure_builtin() -> None:
    if "tiny" not in _LOADERS:
        from unirl.models.tiny import TinyUnifiedModel

        register_model("tiny", TinyUnifiedModel.from_pretrained)


def load_model(path: str | Path) -> UnifiedModel:
    """Load a model directory written by `save_pretrained`, dispatching on its kind."""
    path = Path(path)
    cfg_file = path / MODEL_CONFIG
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: not a unirl model directory (missing {MODEL_CONFIG})")
    kind = json.loads(cfg_file.read_text()).get("kind")
    _ensure_builtin()
    if kind not in _LOADERS:
        raise ValueError(f"{cfg_file}: unknown model kind {kind!r}; known: {sorted(_LOADERS)}")
    return _LOADERS[kind](path)
