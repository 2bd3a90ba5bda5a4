"""The recipes and example data that ship inside the package (`uniweave/assets/`).

A wheel carries `assets/recipes/**.yaml` and the small datasets the docs use
(`assets/examples/`), so everything the docs show runs from an installed package as well
as from a clone (where `recipes/` and the data folders of `examples/` link to them).

- A **recipe name** is a packaged recipe's path under `assets/recipes/` without `.yaml`
  (`digits/sft_vq`, `examples/own_data_tiny`). Every command that takes a config accepts
  one where a path would go: an existing file wins, then a packaged name
  (`resolve_recipe`). `uniweave recipes` lists them; `uniweave recipes copy NAME DIR` writes one
  and the files it inherits from (`defaults:`) for a user to edit.
- A **packaged path** is a config string `package:REL` (`package:examples/shapes/
  shapes.jsonl`): `load_config` replaces it with the absolute path of that file or folder
  inside the installed package, so a packaged recipe names its data wherever it runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from uniweave.config.errors import COMMAND_LINE, ConfigError

PACKAGE_PREFIX = "package:"
SUFFIX = ".yaml"


def assets_root() -> Path:
    """The package's `assets/` folder on disk (a wheel installs it as plain files)."""
    return Path(str(resources.files("uniweave"))) / "assets"


def recipes_root() -> Path:
    return assets_root() / "recipes"


def recipe_names() -> list[str]:
    """Every packaged recipe, by name, sorted."""
    root = recipes_root()
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*" + SUFFIX))


def recipe_summary(path: Path, width: int = 80) -> str:
    """A recipe's one-line description: the first line of its header comment that is not
    its `needs:` / `input:` line, an indented continuation or a command, cut at `width`."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text and not line.startswith("#  ") and not re.match(r"^(needs|input):", text):
            return text if len(text) <= width else text[: width - 3].rstrip() + "..."
    return ""


def packaged_recipe(name: str) -> Path | None:
    """The packaged recipe called `name` (with or without `.yaml`), or None."""
    rel = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
    if not rel or rel.startswith(("/", ".")) or ".." in Path(rel).parts:
        return None
    path = recipes_root() / (rel + SUFFIX)
    return path if path.is_file() else None


def resolve_recipe(config: str | os.PathLike[str]) -> Path:
    """The config file a command was given: an existing path as is, else the packaged
    recipe of that name; a path that is neither stays as given, so that reading it fails
    with the loader's own 'file not found' (whose message then names both forms)."""
    path = Path(config)
    if path.exists():
        return path
    return packaged_recipe(str(config)) or path


def resolve_package_paths(data: Any, key: str = "") -> Any:
    """`data` (a config mapping, in place) with every `package:REL` string replaced by the
    absolute path of REL under the package's assets. ConfigError naming the key for a
    REL that is not there."""
    if isinstance(data, dict):
        for name, value in data.items():
            data[name] = resolve_package_paths(value, f"{key}.{name}" if key else name)
        return data
    if isinstance(data, list):
        return [resolve_package_paths(v, f"{key}.{i}") for i, v in enumerate(data)]
    if isinstance(data, str) and data.startswith(PACKAGE_PREFIX):
        rel = data[len(PACKAGE_PREFIX) :]
        target = assets_root() / rel
        if not rel or ".." in Path(rel).parts or not target.exists():
            raise ConfigError(
                f"{data!r}: no such file or folder in the package's assets ({assets_root()})",
                key=key or None,
                expected="package:examples/... naming shipped data (`uniweave recipes` lists "
                "the recipes that use it)",
            )
        return str(target)
    return data


def _bases(path: Path) -> Iterator[Path]:
    """The files `path` inherits from (its `defaults:`, recursively), nearest first."""
    from uniweave.config.yaml_io import DEFAULTS_KEY, parse_yaml

    data = parse_yaml(path.read_text(encoding="utf-8"), str(path)) or {}
    bases = data.get(DEFAULTS_KEY) if isinstance(data, dict) else None
    for base in [bases] if isinstance(bases, str) else bases or []:
        base_path = (path.parent / base).resolve()
        yield base_path
        yield from _bases(base_path)


def copy_recipe(name: str, dest: Path) -> list[Path]:
    """Write the packaged recipe `name` and the files it inherits from into folder `dest`
    (each where the recipe's `defaults:` expects it, relative to the recipe) and return
    the written paths. Refuses, writing nothing, when a target file exists or a base lies
    outside the recipe's own folder."""
    source = packaged_recipe(name)
    if source is None:
        raise ConfigError(
            f"no packaged recipe {name!r}",
            source=COMMAND_LINE,
            expected="a name `uniweave recipes` lists (e.g. examples/own_data_tiny)",
        )
    files = [source.resolve(), *dict.fromkeys(_bases(source))]
    home = source.resolve().parent
    plan: list[tuple[Path, Path]] = []
    for src in files:
        try:
            rel = src.relative_to(home)
        except ValueError:
            raise ConfigError(
                f"{name}: inherits {src} from outside its folder; copy that recipe's folder "
                "by hand (`uniweave recipes` shows where the package keeps it)",
                source=COMMAND_LINE,
            ) from None
        plan.append((src, dest / rel))
    taken = [str(target) for _, target in plan if target.exists()]
    if taken:
        raise ConfigError(
            f"refusing to overwrite {', '.join(taken)}: nothing written", source=COMMAND_LINE
        )
    written = []
    for src, target in plan:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
        os.replace(tmp, target)
        written.append(target)
    return written
