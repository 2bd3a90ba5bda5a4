"""The shared base of every config model and the helper for cross-field errors."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

INCOMPATIBLE = "incompatible"
FLOAT32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1


def _out_of_range(value: Any) -> str | None:
    """Why a leaf value cannot reach the tensors (float32 / int64), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and abs(value) > FLOAT32_MAX:
        return f"{value!r} overflows float32 (|x| <= {FLOAT32_MAX:.4g})"
    if isinstance(value, int) and abs(value) > INT64_MAX:
        return f"{value!r} overflows int64"
    if isinstance(value, (list, tuple)):
        return next((r for r in map(_out_of_range, value) if r), None)
    if isinstance(value, dict):
        return next((r for r in map(_out_of_range, value.values()) if r), None)
    return None


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, values are validated (also the
    defaults), NaN/inf floats and numbers beyond float32 / int64 are rejected, and instances are immutable (use
    `model_copy(update=...)` or the loader's overrides to derive a changed config)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        allow_inf_nan=False,
    )

    @model_validator(mode="after")
    def _representable(self) -> Any:
        """Every number fits the tensors it ends up in: |float| within float32, ints
        within int64 (`lr=1e39` is a config error, not an overflow in the optimizer)."""
        for name in type(self).model_fields:
            problem = _out_of_range(getattr(self, name))
            if problem:
                raise incompatible(name, problem)
        return self


def changed(model: BaseModel, name: str) -> bool:
    """Whether field `name` of `model` was given explicitly (`model_fields_set`) a value
    other than its default: what an "acts only with ..." refusal refuses (a value equal to
    the default, e.g. one a child recipe sets back, is harmless)."""
    if name not in model.model_fields_set:
        return False
    default = type(model).model_fields[name].get_default(call_default_factory=True)
    return bool(getattr(model, name) != default)


def first_changed(model: BaseModel, names: Iterable[str] | None = None) -> str | None:
    """The first of `names` (default: every field, in schema order) that `changed`."""
    pool = type(model).model_fields if names is None else names
    return next((n for n in pool if changed(model, n)), None)


def incompatible(field: str, detail: str, also: Iterable[str] = ()) -> PydanticCustomError:
    """An error for a cross-field check, to be raised from a model validator.

    `field` is the dotted key (relative to the model whose validator raises) that the message
    should name; the config loader appends it to the model's location. `also`: the other
    keys (relative likewise) the check read, whose file or `<command line>` the message
    names too (a trial run's `total_updates` on the command line against a recipe's
    warmup).
    """
    ctx = {"field": field, "detail": detail, "also": tuple(also)}
    return PydanticCustomError(INCOMPATIBLE, "{detail}", ctx)
