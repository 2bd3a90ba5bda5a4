"""Command-line overrides `dotted.key=value`, typed by the schema (not by YAML guessing).

The target type comes from walking the pydantic annotations along the key: `run.name=123`
stays the string "123", `trainer.optimizer.lr=1e-4` is a float, bools accept
true/false/yes/no/on/off/1/0, `null`/`none`/`~` sets an optional field to None, lists are
written `[a,b]` (each item typed as the list's item type), list items are addressed by
index (`reward.plugins.0.weight=2`), and a whole section (or a list of sections) takes a
YAML flow value (`trainer.lora={enabled: true, r: 16}`), merged like a file. Inside the
tagged `algorithm` union the branch is picked by the `algorithm.name` given on the command
line, else in the files, else the default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from uniweave.config.errors import COMMAND_LINE, ConfigError, suggest
from uniweave.config.introspect import (
    Node,
    annotated_info,
    describe,
    field_node,
    is_model,
    item_node,
    strip_optional,
    union_branches,
)
from uniweave.config.schema import UniweaveConfig
from uniweave.config.validation import join_key, unknown_key_error
from uniweave.config.yaml_io import deep_merge, parse_yaml

NULLS = frozenset({"null", "none", "~"})
TRUE = frozenset({"true", "yes", "on", "1"})
FALSE = frozenset({"false", "no", "off", "0"})
SYNTAX = "dotted.key=value, e.g. trainer.optimizer.lr=1e-4"


@dataclass(frozen=True)
class Override:
    """One parsed `key=value` argument (`raw` is the text after the first `=`)."""

    key: str
    raw: str


def parse_override(text: str) -> Override:
    """Split `key=value`; a missing `=` or an empty key/segment is a `ConfigError`."""
    if "=" not in text:
        raise ConfigError(f"bad override {text!r}: no '='", source=COMMAND_LINE, expected=SYNTAX)
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part.strip() for part in key.split(".")):
        raise ConfigError(f"bad override {text!r}: empty key", source=COMMAND_LINE, expected=SYNTAX)
    return Override(key, raw)


def _error(key: str, raw: str, node: Node, problem: str | None = None, **kw: Any) -> ConfigError:
    return ConfigError(
        problem or f"invalid value {raw!r}",
        key=key,
        source=COMMAND_LINE,
        expected=describe(node),
        **kw,
    )


def _branch(prefix: str, node: Node, here: Any, pending: Mapping[str, str]) -> type[BaseModel]:
    union = union_branches(node)
    assert union is not None, "_branch is called at a union node"
    disc, branches = union
    tag_key = join_key(prefix, disc)
    if tag_key in pending:
        tag: Any = pending[tag_key].strip()
    elif isinstance(here, dict) and disc in here:
        tag = here[disc]
    else:
        info = node[1]
        assert info is not None, "a discriminated union carries its FieldInfo"
        tag = getattr(info.get_default(call_default_factory=True), disc)
    if tag not in branches:
        raise ConfigError(
            f"unknown {disc} {tag!r}",
            key=tag_key,
            source=COMMAND_LINE,
            expected="one of " + ", ".join(map(repr, branches)),
            suggestion=suggest(str(tag), [str(t) for t in branches]),
        )
    return branches[tag]


def resolve_target(
    key: str, data: Mapping[str, Any], pending: Mapping[str, str]
) -> tuple[Node, list[str | int]]:
    """Walk `key` through the schema: `(node of the target, path with list indices as ints)`."""
    node: Node = (UniweaveConfig, None)
    here: Any = data
    path: list[str | int] = []
    parts = key.split(".")
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        union = union_branches(node)
        step: str | int = part
        if union is not None and part == union[0]:
            node = (Literal[tuple(union[1])], None)
        else:
            if union is not None:
                node = (_branch(prefix, node, here, pending), None)
            node, step = _step(node, part, here, prefix, key)
        path.append(step)
        here = _child(here, step)
    return node, path


def _step(node: Node, part: str, here: Any, prefix: str, key: str) -> tuple[Node, str | int]:
    inner, _ = strip_optional(node[0])
    origin = get_origin(inner)
    if is_model(inner):
        if part not in inner.model_fields:
            raise unknown_key_error(UniweaveConfig, prefix, inner, part, COMMAND_LINE)
        return field_node(inner, part), part
    if origin in (list, tuple):
        size = len(here) if isinstance(here, list) else 0
        if not part.isdigit() or int(part) >= size:
            raise ConfigError(
                f"no list item {part!r} ({size} item(s) set)",
                key=join_key(prefix, part),
                source=COMMAND_LINE,
                expected=(f"an index below {size}, or " if size else "")
                + f"the whole list: {prefix}=[...]",
            )
        return item_node(node, int(part)), int(part)  # type: ignore[return-value]  # a list/dict node always has an item node
    if origin is dict:
        key_type = get_args(inner)[0]
        coerce(part, (key_type, None), join_key(prefix, part))
        return item_node(node, part), part  # type: ignore[return-value]  # a list/dict node always has an item node
    raise ConfigError(
        f"{prefix} is {describe(node)}, not a section",
        key=key,
        source=COMMAND_LINE,
        expected=f"an override of {prefix} itself",
    )


def _child(here: Any, part: str | int) -> Any:
    if isinstance(part, int):
        return here[part] if isinstance(here, list) and part < len(here) else None
    return here.get(part) if isinstance(here, dict) else None


def _split_list(raw: str) -> list[str] | None:
    text = raw.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    body = text[1:-1].strip()
    if not body:
        return []
    items = [item.strip() for item in body.split(",")]
    return [i[1:-1] if len(i) >= 2 and i[0] == i[-1] and i[0] in "'\"" else i for i in items]


def _is_structured(ann: Any) -> bool:
    inner, _ = strip_optional(ann)
    return is_model(inner) or get_origin(inner) is dict or union_branches((ann, None)) is not None


def coerce(raw: str, node: Node, key: str) -> Any:
    """Convert override text to the Python value of the schema type at `node`."""
    ann, _ = node
    inner, nullable = strip_optional(ann)
    origin = get_origin(inner)
    text = raw.strip()
    if nullable and text.lower() in NULLS:
        return None
    if union_branches(node) is not None or _is_structured(ann):
        value = parse_yaml(raw, COMMAND_LINE)
        if not isinstance(value, dict):
            raise _error(key, raw, node)
        return value
    if origin is Literal:
        for choice in get_args(inner):
            if str(choice) == text:
                return choice
        choices = [str(c) for c in get_args(inner)]
        raise _error(key, raw, node, suggestion=suggest(text, choices))
    if inner is bool:
        if text.lower() in TRUE | FALSE:
            return text.lower() in TRUE
        raise _error(key, raw, node)
    if inner in (int, float):
        try:
            return inner(text)
        except ValueError:
            raise _error(key, raw, node) from None
    if inner is str:
        return raw
    if origin in (list, tuple, set, frozenset):
        return _coerce_list(raw, node, key)
    if origin is Union:
        members = sorted(get_args(inner), key=lambda m: m is str)
        for member in members:
            try:
                return coerce(raw, (member, None), key)
            except ConfigError:
                continue
        raise _error(key, raw, node)
    return raw


def _coerce_list(raw: str, node: Node, key: str) -> list[Any]:
    inner, _ = strip_optional(node[0])
    args = get_args(inner)
    if any(_is_structured(a) for a in args if a is not Ellipsis):
        value = parse_yaml(raw, COMMAND_LINE)
        if not isinstance(value, list):
            raise _error(key, raw, node)
        return value
    items = _split_list(raw)
    if items is None:
        raise _error(key, raw, node, problem=f"invalid value {raw!r}: write a list as [a,b]")
    fixed = get_origin(inner) is tuple and not (len(args) == 2 and args[1] is Ellipsis)
    if fixed and len(items) != len(args):
        raise _error(key, raw, node, problem=f"{len(items)} item(s) given, {len(args)} needed")
    elems = args if fixed else [args[0]] * len(items)
    return [
        coerce(item, (elem, annotated_info(elem)), f"{key}.{i}")
        for i, (item, elem) in enumerate(zip(items, elems))
    ]


def _assign(data: dict[str, Any], path: Sequence[str | int], value: Any) -> None:
    here: Any = data
    for part, nxt in zip(path[:-1], path[1:]):
        if isinstance(part, int):
            here = here[part]
            continue
        empty: Any = [] if isinstance(nxt, int) else {}
        if not isinstance(here.get(part), type(empty)):
            here[part] = empty
        here = here[part]
    last = path[-1]
    if isinstance(value, dict) and isinstance(_child(here, last), dict):
        deep_merge(here[last], value)
    else:
        here[last] = value


def apply_overrides(
    data: dict[str, Any], overrides: Sequence[str], provenance: dict[str, str] | None = None
) -> dict[str, Any]:
    """Apply `key=value` overrides to merged config `data` in place (in order; last wins).

    All overrides are syntax-checked before any is applied. `provenance` is updated so
    validation errors on overridden keys name `<command line>`.
    """
    parsed = [parse_override(text) for text in overrides]
    pending = {o.key: o.raw for o in parsed}
    for override in parsed:
        node, path = resolve_target(override.key, data, pending)
        _assign(data, path, coerce(override.raw, node, override.key))
        if provenance is not None:
            for k in [k for k in provenance if k.startswith(override.key + ".")]:
                del provenance[k]
            provenance[override.key] = COMMAND_LINE
    return data
