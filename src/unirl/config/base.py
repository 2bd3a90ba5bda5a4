"""The shared base of every config model and the helper for cross-field errors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

INCOMPATIBLE = "incompatible"


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, values are validated (also the
    defaults), NaN/inf floats are rejected, and instances are immutable (use
    `model_copy(update=...)` or the loader's overrides to derive a changed config)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        allow_inf_nan=False,
    )


def incompatible(field: str, detail: str) -> PydanticCustomError:
    """An error for a cross-field check, to be raised from a model validator.

    `field` is the dotted key (relative to the model whose validator raises) that the message
    should name; the config loader appends it to the model's location.
    """
    return PydanticCustomError(INCOMPATIBLE, "{detail}", {"field": field, "detail": detail})
