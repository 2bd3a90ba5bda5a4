"""When a setting acts: the declarations, and the one rule that checks them.

A setting that acts only in some runs says so where it is defined, as an `ActsWhen` in
its annotation (`bit_temperature: Annotated[float, BSQ_HEAD] = Field(...)`). On a field that holds a
section (`model.tiny`) the declaration covers every field under it. A method declares the
rules of its own `algorithm:` keys in its spec (`MethodSpec.acts_when`, keyed by the
dotted key under `algorithm`). `ActsWhen.predicate` reads the whole `UniweaveConfig`.

The one rule, `refuse_inactive(cfg)` (run by the schema's cross-section validator): a
setting given explicitly (present in the YAML or the overrides with a value other than
its default, `uniweave.config.base.changed`; for a section, the first such field under
it) whose declaration's predicate is false is a config error naming that key and why it
does not act (exit 2, one line). A value equal to the default is harmless. The same
declarations write the "Acts only ..." sentence of each key in `docs/config.md` and
`uniweave config describe` (`conditions`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from uniweave.config.base import changed, incompatible
from uniweave.config.methods import MethodSpec, method, names


@dataclass(frozen=True)
class ActsWhen:
    """A setting acts only in the configs where `predicate(cfg)` holds.

    `condition` completes "acts only ..." ("with model.visual_head bsq", "for a model
    built from the config (model.path null)"): the sentence of docs/config.md and, unless
    `refusal` is given, the error. `refusal(cfg)` (or a fixed text): the error's detail in
    the config at hand, when a fixed sentence would not say why."""

    predicate: Callable[[Any], bool]
    condition: str | Callable[[], str]
    """The words, or a function that makes them when needed (lists of registered methods)."""
    refusal: str | Callable[[Any], str] | None = None

    def text(self) -> str:
        """The condition's words."""
        return self.condition() if callable(self.condition) else self.condition

    def detail(self, cfg: Any) -> str:
        """The error's detail for `cfg`, where the predicate is false."""
        if self.refusal is None:
            return f"acts only {self.text()}"
        return self.refusal(cfg) if callable(self.refusal) else self.refusal


def method_of(cfg: Any) -> MethodSpec:
    """The spec of `cfg.algorithm.name`."""
    return method(cfg.algorithm.name)


def rollout_methods() -> str:
    """'grpo, opd': the registered methods that train on rollouts (for messages)."""
    return ", ".join(names(rollouts=True))


def row_methods() -> str:
    """'sft': the registered methods that train on dataset rows (for messages)."""
    return " or ".join(names(rollouts=False))


def on_rollouts(then: str | Callable[[Any], str] = "") -> ActsWhen:
    """Acts only with a method that trains on rollouts; `then`: the error's tail."""
    return ActsWhen(
        lambda cfg: method_of(cfg).rollouts,
        lambda: f"with rollouts in training ({rollout_methods()})",
        lambda cfg: (
            f"acts only with rollouts in training ({rollout_methods()})"
            + (then(cfg) if callable(then) else then)
        ),
    )


def on_rows(why: str) -> ActsWhen:
    """Acts only with a method that trains on dataset rows; `why`: what the configured
    method (`{name}`) does instead."""
    return ActsWhen(
        lambda cfg: not method_of(cfg).rollouts,
        lambda: f"with {row_methods()} (training on dataset rows)",
        lambda cfg: f"acts only with {row_methods()}: " + why.format(name=cfg.algorithm.name),
    )


def declared(info: FieldInfo) -> tuple[ActsWhen, ...]:
    """The `ActsWhen` declarations in a field's annotation, in order (a tuple of them
    counts as its items: several rules named once)."""
    out: list[ActsWhen] = []
    for meta in info.metadata:
        if isinstance(meta, ActsWhen):
            out.append(meta)
        elif isinstance(meta, tuple) and meta and all(isinstance(m, ActsWhen) for m in meta):
            out.extend(meta)
    return tuple(out)


def given(model: BaseModel, name: str) -> str | None:
    """The dotted key (relative to `model`) of what field `name` was given explicitly:
    the field itself when it `changed`, for a section the first field under it that was
    (depth first, schema order); None when nothing was."""
    if name not in model.model_fields_set:
        return None
    value = getattr(model, name)
    if isinstance(value, BaseModel):
        for sub in type(value).model_fields:
            inner = given(value, sub)
            if inner is not None:
                return f"{name}.{inner}"
        return None
    return name if changed(model, name) else None


def _rules(cfg: Any) -> Iterator[tuple[str, BaseModel, str, tuple[ActsWhen, ...]]]:
    """(dotted key, owning section, field name, declarations) of every declared field of
    `cfg`, outer before inner (a section's rule before its fields')."""
    own: Mapping[str, tuple[ActsWhen, ...]] = method_of(cfg).acts_when

    def walk(model: BaseModel, prefix: str) -> Iterator[tuple[str, BaseModel, str, tuple]]:
        for name, info in type(model).model_fields.items():
            key = f"{prefix}{name}"
            rules = declared(info)
            if key.startswith("algorithm."):
                rules += own.get(key.removeprefix("algorithm."), ())
            if rules:
                yield key, model, name, rules
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                yield from walk(value, f"{key}.")
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, BaseModel):
                        yield from walk(item, f"{key}.{i}.")

    yield from walk(cfg, "")


def refuse_inactive(cfg: Any) -> None:
    """Raise `incompatible(key, why)` for the first setting given explicitly whose
    declaration does not hold in `cfg` (module docstring)."""
    for key, section, name, rules in _rules(cfg):
        found = given(section, name)
        if found is None:
            continue
        for rule in rules:
            if not rule.predicate(cfg):
                where = key.rpartition(".")[0]
                raise incompatible(f"{where}.{found}" if where else found, rule.detail(cfg))


def conditions(model: type[BaseModel], name: str, method_rules: tuple[ActsWhen, ...] = ()) -> str:
    """The "Acts only ..." sentence(s) of field `name` of `model` (plus a method's own
    rules for it), for the config reference; "" when it acts in every run."""
    rules = declared(model.model_fields[name]) + method_rules
    return f"Acts only {', and '.join(rule.text() for rule in rules)}." if rules else ""


__all__ = [
    "ActsWhen",
    "conditions",
    "declared",
    "given",
    "method_of",
    "on_rollouts",
    "on_rows",
    "refuse_inactive",
    "rollout_methods",
    "row_methods",
]
