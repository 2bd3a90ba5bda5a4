"""Walking pydantic field annotations: the schema is the source of truth for keys and types.

A *node* is a pair `(annotation, FieldInfo | None)`: the annotation of a value position in
the schema (a field, a list item, a dict value) and, for a field, its `FieldInfo` (holding
constraints and the discriminator of a tagged union).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Annotated, Any, Literal, TypeGuard, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

Node = tuple[Any, "FieldInfo | None"]


def strip_optional(ann: Any) -> tuple[Any, bool]:
    """`(ann without None and Annotated, whether None is allowed)`."""
    if get_origin(ann) is Annotated:
        return strip_optional(get_args(ann)[0])
    if get_origin(ann) in (Union, types.UnionType):
        members = [a for a in get_args(ann) if a is not type(None)]
        nullable = len(members) < len(get_args(ann))
        if len(members) == 1:
            inner, inner_nullable = strip_optional(members[0])
            return inner, nullable or inner_nullable
        return Union[tuple(members)], nullable
    return ann, False


def annotated_info(ann: Any) -> FieldInfo | None:
    """The FieldInfo carried by `Annotated[X, Field(...)]` (list items, tuple items)."""
    if get_origin(ann) is Annotated:
        infos = [m for m in get_args(ann)[1:] if isinstance(m, FieldInfo)]
        return infos[0] if infos else None
    return None


def is_model(ann: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def union_branches(node: Node) -> tuple[str, dict[Any, type[BaseModel]]] | None:
    """For a discriminated union node: `(discriminator, {tag: branch model})`, else None."""
    ann, info = node
    disc = info.discriminator if info is not None else None
    if disc is None:
        inner_info = annotated_info(ann)
        disc = inner_info.discriminator if inner_info is not None else None
    if not isinstance(disc, str):
        return None
    inner, _ = strip_optional(ann)
    branches: dict[Any, type[BaseModel]] = {}
    for member in get_args(inner):
        for tag in get_args(member.model_fields[disc].annotation):
            branches[tag] = member
    return disc, branches


def field_node(model: type[BaseModel], name: str) -> Node:
    info = model.model_fields[name]
    return info.annotation, info


def item_node(node: Node, item: Any) -> Node | None:
    """The node of `item` (a field name, list index or dict key) inside a non-union node."""
    inner, _ = strip_optional(node[0])
    origin = get_origin(inner)
    if is_model(inner):
        return field_node(inner, item) if item in inner.model_fields else None
    if origin in (list, set, frozenset) and isinstance(item, int):
        (elem,) = get_args(inner)
        return elem, annotated_info(elem)
    if origin is tuple and isinstance(item, int):
        args = get_args(inner)
        elem = args[0] if len(args) == 2 and args[1] is Ellipsis else args[min(item, len(args) - 1)]
        return elem, annotated_info(elem)
    if origin is dict:
        value = get_args(inner)[1]
        return value, annotated_info(value)
    return None


def loc_to_key(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, Node | None]:
    """Dotted key of a pydantic error location, dropping union tags and dict-key markers.

    Returns the key and the node it names (None once the path leaves the schema).
    """
    parts: list[str] = []
    node: Node | None = (root, None)
    parent: Node | None = None
    for item in loc:
        if item == "[key]":
            inner = strip_optional(parent[0])[0] if parent is not None else None
            node = (get_args(inner)[0], None) if get_origin(inner) is dict else None
            continue
        parent = node
        union = union_branches(node) if node is not None else None
        if union is not None and item in union[1]:
            node = (union[1][item], None)
            continue
        parts.append(str(item))
        node = item_node(node, item) if node is not None else None
    return ".".join(parts), node


def constraints(info: FieldInfo | None) -> str:
    """Human form of a field's numeric/length constraints, e.g. `> 0, <= 1`."""
    if info is None:
        return ""
    out = []
    for meta in info.metadata:
        for cls, attr, sign in (
            (at.Gt, "gt", ">"),
            (at.Ge, "ge", ">="),
            (at.Lt, "lt", "<"),
            (at.Le, "le", "<="),
        ):
            if isinstance(meta, cls):
                out.append(f"{sign} {getattr(meta, attr)}")
        if isinstance(meta, at.MinLen) and meta.min_length:
            out.append(f"length >= {meta.min_length}")
    return ", ".join(out)


def describe(node: Node) -> str:
    """What a value at `node` must be, e.g. `int (> 0)`, `one of 'fp32', 'bf16'`."""
    ann, info = node
    inner, nullable = strip_optional(ann)
    info = info if info is not None else annotated_info(ann)
    text = _describe_type(inner, node)
    cons = constraints(info)
    if cons:
        text += f" ({cons})"
    return text + (" or null" if nullable else "")


def _describe_type(inner: Any, node: Node) -> str:
    origin = get_origin(inner)
    union = union_branches(node)
    if union is not None:
        return f"a mapping whose {union[0]} is one of " + ", ".join(map(repr, union[1]))
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in get_args(inner))
    if is_model(inner):
        return "a mapping of settings"
    if origin in (list, set, frozenset):
        (elem,) = get_args(inner)
        return f"a list [a, b, ...] of {describe((elem, annotated_info(elem)))}"
    if origin is tuple:
        return "[" + ", ".join(describe((a, annotated_info(a))) for a in get_args(inner)) + "]"
    if origin is dict:
        key, value = get_args(inner)
        return f"a mapping of {describe((key, None))} to {describe((value, None))}"
    if origin in (Union, types.UnionType):
        return " or ".join(describe((a, None)) for a in get_args(inner))
    return getattr(inner, "__name__", str(inner))


def dotted_keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every dotted key of the schema (all union branches; containers not entered)."""
    for name in model.model_fields:
        key = f"{prefix}{name}"
        yield key
        node = field_node(model, name)
        union = union_branches(node)
        inner, _ = strip_optional(node[0])
        children = list(dict.fromkeys(union[1].values())) if union else []
        if not union and is_model(inner):
            children = [inner]
        seen: set[str] = set()
        for child in children:
            for sub in dotted_keys(child, f"{key}."):
                if sub not in seen:
                    seen.add(sub)
                    yield sub
