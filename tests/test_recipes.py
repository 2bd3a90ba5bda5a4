"""Recipes run from a fresh clone: every recipe's header names what must run first
(`# needs:`) and what it reads (`# input:`); `make recipes-check` (tests/recipe_chains.py)
runs every chain for 2 updates; the README's recipe table lists every recipe."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import recipe_chains as rc

from uniweave.config import load_config

README = rc.ROOT / "README.md"


def _paths_read(cfg) -> dict[str, str | None]:
    """The dotted keys of `cfg` that name a checkpoint or codec a run reads."""
    teacher = getattr(cfg.algorithm, "teacher", None)
    return {
        "model.path": cfg.model.path,
        "model.codec.path": cfg.model.codec.path,
        "algorithm.teacher.path": teacher.path if teacher is not None else None,
    }


def _made_by(step: rc.Step) -> set[str]:
    """What `uniweave train STEP` writes that a later recipe may read."""
    out = load_config(rc.ROOT / step.recipe, list(step.overrides)).run.output_dir
    return {f"{out}/model", f"{out}/codec"}


def test_every_recipe_has_a_header_whose_needs_exist_and_load():
    recipes = rc.all_recipes()
    assert len(recipes) >= 24
    for recipe in recipes:
        head = rc.header(recipe)  # ValueError without '# needs:' and '# input:'
        assert head.input, recipe
        for need in head.needs:
            assert need.recipe in recipes, f"{recipe}: needs {need.recipe}, not a recipe"
            load_config(rc.ROOT / need.recipe, list(need.overrides))  # the command is valid


def test_no_recipe_reads_a_path_nothing_creates():
    """A relative checkpoint/codec path is written by a step of the recipe's chain; a data
    path ships in the repository; anything else is declared external in `# input:`."""
    for recipe in rc.all_recipes():
        head = rc.header(recipe)
        steps = rc.chain(recipe)
        overrides = rc.placeholders(head.input) if head.external else []
        cfg = load_config(rc.ROOT / recipe, overrides)
        made = set().union(*(_made_by(s) for s in steps[:-1]))
        for key, value in _paths_read(cfg).items():
            if value is None or value.startswith("/external/"):
                continue
            assert value in made, f"{recipe}: {key}={value} is made by no step of {steps}"
        for key in ("path", "val_path", "test_path"):
            value = getattr(cfg.data, key)
            if value is not None and not value.startswith("/external/"):
                assert (rc.ROOT / value).exists(), f"{recipe}: data.{key}={value} does not ship"


def test_readme_recipe_table_lists_every_recipe():
    text = README.read_text()
    start = text.index("## Recipes")
    table = text[start : text.index("\n## ", start + 1)]
    listed = set(re.findall(r"`(recipes/[\w/]+\.yaml)`", table))
    assert set(rc.all_recipes()) <= listed, sorted(set(rc.all_recipes()) - listed)
    assert listed <= set(rc.all_recipes()), sorted(listed - set(rc.all_recipes()))


@pytest.mark.slow
def test_every_recipe_chain_runs_two_updates_from_a_fresh_clone(tmp_path: Path):
    """`make recipes-check`: each chain in a copy of recipes/ and examples/, 2 updates."""
    failures = rc.check(rc.all_recipes(), tmp_path, log=lambda line: None)
    assert not failures, "\n".join(failures)
