"""Reading YAML config files with `defaults:` inheritance and key provenance.

A file may name base files in a top-level `defaults:` (one path or a list, relative to the
file). Bases are merged in order, then the file's own keys on top: mappings merge
recursively, every other value (lists included) is replaced by the later one. Chains of any
depth work; a file that (transitively) inherits from itself is an error naming the loop.
Switching `algorithm.name` in a child keeps the base's other `algorithm` keys, which the
new algorithm may reject as unknown: a config says exactly what it means.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from uniweave.config.errors import ConfigError

DEFAULTS_KEY = "defaults"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (PyYAML keeps the last silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark
            ) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text; syntax errors become a `ConfigError` with line and column."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(
            f"YAML syntax error: {problem}",
            source=source,
            line=mark.line + 1 if mark else None,
            column=mark.column + 1 if mark else None,
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"YAML error: {exc}", source=source) from exc


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Merge `override` into `base` in place (mappings recurse; other values replace)."""
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def record_provenance(data: Mapping[str, Any], source: str, prefix: str = "") -> dict[str, str]:
    """`{dotted key: source}` for every key in `data`, sections included."""
    out: dict[str, str] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(
                f"keys must be strings, got {key!r}", key=prefix.rstrip(".") or None, source=source
            )
        dotted = f"{prefix}{key}"
        out[dotted] = source
        if isinstance(value, Mapping):
            out.update(record_provenance(value, source, f"{dotted}."))
    return out


def _display(path: Path) -> str:
    return os.path.normpath(str(path))


def _defaults_list(value: Any, source: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return value
    raise ConfigError(
        f"invalid value {value!r}",
        key=DEFAULTS_KEY,
        source=source,
        expected="a file path or a list of file paths (relative to this file)",
    )


def read_config_tree(
    path: str | os.PathLike[str], _chain: tuple[tuple[Path, str], ...] = ()
) -> tuple[dict[str, Any], dict[str, str]]:
    """Read `path` and its `defaults:` bases: `(merged data, {dotted key: source file})`.

    Only reads: never creates, writes or resolves anything but the given files.
    """
    path = Path(path)
    source = _display(path)
    chain = (*_chain, (path.resolve(), source))
    if not path.is_file():
        problem = "is a directory, not a config file" if path.is_dir() else "file not found"
        if not _chain and not path.exists():
            problem += " (nor a packaged recipe of that name: `uniweave recipes` lists them)"
        raise ConfigError(problem, source=source)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read file: {exc}", source=source) from exc
    data = parse_yaml(text, source)
    if data is None:
        raise ConfigError(
            "empty config file",
            source=source,
            expected="a mapping of sections (write `run: {}` to mean all defaults)",
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"the top level must be a mapping of sections, got {type(data).__name__}",
            source=source,
        )
    bases = _defaults_list(data.pop(DEFAULTS_KEY, None), source)
    merged: dict[str, Any] = {}
    provenance: dict[str, str] = {}
    for base in bases:
        base_path = path.parent / base
        if not base_path.exists():
            raise ConfigError(
                f"base file not found: {_display(base_path)}", key=DEFAULTS_KEY, source=source
            )
        resolved = [r for r, _ in chain]
        if base_path.resolve() in resolved:
            loop = [name for _, name in chain[resolved.index(base_path.resolve()) :]]
            raise ConfigError(
                "inheritance loop: " + " -> ".join([*loop, _display(base_path)]),
                key=DEFAULTS_KEY,
                source=source,
            )
        base_data, base_provenance = read_config_tree(base_path, chain)
        deep_merge(merged, base_data)
        provenance.update(base_provenance)
    provenance.update(record_provenance(data, source))
    deep_merge(merged, data)
    return merged, provenance
