"""Model kinds by name, and loading a model directory by the kind its config records.

A directory written by unirl records its kind in `unirl_model.json`. A transformers
checkpoint directory without one (e.g. a Janus-Pro download) is recognised by the
`model_type` of its `config.json` (`TRANSFORMERS_KINDS`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from unirl.models.base import UnifiedModel

MODEL_CONFIG = "unirl_model.json"
TRANSFORMERS_CONFIG = "config.json"
TRANSFORMERS_KINDS: dict[str, str] = {"janus": "janus_pro"}
"""transformers `model_type` -> unirl model kind."""
_LOADERS: dict[str, Callable[[Path], UnifiedModel]] = {}


def register_model(kind: str, loader: Callable[[Path], UnifiedModel]) -> None:
    """Register `loader(path) -> UnifiedModel` for model directories of `kind`."""
    _LOADERS[kind] = loader


def _load_janus_pro(path: Path) -> UnifiedModel:
    from unirl.models.janus_pro import JanusProModel

    return JanusProModel.from_pretrained(path)


def _ensure_builtin() -> None:
    if "tiny" not in _LOADERS:
        from unirl.models.tiny import TinyUnifiedModel

        register_model("tiny", TinyUnifiedModel.from_pretrained)
    _LOADERS.setdefault("janus_pro", _load_janus_pro)


def read_json(path: Path) -> dict:
    """A JSON object file; ValueError naming the path when unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def model_kind(path: str | Path) -> str:
    """The kind of the model directory `path` (module docstring); FileNotFoundError when
    it is neither a unirl model directory nor a recognised transformers checkpoint."""
    path = Path(path)
    cfg_file = path / MODEL_CONFIG
    if cfg_file.is_file():
        return read_json(cfg_file).get("kind")
    hf_file = path / TRANSFORMERS_CONFIG
    if hf_file.is_file():
        model_type = read_json(hf_file).get("model_type")
        if model_type in TRANSFORMERS_KINDS:
            return TRANSFORMERS_KINDS[model_type]
        raise ValueError(
            f"{hf_file}: model_type {model_type!r} is not a supported checkpoint; "
            f"known: {sorted(TRANSFORMERS_KINDS)}"
        )
    raise FileNotFoundError(
        f"{path}: not a unirl model directory (missing {MODEL_CONFIG}) nor a transformers "
        f"checkpoint (missing {TRANSFORMERS_CONFIG})"
    )


def load_model(path: str | Path) -> UnifiedModel:
    """Load a model directory (written by `save_pretrained`, or a supported transformers
    checkpoint), dispatching on its kind."""
    path = Path(path)
    kind = model_kind(path)
    _ensure_builtin()
    if kind not in _LOADERS:
        raise ValueError(f"{path}: unknown model kind {kind!r}; known: {sorted(_LOADERS)}")
    return _LOADERS[kind](path)
