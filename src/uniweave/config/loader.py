"""`load_config`: files + `defaults:` inheritance + command-line overrides -> `UniweaveConfig`.

Loading only reads files: it never creates the run directory or anything else, so a bad
config fails before any side effect.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from uniweave.config.errors import COMMAND_LINE
from uniweave.config.hashing import as_plain
from uniweave.config.overrides import apply_overrides, parse_override
from uniweave.config.packaged import resolve_package_paths, resolve_recipe
from uniweave.config.schema import UniweaveConfig
from uniweave.config.validation import source_of, validate_config
from uniweave.config.yaml_io import read_config_tree


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> UniweaveConfig:
    """Load and validate the config at `path` with `key=value` `overrides` applied in order.

    `path` may also name a packaged recipe (`digits/sft_vq`; an existing file wins), and
    a `package:REL` value names shipped data (`uniweave.config.packaged`).

    Raises `ConfigError` (one line naming the file or `<command line>`, the dotted key and
    what was expected) for a bad override, a missing file, YAML syntax, an unknown key, a
    wrong type or an incompatible combination. Override syntax is checked first.
    """
    for text in overrides:
        parse_override(text)
    path = resolve_recipe(path)
    data, provenance = read_config_tree(path)
    apply_overrides(data, overrides, provenance)
    resolve_package_paths(data)
    return validate_config(data, provenance, source=os.path.normpath(str(path)))


def key_source(path: str | os.PathLike[str], overrides: Sequence[str], key: str) -> str:
    """The file (or `<command line>`) that set dotted `key` of the config at `path` with
    `overrides`, or that file itself when the key took its default: where an error found
    after loading (a reward plugin, a model path) should point."""
    path = resolve_recipe(path)
    data, provenance = read_config_tree(path)
    apply_overrides(data, overrides, provenance)
    return source_of(key, provenance, os.path.normpath(str(path)))


DEFAULT = "default"
"""The source `config_sources` gives a value no file or override set."""


def config_sources(
    path: str | os.PathLike[str], overrides: Sequence[str] = ()
) -> tuple[UniweaveConfig, list[tuple[str, str, str]]]:
    """The config `load_config(path, overrides)` and, for every value of it (dotted key
    in schema order; a list is one value), `(key, value as compact JSON, source)`: the
    file that set it, `<command line>`, or `default` (`uniweave inspect --sources`)."""
    cfg = load_config(path, overrides)
    path = resolve_recipe(path)
    data, provenance = read_config_tree(path)
    apply_overrides(data, overrides, provenance)
    rows: list[tuple[str, str, str]] = []

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict) and value:
            for name, child in value.items():
                walk(child, f"{key}.{name}" if key else name)
            return
        rows.append((key, json.dumps(value, separators=(",", ":")), _source(key, provenance)))

    walk(as_plain(cfg), "")
    return cfg, rows


def _source(key: str, provenance: dict[str, str]) -> str:
    """Who set `key`: its own entry, else an override that replaced an enclosing
    section, else the default (a section a file names does not set its other keys)."""
    if key in provenance:
        return provenance[key]
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        if provenance.get(".".join(parts[:n])) == COMMAND_LINE:
            return COMMAND_LINE
    return DEFAULT
