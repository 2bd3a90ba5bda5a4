"""Models behind the `UnifiedModel` hooks: the embedded tiny default, Janus-Pro, UniAR."""

from unirl.models.base import BodyOutput, UnifiedModel
from unirl.models.registry import load_model, register_model

__all__ = ["BodyOutput", "UnifiedModel", "load_model", "register_model"]
