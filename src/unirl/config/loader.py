"""`load_config`: files + `defaults:` inheritance + command-line overrides -> `UnirlConfig`.

Loading only reads files: it never creates the run directory or anything else, so a bad
config fails before any side effect.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from unirl.config.overrides import apply_overrides, parse_override
from unirl.config.schema import UnirlConfig
from unirl.config.validation import source_of, validate_config
from unirl.config.yaml_io import read_config_tree


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> UnirlConfig:
    """Load and validate the config at `path` with `key=value` `overrides` applied in order.

    Raises `ConfigError` (one line naming the file or `<command line>`, the dotted key and
    what was expected) for a bad override, a missing file, YAML syntax, an unknown key, a
    wrong type or an incompatible combination. Override syntax is checked first.
    """
    for text in overrides:
        parse_override(text)
    data, provenance = read_config_tree(path)
    apply_overrides(data, overrides, provenance)
    return validate_config(data, provenance, source=os.path.normpath(str(path)))


def key_source(path: str | os.PathLike[str], overrides: Sequence[str], key: str) -> str:
    """The file (or `<command line>`) that set dotted `key` of the config at `path` with
    `overrides`, or that file itself when the key took its default: where an error found
    after loading (a reward plugin, a model path) should point."""
    data, provenance = read_config_tree(path)
    apply_overrides(data, overrides, provenance)
    return source_of(key, provenance, os.path.normpath(str(path)))
