"""Models behind the `UnifiedModel` hooks. Each model package (tiny/, janus_pro/, ...)
declares its kind in its `kind.json` (plugins use `register_model`); `load_model` and
`check_model_config` find them.

Importing this package imports no model and no torch: `UnifiedModel` and `BodyOutput`
(`uniweave.models.base`) are imported on first access, so a config check stays light."""

from typing import TYPE_CHECKING

from uniweave.models.registry import (
    ModelSpec,
    check_model_config,
    declare_planned_model,
    load_model,
    model_spec,
    register_model,
)

if TYPE_CHECKING:
    from uniweave.models.base import BodyOutput, UnifiedModel

_FROM_BASE = ("BodyOutput", "UnifiedModel")


def __getattr__(name: str):
    """`BodyOutput` and `UnifiedModel`, imported from `uniweave.models.base` when first asked."""
    if name in _FROM_BASE:
        from uniweave.models import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BodyOutput",
    "ModelSpec",
    "UnifiedModel",
    "check_model_config",
    "declare_planned_model",
    "load_model",
    "model_spec",
    "register_model",
]
