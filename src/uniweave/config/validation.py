"""Validate merged config data against the schema; pydantic errors become `ConfigError`s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError

from uniweave.config.base import INCOMPATIBLE
from uniweave.config.errors import KEY_SYNONYMS, ConfigError, suggest
from uniweave.config.introspect import (
    Node,
    describe,
    dotted_keys,
    is_model,
    loc_to_key,
    strip_optional,
    union_branches,
)
from uniweave.config.schema import UniweaveConfig

Provenance = Mapping[str, str]


def source_of(key: str, provenance: Provenance, default: str) -> str:
    """The file that set `key` or its closest enclosing section, else `default`."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in provenance:
            return provenance[prefix]
    return default


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unknown_key_error(
    root: type[BaseModel], parent_key: str, parent: type[BaseModel], name: str, source: str
) -> ConfigError:
    """`name` is not a field of `parent` (at `parent_key`): name the valid keys and suggest one.

    The suggestion is the closest sibling; failing that, the same name elsewhere in the schema
    (``trainer.temperature`` -> ``rollout.temperature``).
    """
    names = list(parent.model_fields)
    close = suggest(name, names)
    suggestion: str | None
    if close is not None:
        suggestion = join_key(parent_key, close)
    else:
        suggestion = suggest_anywhere(root, parent_key, name)
    return ConfigError(
        "unknown key",
        key=join_key(parent_key, name),
        source=source,
        expected=f"a key of {parent_key or 'the top level'}: {', '.join(names)}",
        suggestion=suggestion,
    )


def suggest_anywhere(root: type[BaseModel], parent_key: str, name: str) -> str | None:
    """The dotted key, in any section, whose last part is `name`, its schema name
    (`KEY_SYNONYMS`: learning_rate -> lr) or the closest to it (`suggest`); one under
    `parent_key` first (``trainer.learning_rate`` -> ``trainer.optimizer.lr``), then the
    first in schema order (``trainer.temperature`` -> ``rollout.temperature``)."""
    keys = list(dict.fromkeys(dotted_keys(root)))
    leaves = list(dict.fromkeys(k.rsplit(".", 1)[-1] for k in keys))
    leaf = name if name in leaves else KEY_SYNONYMS.get(name)
    if leaf not in leaves:
        leaf = suggest(name, leaves)
    if leaf is None:
        return None
    matches = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    under = [k for k in matches if parent_key and k.startswith(parent_key + ".")]
    return (under or matches)[0]


def literal_choices(node: Node | None) -> tuple[Any, ...]:
    if node is None:
        return ()
    inner, _ = strip_optional(node[0])
    return get_args(inner) if get_origin(inner) is Literal else ()


def from_validation_error(
    exc: ValidationError,
    provenance: Provenance,
    default_source: str,
    root: type[BaseModel] = UniweaveConfig,
) -> ConfigError:
    """Turn the first error of `exc` into a one-line `ConfigError` (counting the others)."""
    errors = exc.errors(include_url=False)
    err, more = errors[0], len(errors) - 1
    loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
    key, node = loc_to_key(root, loc)
    expected = suggestion = None
    if kind == INCOMPATIBLE:
        section = key
        key = join_key(section, ctx["field"])
        problem = ctx["detail"]
        for other in ctx.get("also", ()):
            other = join_key(section, other)
            problem += f" ({other} set in {source_of(other, provenance, 'the defaults')})"
    elif kind in ("union_tag_invalid", "union_tag_not_found"):
        union = union_branches(node) if node is not None else None
        assert union is not None, "pydantic reports a union tag error at a union node"
        disc, branches = union
        key = join_key(key, disc)
        expected = "one of " + ", ".join(map(repr, branches))
        if kind == "union_tag_invalid":
            problem = f"unknown {disc} {short_repr(ctx['tag'])}"
            suggestion = suggest(str(ctx["tag"]), [str(t) for t in branches])
        else:
            problem = f"missing (the {disc} selects the section's schema)"
    elif kind == "extra_forbidden":
        parent_key, parent = loc_to_key(root, loc[:-1])
        parent_model = strip_optional(parent[0])[0] if parent is not None else None
        if is_model(parent_model):
            error = unknown_key_error(root, parent_key, parent_model, str(loc[-1]), "<config>")
            expected, suggestion, problem = error.expected, error.suggestion, error.problem
        else:
            problem = "unknown key"
    elif kind == "missing":
        problem = "required key is missing"
        expected = describe(node) if node is not None else None
    else:
        choices = literal_choices(node)
        problem = f"invalid value {short_repr(err['input'])}"
        if choices:
            suggestion = suggest(str(err["input"]), [str(c) for c in choices])
        else:
            msg = err["msg"].removeprefix("Value error, ")
            problem += f": {msg[:1].lower()}{msg[1:]}"
            if kind == "string_type" and not isinstance(err["input"], (dict, list)):
                problem += " (quote the value in YAML)"
        expected = describe(node) if node is not None else None
    return ConfigError(
        problem,
        key=key,
        source=source_of(key, provenance, default_source),
        expected=expected,
        suggestion=suggestion,
        more=more,
    )


def validate_config(
    data: Mapping[str, Any], provenance: Provenance | None = None, source: str = "<config>"
) -> UniweaveConfig:
    """Validate a merged config mapping into `UniweaveConfig`, or raise `ConfigError`.

    `provenance` maps dotted keys to the file (or `<command line>`) that set them; errors
    name the source of the offending key, falling back to `source`.
    """
    try:
        return UniweaveConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise from_validation_error(exc, provenance or {}, source) from exc
