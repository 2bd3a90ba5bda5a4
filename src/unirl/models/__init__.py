"""Models behind the `UnifiedModel` hooks. Each model package (tiny/, janus_pro/, ...)
registers its kind with `register_model`; `load_model` and `check_model_config` find them."""

from unirl.models.base import BodyOutput, UnifiedModel
from unirl.models.registry import (
    ModelSpec,
    check_model_config,
    declare_planned_model,
    load_model,
    model_spec,
    register_model,
)

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
