"""Hub ids for model directories (`uniweave.config.hub`): resolved from a hub cache laid out
as huggingface_hub lays it out (`models--org--name/{blobs,refs/main,snapshots/<rev>/}`,
snapshot files symlinked to blobs), `HF_HUB_OFFLINE` honoured, one-line errors naming
the key and the id."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from uniweave import cli
from uniweave.config import ConfigError, load_config
from uniweave.config.hub import is_hub_id, resolve, resolve_hub_ids
from uniweave.models.full_shape import write_full_shape

pytestmark = pytest.mark.usefixtures("one_thread")

GRPO = "recipes/janus_pro/grpo_t2i_pickscore_lora.yaml"
OPD = "recipes/janus_pro/opd_i2t_mc_lora.yaml"
REV = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parents[1]


def cache_repo(cache: Path, repo_id: str, source: Path, rev: str = REV) -> Path:
    """Put the files of `source` into `cache` as the hub client does; the snapshot dir."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> tuple[Path, Path]:
    """(cache dir, snapshot dir) holding `acme/janus-small`, a small Janus-Pro."""
    root = tmp_path_factory.mktemp("hub")
    source = write_full_shape("janus-pro-1b", root / "src", "small").path
    cache = root / "cache"
    return cache, cache_repo(cache, "acme/janus-small", source)


@pytest.fixture
def offline(hub, monkeypatch, tmp_path):
    cache, _ = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    return hub


def test_what_counts_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("deepseek-community/Janus-Pro-1B")
    assert not is_hub_id("runs/sft/model")  # two slashes: a path
    assert not is_hub_id("./org/name") and not is_hub_id("/org/name")
    (tmp_path / "runs").mkdir()
    assert not is_hub_id("runs/model")  # a local directory 'runs' exists: a local path
    assert resolve("runs/model", "model.path") == "runs/model"
    assert resolve(None, "model.path") is None


def test_a_cached_id_resolves_to_its_snapshot_offline(offline):
    _, snapshot = offline
    assert resolve("acme/janus-small", "model.path") == str(snapshot)
    cfg = load_config(
        OPD, ["model.path=acme/janus-small", "algorithm.teacher.path=acme/janus-small"]
    )
    out = resolve_hub_ids(cfg)
    assert out.model.path == str(snapshot) and out.algorithm.teacher.path == str(snapshot)
    cfg = load_config(GRPO, ["reward.plugins.0.path=acme/janus-small"])
    assert resolve_hub_ids(cfg).reward.plugins[0].path == str(snapshot)


def test_inspect_and_plan_take_a_hub_id(offline, capsys):
    _, snapshot = offline
    assert cli.main(["inspect", GRPO, "model.path=acme/janus-small"]) == 0
    assert f"path: {snapshot}" in capsys.readouterr().out
    assert cli.main(["plan", GRPO, "model.path=acme/janus-small"]) == 0
    assert f"model {snapshot}:" in capsys.readouterr().out


@pytest.mark.parametrize("key", ["model.path", "algorithm.teacher.path"])
def test_an_uncached_id_offline_is_one_line_naming_key_and_id(offline, key, capsys):
    other = {"model.path", "algorithm.teacher.path"} - {key}
    overrides = [f"{key}=acme/absent", *(f"{k}=acme/janus-small" for k in other)]
    cfg = load_config(OPD, overrides)
    with pytest.raises(ConfigError) as err:
        resolve_hub_ids(cfg)
    text = str(err.value)
    assert "acme/absent" in text and key in text and "HF_HUB_OFFLINE" in text
    assert "\n" not in text
    assert cli.main(["inspect", OPD, *overrides]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "acme/absent" in lines[0]


def test_an_uncached_unreachable_id_online_is_one_line(offline):
    """Not offline: the hub is asked, at an endpoint that refuses connections (a fresh
    process, since huggingface_hub reads HF_ENDPOINT when imported)."""
    cache, _ = offline
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(cache),
           "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2",
           "PYTHONPATH": str(ROOT / "src")}  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "uniweave", "inspect", GRPO, "model.path=acme/absent"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert "acme/absent" in lines[0] and "nor reachable on the hub" in lines[0]
