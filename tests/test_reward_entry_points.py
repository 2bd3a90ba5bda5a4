"""Reward plugins from other packages (`uniweave.rewards` entry points): the example package
of examples/reward_plugin, pip-installed offline into a temporary directory (never into
the venv), is found by name after the built-ins and trains a recipe-like config for 2
GRPO updates with uniweave's source unchanged; unknown names list the known ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from uniweave.config import ConfigError
from uniweave.config.schema import RewardPluginConfig
from uniweave.rewards.plugins import PLUGINS, build_plugin, plugin_class

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reward_plugin"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example package installed with pip into a temporary `--target` directory:
    offline (no index, no build isolation, no dependencies), from a copy so that the
    build leaves nothing in the repository."""
    tmp = tmp_path_factory.mktemp("plugin")
    src = shutil.copytree(
        EXAMPLE, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    target = tmp / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps"]
    cmd += ["--no-index", "--no-cache-dir", "--disable-pip-version-check", "-q"]
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    proc = subprocess.run(
        [*cmd, "--target", str(target), str(src)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return target


@pytest.fixture
def on_path(site, monkeypatch):
    """The installed example importable and its entry points visible in this process."""
    monkeypatch.syspath_prepend(str(site))
    yield site
    sys.modules.pop("uniweave_reward_contains", None)


def test_an_installed_plugin_is_found_after_the_builtins_and_scores(on_path):
    from uniweave.core.sample import Sample, TextPart
    from uniweave.rewards.base import Response

    cls = plugin_class("contains_answer")
    assert cls.__module__ == "uniweave_reward_contains" and "contains_answer" not in PLUGINS
    plugin = build_plugin(
        RewardPluginConfig(name="contains_answer", kwargs={"case_sensitive": True})
    )
    samples = [
        Sample(id=f"s{i}", task="q", parts=[TextPart("q?", "user")], answer=a)
        for i, a in enumerate(["7", "7", "seven", "7", "x"])
    ]
    texts = ["it is 7.", "17", "Seven", "", "X"]
    responses = [Response((TextPart(t, "assistant"),)) for t in texts]
    # by hand: whole-word "7" in "it is 7."; not in "17"; case-sensitive "seven" != "Seven"
    assert plugin.score(samples, responses) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert plugin.invalid_format(samples, responses) == [False, False, False, True, False]
    with pytest.raises(
        ConfigError,
        match=r"reward\.plugins\.0\.kwargs\.colour: plugin 'contains_answer' has no option",
    ):
        build_plugin(RewardPluginConfig(name="contains_answer", kwargs={"colour": 1}))
    # a built-in name always means the built-in
    assert plugin_class("mc_exact") is PLUGINS["mc_exact"]


def test_an_unknown_name_is_one_line_listing_the_known_ones(on_path):
    with pytest.raises(ConfigError) as err:
        build_plugin(RewardPluginConfig(name="contains_answr"), "reward.plugins.3")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("<config>: reward.plugins.3.name: unknown reward plugin 'contains_answr'")
    assert "built-in " + ", ".join(sorted(PLUGINS)) in msg
    assert "installed contains_answer" in msg and "did you mean 'contains_answer'" in msg


def test_a_recipe_with_the_installed_plugin_trains_two_updates(
    on_path, tmp_path, monkeypatch, small_vq_dir
):
    """`uniweave train` of the example recipe (in process, as `make recipes-check` runs
    recipes; the package is on sys.path only): 2 GRPO updates scored by the plugin, its
    metrics logged under its name, and the final evaluation scored by it too."""
    from uniweave.cli import main

    out = tmp_path / "run"
    overrides = [
        f"run.output_dir={out}",
        "trainer.total_updates=2",
        "trainer.global_batch_size=16",
        "trainer.micro_batch_size=16",
        "trainer.scheduler.warmup_steps=0",
        "model.tiny.hidden_size=32",
        "model.tiny.num_layers=1",
        "model.tiny.num_heads=2",
        "model.codec.codebook_size=16",
        f"model.codec.path={small_vq_dir}",  # the session's fitted codec (no fit here)
        "data.train_size=16",
        "data.val_size=0",
        "data.test_size=4",
        "checkpoint.every_updates=0",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "logging.every=1",
    ]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CI", "true")
    assert main(["train", str(EXAMPLE / "grpo_contains_answer.yaml"), *overrides]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "reward/contains_answer/mean" in r]
    assert len(updates) == 2, rows
    assert all(0.0 <= r["reward/contains_answer/mean"] <= 1.0 for r in updates)
    # the groups' diversity is logged during training (2 prompts of G = 8 per update)
    assert all(r["diversity/i2t_open/text_groups"] == 2.0 for r in updates)
    assert all(1.0 <= r["diversity/i2t_open/distinct_answers"] <= 8.0 for r in updates)
    assert "i2t_open/contains_answer/mean" in (out / "eval.json").read_text()
