"""Model kinds come from the model packages' own declarations (`kind.json`, read without
importing the package) and `register_model`; the `model` config section is checked against
them before anything is built (one line naming the key)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from uniweave import cli
from uniweave.config import ConfigError, validate_config
from uniweave.models import registry
from uniweave.models.janus_pro import JanusProModel
from uniweave.models.tiny import TinyUnifiedModel
from uniweave.models.uniar import UniARModel


@pytest.fixture
def planned(monkeypatch):
    """A kind declared but not built (what `uniar` was before issue 19)."""
    monkeypatch.setattr(registry, "_SPECS", dict(registry.discover()))
    registry.declare_planned_model("futurar", visual_heads=("bsq",), planned="a future model")


def check(model: dict) -> registry.ModelSpec:
    return registry.check_model_config(validate_config({"model": model}).model)


def test_builtin_packages_declare_their_kinds():
    specs = registry.discover()
    assert specs["tiny"].builds and specs["uniar"].builds and not specs["janus_pro"].builds
    assert specs["tiny"].load == TinyUnifiedModel.from_pretrained
    assert specs["tiny"].visual_heads == ("vq", "bsq") and specs["tiny"].build is not None
    assert specs["janus_pro"].load == JanusProModel.from_pretrained
    assert specs["janus_pro"].visual_heads == ("vq",) and specs["janus_pro"].build is None
    assert specs["janus_pro"].transformers_model_types == ("janus",)
    assert specs["uniar"].load == UniARModel.from_pretrained and specs["uniar"].build is not None
    assert specs["uniar"].visual_heads == ("bsq",)
    assert specs["uniar"].transformers_model_types == ("qwen3_vl",)


@pytest.mark.parametrize(
    ("model", "key", "fragment"),
    [
        (
            {"kind": "futurar", "path": "/ckpt", "visual_head": "bsq"},
            "model.kind",
            "not implemented yet",
        ),
        ({"kind": "nope"}, "model.kind", "unknown model kind 'nope'"),
        (
            {"kind": "janus_pro"},
            "model.path",
            "required: kind 'janus_pro' loads a local checkpoint",
        ),
        ({"kind": "janus_pro", "path": "/ckpt", "visual_head": "bsq"}, "model.visual_head", "'vq'"),
    ],
)
def test_model_section_is_checked_against_the_registration(planned, model, key, fragment):
    with pytest.raises(ConfigError) as info:
        check(model)
    assert info.value.key == key, str(info.value)
    assert fragment in str(info.value)
    if key == "model.kind":
        assert "expected janus_pro, tiny, uniar (planned: futurar)" in str(info.value)


def test_kind_must_match_the_model_directory(tmp_path):
    (tmp_path / registry.MODEL_CONFIG).write_text(json.dumps({"kind": "janus_pro"}))
    with pytest.raises(ConfigError, match="holds a 'janus_pro' model but model.kind is 'tiny'"):
        check({"kind": "tiny", "path": str(tmp_path)})
    assert check({"kind": "janus_pro", "path": str(tmp_path)}).kind == "janus_pro"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / registry.TRANSFORMERS_CONFIG).write_text(json.dumps({"model_type": "janus"}))
    assert registry.model_kind(hf) == "janus_pro"
    assert check({"kind": "tiny"}).build is not None


def test_registration_errors(monkeypatch):
    monkeypatch.setattr(registry, "_SPECS", dict(registry.discover()))
    with pytest.raises(ValueError, match="TinyUnifiedModel.kind is not 'other'"):
        registry.register_model("other", visual_heads=("vq",))(TinyUnifiedModel)
    with pytest.raises(ValueError, match="kind 'tiny' is registered twice"):
        registry.register_model("tiny", visual_heads=("vq",))(lambda path: None)
    with pytest.raises(ValueError, match=r"model_type \['janus'\] claimed by both"):
        registry.register_model("other", visual_heads=("vq",), transformers_model_types=("janus",))(
            lambda path: None
        )

    @registry.register_model("other", visual_heads=("bsq",))
    def load(path: Path):
        return path

    assert registry.model_spec("other").load is load


def test_cli_refuses_a_planned_kind_before_creating_anything(planned, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model: {kind: futurar, path: /ckpt, visual_head: bsq}\n")
    out = tmp_path / "run"
    for command in ("inspect", "train"):
        assert cli.main([command, str(config), f"run.output_dir={out}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"uniweave: error: {config}: model.kind: kind 'futurar'"), err
        assert "not implemented yet" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_declared_kind_is_imported_only_when_loaded(monkeypatch, tmp_path):
    """`kind.json` names the loader and builder; checking a config imports neither."""
    (tmp_path / "lazy_kind_plugin.py").write_text(
        "def load(path):\n    return ('loaded', path)\n\n"
        "def build(cfg, seed, codec_dir, tokenizer):\n    return ('built', seed)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    kind_file = tmp_path / registry.KIND_FILE
    kind_file.write_text(
        json.dumps(
            {
                "kind": "lazy",
                "load": "lazy_kind_plugin:load",
                "build": "lazy_kind_plugin:build",
                "visual_heads": ["bsq"],
                "transformers_model_types": ["lazy_hf"],
            }
        )
    )
    monkeypatch.setattr(registry, "_SPECS", dict(registry.discover()))
    registry._add(registry.read_kind_file(kind_file))
    spec = check({"kind": "lazy", "visual_head": "bsq"})
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / registry.TRANSFORMERS_CONFIG).write_text(json.dumps({"model_type": "lazy_hf"}))
    assert registry.model_kind(hf) == "lazy" and spec.builds
    assert "lazy_kind_plugin" not in sys.modules
    assert spec.build(None, 3, None, None) == ("built", 3)
    assert registry.load_model(hf) == ("loaded", hf)
    monkeypatch.delitem(sys.modules, "lazy_kind_plugin")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ({"kind": "x", "load": "m:f"}, "field visual_heads missing"),
        ({"kind": "x", "load": "m.f", "visual_heads": ["vq"]}, "field load must be a 'module:"),
        (
            {"kind": "x", "load": "m:f", "visual_heads": []},
            "field visual_heads must be a non-empty",
        ),
        ({"kind": "x", "load": "m:f", "visual_heads": ["vq"], "builder": "m:b"}, "unknown field"),
        ([], "expected a JSON object"),
    ],
)
def test_a_malformed_kind_file_is_refused_naming_the_field(tmp_path, text, fragment):
    kind_file = tmp_path / registry.KIND_FILE
    kind_file.write_text(json.dumps(text))
    with pytest.raises(ValueError, match=f"^{re.escape(str(kind_file))}: ") as info:
        registry.read_kind_file(kind_file)
    assert fragment in str(info.value)


def test_every_model_package_declares_its_kind():
    """A model package without a `kind.json` would be imported by every config check."""
    root = Path(registry.__file__).parent
    packages = [p.parent.name for p in root.glob("*/__init__.py")]
    assert packages and all((root / p / registry.KIND_FILE).is_file() for p in packages)
