"""The config reference: every field of the schema with its dotted key, type, default and
description, read from the pydantic models (`uniweave config describe`, `docs/config.md`).

Keys: a nested section's fields are `section.sub.field`; the items of a list of
settings are `section.list.<i>.field` (as overrides write them, `reward.plugins.0.name`);
each variant of a discriminated union (`algorithm`, by `name`) is listed under
`algorithm[<name>].field` (e.g. `algorithm[grpo].clip_eps`), and in a config or an
override the key is written without the brackets (`algorithm.clip_eps=0.2` with
`algorithm.name=grpo`). `describe KEY` accepts either spelling.

`docs/config.md` is `markdown()` (regenerate it with
`python -m uniweave config describe --markdown > docs/config.md`); tests/test_config_reference.py
fails when it is stale. Light: imports only the config package (no torch).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from uniweave.config.acts import conditions
from uniweave.config.errors import ConfigError, suggest
from uniweave.config.introspect import (
    Node,
    describe,
    field_node,
    is_model,
    strip_optional,
    union_branches,
)
from uniweave.config.methods import method
from uniweave.config.schema import UniweaveConfig

SECTION = "(section)"


@dataclass(frozen=True)
class FieldDoc:
    """One field of the schema: dotted key, type (as error messages word it), default
    (YAML-like text; `required` when there is none) and description."""

    key: str
    type: str
    default: str
    description: str
    acts: str = ""
    """When it acts ("Acts only with ..."; `uniweave.config.acts`), "" = in every run."""


def _default_text(value: Any) -> str:
    if isinstance(value, BaseModel):
        return SECTION
    if isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
        value = [v.model_dump(mode="json") for v in value]
    return json.dumps(value, default=str) if value is not None else "null"


def _default(info) -> str:
    if info.default_factory is not None:
        return _default_text(info.default_factory())
    if info.default is PydanticUndefined:
        return "required"
    return _default_text(info.default)


def _list_item_model(node: Node) -> type[BaseModel] | None:
    inner, _ = strip_optional(node[0])
    if get_origin(inner) in (list, tuple):
        args = get_args(inner)
        if args and is_model(strip_optional(args[0])[0]):
            return strip_optional(args[0])[0]
    return None


def field_docs(
    model: type[BaseModel] = UniweaveConfig, prefix: str = "", own: str | None = None
) -> Iterator[FieldDoc]:
    """Every field under `model`, depth first in schema order (module docstring: keys);
    `own`: the method whose `algorithm` variant this is (its spec's `acts_when`)."""
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        node = field_node(model, name)
        union = union_branches(node)
        if info.description is None:
            raise ValueError(f"config field {key} has no description")
        rules = ()
        if own is not None:
            rules = method(own).acts_when.get(key.split("].", 1)[1], ())
        acts = conditions(model, name, rules)
        yield FieldDoc(key, describe(node), _default(info), info.description, acts)
        if union is not None:
            for tag, branch in union[1].items():
                yield from field_docs(branch, f"{key}[{tag}].", tag)
            continue
        inner, _ = strip_optional(node[0])
        if is_model(inner):
            yield from field_docs(inner, f"{key}.", own)
        item = _list_item_model(node)
        if item is not None:
            yield from field_docs(item, f"{key}.<i>.", own)


def _plain(key: str) -> str:
    """`algorithm[grpo].clip_eps` -> `algorithm.clip_eps`."""
    return re.sub(r"\[[^\]]*\]", "", key)


def lookup(key: str | None) -> list[FieldDoc]:
    """The fields `key` names: itself (either spelling; every union variant that has it)
    and everything under it; all fields for None. ConfigError (with a near miss) when
    `key` names none."""
    docs = list(field_docs())
    if not key:
        return docs
    key = key.strip()
    found = [
        d
        for d in docs
        for k in (d.key, _plain(d.key))
        if k == key or k.startswith(key + ".") or k.startswith(key + "[")
    ]
    found = list(dict.fromkeys(found))
    if not found:
        keys = sorted({_plain(d.key) for d in docs} | {d.key for d in docs})
        raise ConfigError(
            "no such config key (see 'uniweave config describe' for all of them)",
            key=key,
            source="<command line>",
            suggestion=_near_miss(key, keys),
        )
    return found


def _near_miss(key: str, keys: list[str]) -> str | None:
    """The closest key: by its last part among the keys of the same section first
    (`trainer.learning_rate` -> `trainer.optimizer.lr`), then by the whole key."""
    top, _, rest = key.partition(".")
    last = key.rsplit(".", 1)[-1]
    same = [k for k in keys if k.startswith(top + ".") or k.startswith(top + "[")]
    leaves = {k.rsplit(".", 1)[-1] for k in same}
    leaf = suggest(last, leaves) if rest else None
    if leaf is not None:
        return min((k for k in same if k.rsplit(".", 1)[-1] == leaf), key=len)
    return suggest(key, keys)


def text(docs: list[FieldDoc]) -> str:
    """A plain listing: the key, then type, default and description indented."""
    out = []
    for d in docs:
        acts = f"  {d.acts}\n" if d.acts else ""
        out.append(f"{d.key}\n  type: {d.type}\n  default: {d.default}\n  {d.description}\n{acts}")
    return "\n".join(out)


def _cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def markdown(docs: list[FieldDoc] | None = None) -> str:
    """`docs/config.md`: one table per top-level section."""
    docs = list(field_docs()) if docs is None else docs
    lines = [
        "# Config reference",
        "",
        "<!-- generated by `python -m uniweave config describe --markdown > docs/config.md`; "
        "do not edit (tests/test_config_reference.py checks it) -->",
        "",
        "Every field of the config schema: its dotted key, type, default and description "
        "(`uniweave config describe [KEY]` prints the same from the schema). Variants of "
        "`algorithm` are listed as `algorithm[<name>].field`; in a config or an override "
        "write `algorithm.field` with `algorithm.name: <name>`. Items of a list of settings "
        "are `key.<i>.field` (`reward.plugins.0.name=mc_exact`). *Acts only ...*: the "
        "runs in which a setting acts (`uniweave.config.acts`); given anywhere else with "
        "a value other than its default, it is refused (exit 2, naming the key).",
    ]
    section = None
    for d in docs:
        top = re.split(r"[.\[]", d.key, maxsplit=1)[0]
        if top != section:
            section = top
            lines += [
                "",
                f"## `{top}`",
                "",
                "| key | type | default | description |",
                "|---|---|---|---|",
            ]
        about = f"{d.description} *{d.acts}*" if d.acts else d.description
        cells = [f"`{d.key}`", _cell(d.type), f"`{_cell(d.default)}`", _cell(about)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


__all__ = ["FieldDoc", "field_docs", "lookup", "markdown", "text"]
