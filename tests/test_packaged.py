"""The recipes and example data shipped inside the package (`uniweave.config.packaged`): a
packaged recipe by name, `package:` data paths, `uniweave recipes` and `uniweave recipes copy`.
The wheel itself (built, installed outside the checkout, the README's commands run from
it) is tests/test_readme_commands.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from uniweave import cli
from uniweave.config import ConfigError, load_config
from uniweave.config.packaged import (
    assets_root,
    copy_recipe,
    recipe_names,
    recipes_root,
    resolve_package_paths,
)
from uniweave.config.yaml_io import DEFAULTS_KEY, parse_yaml


def test_every_packaged_recipe_loads_by_name_as_by_its_path(tmp_path, monkeypatch):
    """Run from a folder that holds no recipes: the name finds the packaged file, and the
    config equals the one loaded from the file's path. `package:` data paths resolve to
    files that exist (a recipe naming data the wheel lacks would fail here)."""
    monkeypatch.chdir(tmp_path)
    names = recipe_names()
    assert {"digits/sft_vq", "examples/own_data_tiny", "janus_pro/grpo_t2i_pickscore_lora"} <= set(
        names
    )
    for name in names:
        path = recipes_root() / f"{name}.yaml"
        try:
            by_path = load_config(path)
        except ConfigError as exc:  # a recipe that needs a path of yours (a teacher)
            with pytest.raises(ConfigError) as by_name_error:
                load_config(name)
            assert str(by_name_error.value) == str(exc)
            continue
        by_name = load_config(name)
        assert by_name == by_path == load_config(f"{name}.yaml"), name
        for value in (by_name.data.path, by_name.data.test_path):
            if value is not None and str(value).startswith(str(assets_root())):
                assert Path(value).is_file(), (name, value)


def test_an_existing_file_wins_over_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "digits").mkdir()
    (tmp_path / "digits" / "sft_vq.yaml").write_text("run: {name: mine}\n")
    assert load_config("digits/sft_vq.yaml").run.name == "mine"
    assert load_config("digits/sft_vq").run.name == "digits_sft_vq"  # no such file: packaged


def test_package_paths_resolve_in_overrides_and_name_the_key_when_missing():
    cfg = load_config("examples/sft_tiny", ["data.path=package:examples/shapes/shapes.jsonl"])
    assert str(cfg.data.path) == str(assets_root() / "examples" / "shapes" / "shapes.jsonl")
    with pytest.raises(ConfigError, match=r"data\.path: 'package:examples/nope\.jsonl': no such"):
        load_config("examples/sft_tiny", ["data.path=package:examples/nope.jsonl"])
    with pytest.raises(ConfigError, match="no such file"):  # no escape from the assets
        resolve_package_paths({"data": {"path": "package:../config/packaged.py"}})


def test_recipes_lists_every_name(capsys):
    assert cli.main(["recipes"]) == 0
    out = capsys.readouterr().out
    names = recipe_names()
    assert out.splitlines()[0].startswith(f"{len(names)} packaged recipes")
    listed = [line.split()[0] for line in out.splitlines()[1:]]
    assert listed == names


def test_recipes_copy_writes_the_recipe_and_its_bases_and_refuses_to_overwrite(tmp_path, capsys):
    dest = tmp_path / "mine"
    assert cli.main(["recipes", "copy", "examples/grpo_tiny_t2i_bsq", str(dest)]) == 0
    written = sorted(p.name for p in dest.iterdir())
    # grpo_tiny_t2i_bsq <- grpo_tiny <- base: the whole chain, where defaults: expects it
    assert written == ["base.yaml", "grpo_tiny.yaml", "grpo_tiny_t2i_bsq.yaml"]
    for name in written:
        assert (dest / name).read_bytes() == (recipes_root() / "examples" / name).read_bytes()
    child = parse_yaml((dest / "grpo_tiny_t2i_bsq.yaml").read_text(), "x")
    assert child[DEFAULTS_KEY] == "grpo_tiny.yaml"
    assert load_config(dest / "grpo_tiny_t2i_bsq.yaml") == load_config("examples/grpo_tiny_t2i_bsq")
    capsys.readouterr()

    # a second copy where one target exists: exit 2, one line, nothing written or changed
    other = tmp_path / "other"
    other.mkdir()
    (other / "base.yaml").write_text("mine\n")
    assert cli.main(["recipes", "copy", "examples/grpo_tiny_t2i_bsq", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to overwrite" in err and "base.yaml" in err
    assert sorted(p.name for p in other.iterdir()) == ["base.yaml"]
    assert (other / "base.yaml").read_text() == "mine\n"

    assert cli.main(["recipes", "copy", "digits/nope", str(tmp_path / "x")]) == 2
    assert "no packaged recipe 'digits/nope'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_copy_refuses_a_base_outside_the_recipe_folder(tmp_path, monkeypatch):
    """A packaged recipe whose defaults: climbs out of its folder cannot be copied as one
    folder: refused before anything is written."""
    root = tmp_path / "assets"
    (root / "recipes" / "a").mkdir(parents=True)
    (root / "recipes" / "b.yaml").write_text("run: {}\n")
    (root / "recipes" / "a" / "c.yaml").write_text("defaults: ../b.yaml\nrun: {}\n")
    monkeypatch.setattr("uniweave.config.packaged.assets_root", lambda: root)
    with pytest.raises(ConfigError, match="outside its folder"):
        copy_recipe("a/c", tmp_path / "out")
    assert not (tmp_path / "out").exists()
