"""The config system through the real loader: schema, inheritance, overrides, errors, hash."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from uniweave.config import (
    COMMAND_LINE,
    ConfigError,
    GRPOConfig,
    UniweaveConfig,
    canonical_json,
    config_hash,
    diff_configs,
    load_config,
    parse_override,
    resume_conflicts,
    short_hash,
    suggest,
    to_yaml,
    validate_config,
)
from uniweave.config.introspect import dotted_keys

EXAMPLES = Path(__file__).resolve().parents[1] / "recipes" / "examples"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def models(model: type[BaseModel]) -> set[type[BaseModel]]:
    from uniweave.config.introspect import field_node, is_model, strip_optional, union_branches

    found = {model}
    for name in model.model_fields:
        node = field_node(model, name)
        union = union_branches(node)
        inner, _ = strip_optional(node[0])
        children = list(union[1].values()) if union else ([inner] if is_model(inner) else [])
        for child in children:
            found |= models(child)
    return found


def test_every_field_has_type_default_and_description():
    all_models = models(UniweaveConfig)
    assert len(all_models) >= 20
    for model in all_models:
        assert model.model_config["extra"] == "forbid", model
        for name, info in model.model_fields.items():
            assert info.description and "\n" not in info.description, (model, name)
            assert not info.is_required(), (model, name)
            assert info.annotation is not None


def test_empty_file_is_refused_and_an_empty_section_is_the_default_config(tmp_path):
    for text in ("", "# nothing\n", "---\n"):
        with pytest.raises(ConfigError, match="empty config file") as err:
            load_config(write(tmp_path / "empty.yaml", text))
        assert str(err.value).startswith(str(tmp_path / "empty.yaml"))
    cfg = load_config(write(tmp_path / "run.yaml", "run: {}\n"))
    assert cfg == UniweaveConfig()
    assert cfg.run.output_dir == "runs/uniweave"
    assert cfg.algorithm.name == "sft"


def test_loading_creates_nothing(tmp_path):
    path = write(tmp_path / "c.yaml", f"run:\n  output_dir: {tmp_path / 'out' / 'deep'}\n")
    before = sorted(tmp_path.rglob("*"))
    cfg = load_config(path)
    assert cfg.run.output_dir == str(tmp_path / "out" / "deep")
    assert sorted(tmp_path.rglob("*")) == before


def test_defaults_inheritance_merges_deep_child_wins_lists_replace(tmp_path):
    write(
        tmp_path / "base" / "root.yaml",
        "run: {name: root, seed: 3}\ntrainer:\n  optimizer: {lr: 0.1, weight_decay: 0.5}\n"
        "data: {tasks: [t2i, i2t_mc]}\n",
    )
    write(
        tmp_path / "base" / "mid.yaml",
        "defaults: root.yaml\ntrainer:\n  optimizer: {lr: 0.2}\n  total_updates: 7\n",
    )
    write(tmp_path / "other.yaml", "logging: {every: 9}\nrun: {seed: 4}\n")
    child = write(
        tmp_path / "child.yaml",
        "defaults: [base/mid.yaml, other.yaml]\nrun: {name: child}\ndata: {tasks: [jigsaw_mc]}\n",
    )
    cfg = load_config(child)
    assert cfg.run.name == "child"  # child wins
    assert cfg.run.seed == 4  # later base wins over earlier
    assert cfg.trainer.optimizer.lr == 0.2  # mid over root
    assert cfg.trainer.optimizer.weight_decay == 0.5  # deep merge keeps root's sibling
    assert cfg.trainer.total_updates == 7
    assert cfg.logging.every == 9
    assert cfg.data.tasks == ["jigsaw_mc"]  # lists replace


def test_error_names_the_file_that_set_the_key(tmp_path):
    write(tmp_path / "base.yaml", "trainer: {micro_batch_size: -1}\n")
    child = write(tmp_path / "child.yaml", "defaults: base.yaml\nrun: {name: x}\n")
    with pytest.raises(ConfigError) as info:
        load_config(child)
    assert info.value.key == "trainer.micro_batch_size"
    assert info.value.source == str(tmp_path / "base.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(child, ["trainer.micro_batch_size=-2"])
    assert info.value.source == COMMAND_LINE


def test_override_values_are_typed_by_the_schema(tmp_path):
    path = write(tmp_path / "c.yaml", "algorithm: {name: sft}\n")
    cfg = load_config(
        path,
        [
            "run.name=123",
            "trainer.optimizer.lr=1e-4",
            "trainer.gradient_checkpointing=true",
            "logging.wandb=off",
            "data.tasks=[t2i, 'i2t_mc']",
            "trainer.optimizer.betas=[0.8,0.95]",
            "trainer.grad_clip=null",
            "model.path=123",
            "data.task_weights.t2i=2",
            "trainer.lora={enabled: true, r: 16}",
        ],
    )
    assert cfg.run.name == "123" and isinstance(cfg.run.name, str)
    assert cfg.run.output_dir == "runs/123"
    assert cfg.trainer.optimizer.lr == 1e-4 and isinstance(cfg.trainer.optimizer.lr, float)
    assert cfg.trainer.gradient_checkpointing is True
    assert cfg.logging.wandb is False
    assert cfg.data.tasks == ["t2i", "i2t_mc"]
    assert cfg.trainer.optimizer.betas == (0.8, 0.95)
    assert cfg.trainer.grad_clip is None
    assert cfg.model.path == "123"
    assert cfg.data.task_weights == {"t2i": 2.0}
    assert cfg.trainer.lora.enabled and cfg.trainer.lora.r == 16


def test_override_picks_the_union_branch_from_the_given_name(tmp_path):
    path = write(tmp_path / "c.yaml", "reward: {plugins: [{name: mc_exact}]}\n")
    # the branch comes from algorithm.name even when it is given after the branch's keys
    cfg = load_config(path, ["algorithm.std_ddof=0", "algorithm.name=grpo", "algorithm.eps=1e-8"])
    assert isinstance(cfg.algorithm, GRPOConfig)
    assert cfg.algorithm.std_ddof == 0 and cfg.algorithm.eps == 1e-8
    cfg = load_config(path, ["reward.plugins.0.weight=0.5", "reward.plugins.0.kwargs.k=3"])
    assert cfg.reward.plugins[0].weight == 0.5 and cfg.reward.plugins[0].kwargs == {"k": 3}
    with pytest.raises(ConfigError, match=r"algorithm\.group_size: unknown key"):
        load_config(path, ["algorithm.group_size=4"])  # the default branch is sft


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        (
            "trainer.optimizer.lerning_rate=1",
            "trainer.optimizer.lerning_rate",
            "'trainer.optimizer.lr'",
        ),
        ("trainer.temperature=0.5", "trainer.temperature", "did you mean 'rollout.temperature'"),
        # near-miss hints search every section (issue 30): a synonym, then the closest leaf,
        # one under the same section first
        ("trainer.learning_rate=1", "trainer.learning_rate", "did you mean 'trainer.optimizer.lr'"),
        ("trainer.warmup=3", "trainer.warmup", "did you mean 'trainer.scheduler.warmup_steps'"),
        ("trainer.batch_size=8", "trainer.batch_size", "did you mean 'trainer.global_batch_size'"),
        ("rollout.lerning_rate=1", "rollout.lerning_rate", "did you mean 'trainer.optimizer.lr'"),
        ("trainer.total_updates=1.5", "trainer.total_updates", "expected int (> 0)"),
        ("trainer.precision=fp16", "trainer.precision", "one of 'fp32', 'bf16'"),
        ("algorithm.name=grp", "algorithm.name", "did you mean 'grpo'"),
        ("logging.every=maybe", "logging.every", "invalid value 'maybe'"),
        ("logging.jsonl=maybe", "logging.jsonl", "expected bool"),
        ("data.tasks=t2i", "data.tasks", "write a list as [a,b]"),
        ("trainer.lr.x=1", "trainer.lr", "unknown key"),
        ("trainer.total_updates.x=1", "trainer.total_updates.x", "not a section"),
        ("reward.plugins.3.weight=1", "reward.plugins.3", "no list item"),
        ("data.task_weights.t3i=1", "data.task_weights.t3i", "did you mean 't2i'"),
    ],
)
def test_override_errors_name_the_key(tmp_path, override, key, fragment):
    path = write(tmp_path / "c.yaml", "run: {}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, [override])
    err = info.value
    assert err.key == key and err.source == COMMAND_LINE
    assert fragment in str(err) and "\n" not in str(err)


@pytest.mark.parametrize("text", ["trainer.lr", "=3", ".a=1", "a..b=1", "a.=1"])
def test_bad_override_syntax(text):
    with pytest.raises(ConfigError, match="bad override") as info:
        parse_override(text)
    assert info.value.source == COMMAND_LINE


def test_suggest_uses_difflib_and_synonyms():
    assert suggest("lerning_rate", ["lr", "betas", "eps", "weight_decay"]) == "lr"
    assert suggest("weight_decy", ["lr", "betas", "eps", "weight_decay"]) == "weight_decay"
    assert suggest("zzz", ["lr", "betas"]) is None


BASE_GRPO = {"algorithm": {"name": "grpo"}, "reward": {"plugins": [{"name": "mc_exact"}]}}


@pytest.mark.parametrize(
    ("patch", "key"),
    [
        (
            {"algorithm": {"old_logp_source": "rollout", "updates_per_batch": 2}},
            "algorithm.old_logp_source",
        ),
        ({"algorithm": {"aggregation": "seq_mean_token_sum_norm"}}, "algorithm.horizon"),
        ({"algorithm": {"kl": {"type": "none", "coef": 0.1}}}, "algorithm.kl.coef"),
        ({"algorithm": {"group_size": 5}}, "trainer.global_batch_size"),
        ({"reward": {"plugins": []}}, "reward.plugins"),
        ({"trainer": {"micro_batch_size": 5}}, "trainer.micro_batch_size"),
        ({"trainer": {"scheduler": {"warmup_steps": 3}}}, "trainer.scheduler.warmup_steps"),
        (
            {"trainer": {"scheduler": {"name": "warmup_constant", "min_lr_ratio": 0.1}}},
            "trainer.scheduler.min_lr_ratio",
        ),
        (
            {
                "trainer": {
                    "total_updates": 2,
                    "scheduler": {"name": "warmup_cosine", "warmup_steps": 3},
                }
            },
            "trainer.scheduler.warmup_steps",
        ),
        ({"model": {"kind": "Janus-Pro"}}, "model.kind"),
        ({"model": {"tiny": {"num_heads": 3}}}, "model.tiny.num_heads"),
        ({"model": {"codec": {"patch_size": 3}}}, "model.codec.patch_size"),
        ({"data": {"tasks": ["t2i", "t2i"]}}, "data.tasks"),
        ({"data": {"task_weights": {"i2t_mc": 1.0}}}, "data.task_weights.i2t_mc"),
        (
            {"rollout": {"length_semantics": "exact"}, "data": {"tasks": ["i2t_mc"]}},
            "rollout.length_semantics",
        ),
        ({"rollout": {"guidance": 3.0}, "data": {"tasks": ["i2t_mc"]}}, "rollout.guidance"),
        ({"rollout": {"min_grid_side": 5, "max_grid_side": 4}}, "rollout.min_grid_side"),
        ({"trainer": {"lora": {"target_modules": "(q_proj"}}}, "trainer.lora.target_modules"),
        (
            {
                "algorithm": {"name": "opd", "teacher": {"path": "/t"}, "routing": "correct_only"},
                "reward": {"plugins": []},
            },
            "reward.plugins",
        ),
        ({"algorithm": {"name": "opd"}}, "algorithm.teacher.path"),
        (
            {
                "algorithm": {
                    "name": "opd",
                    "teacher": {"path": "/t"},
                    "gt_replay": {"mode": "failure", "budget": 1},
                }
            },
            "algorithm.gt_replay.mode",
        ),
        (
            {
                "algorithm": {
                    "name": "sft",
                    "information_gain": {
                        "weight": 1.0,
                        "text_to_visual_weight": 0.0,
                        "visual_to_text_weight": 0.0,
                    },
                }
            },
            "algorithm.information_gain.weight",
        ),
        (
            {"algorithm": {"name": "sft", "bitflip": {"probability": 0.1}}},
            "algorithm.bitflip.probability",
        ),
        ({"run": {"device": "gpu"}}, "run.device"),
        ({"trainer": {"optimizer": {"lr": float("nan")}}}, "trainer.optimizer.lr"),
    ],
)
def test_invalid_combinations_name_the_key(patch, key):
    from uniweave.config.yaml_io import deep_merge

    data = deep_merge(json.loads(json.dumps(BASE_GRPO)), patch)
    if data["algorithm"]["name"] != "grpo":
        data["algorithm"] = patch["algorithm"]
    with pytest.raises(ConfigError) as info:
        validate_config(data, source="x.yaml")
    assert info.value.key == key, str(info.value)
    assert str(info.value).startswith(f"x.yaml: {key}: ")


def test_valid_combinations_load():
    data = {
        **BASE_GRPO,
        "algorithm": {
            "name": "grpo",
            "old_logp_source": "rollout",
            "aggregation": "seq_mean_token_sum_norm",
            "horizon": 64,
            "dual_clip": 3.0,
        },
        "model": {"kind": "uniar", "path": "/ckpt", "visual_head": "bsq"},
        "rollout": {"length_semantics": "exact", "guidance": 2.0},
    }
    cfg = validate_config(data)
    assert cfg.algorithm.horizon == 64 and cfg.model.visual_head == "bsq"


def test_validation_error_counts_the_others():
    with pytest.raises(ConfigError, match=r"\(and 2 more errors\)"):
        validate_config({"run": {"seed": -1, "name": ""}, "trainer": {"total_updates": 0}})


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = write(tmp_path / "bad.yaml", "run:\n  name: ok\n  seed: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:4:1: YAML syntax error"):
        load_config(bad)
    dup = write(tmp_path / "dup.yaml", "run: {}\ntrainer: {}\nrun: {}\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml:3:1: .*duplicate key 'run'"):
        load_config(dup)
    write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    write(tmp_path / "b.yaml", "defaults: [c.yaml]\n")
    write(tmp_path / "c.yaml", "defaults: b.yaml\n")
    with pytest.raises(ConfigError, match=r"inheritance loop: .*b\.yaml -> .*c\.yaml -> .*b\.yaml"):
        load_config(tmp_path / "a.yaml")
    nobase = write(tmp_path / "n.yaml", "defaults: nothere.yaml\n")
    with pytest.raises(ConfigError, match=r"defaults: base file not found: .*nothere\.yaml"):
        load_config(nobase)
    listy = write(tmp_path / "l.yaml", "- run\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy)


def test_diamond_inheritance_is_not_a_loop(tmp_path):
    write(tmp_path / "root.yaml", "run: {seed: 5}\n")
    write(tmp_path / "left.yaml", "defaults: root.yaml\n")
    write(tmp_path / "right.yaml", "defaults: root.yaml\n")
    top = write(tmp_path / "top.yaml", "defaults: [left.yaml, right.yaml]\n")
    assert load_config(top).run.seed == 5


def test_hash_is_stable_and_sensitive_to_every_leaf(tmp_path):
    path = EXAMPLES / "grpo_tiny.yaml"
    cfg = load_config(path)
    h = config_hash(cfg)
    assert h == hashlib.sha256(canonical_json(cfg).encode("utf-8")).hexdigest()  # documented
    assert h == config_hash(load_config(path)) == config_hash(cfg.model_dump(mode="json"))
    assert short_hash(cfg) == h[:12]
    assert canonical_json(cfg) == json.dumps(
        json.loads(canonical_json(cfg)), sort_keys=True, separators=(",", ":")
    )
    changes = [
        "run.seed=1",
        "trainer.optimizer.lr=2e-4",
        "trainer.optimizer.betas=[0.9,0.99]",
        "algorithm.group_size=4",
        "algorithm.dual_clip=3",
        "rollout.temperature=0.9",
        "data.tasks=[i2t_mc,t2i]",
        "reward.plugins.0.weight=2",
        "logging.every=2",
    ]
    hashes = {h}
    for change in changes:
        other = load_config(path, [change])
        assert config_hash(other) not in hashes, change
        hashes.add(config_hash(other))
        key = change.split("=")[0].replace("plugins.0.weight", "plugins")  # lists are leaves
        assert diff_configs(cfg, other) == [key]


def test_diff_and_resume_conflicts():
    a = validate_config(BASE_GRPO)
    b = validate_config({**BASE_GRPO, "algorithm": {"name": "grpo", "scope": "global"}})
    assert diff_configs(a, b) == ["algorithm.scope"]
    c = validate_config({"trainer": {"total_updates": 500}, "logging": {"every": 10}})
    sft = UniweaveConfig()
    assert diff_configs(sft, c) == ["trainer.total_updates", "logging.every"]
    switched = diff_configs(sft, a)  # a branch switch lists the keys of both branches
    assert {"reward.plugins", "algorithm.name", "algorithm.lambda_visual"} <= set(switched)
    assert "algorithm.group_size" in switched
    assert resume_conflicts(sft, c) == ["trainer.total_updates"]
    relaxed = validate_config(
        {**c.model_dump(), "checkpoint": {"resume_mode": "allow_schedule_changes"}}
    )
    assert resume_conflicts(sft, relaxed) == []


def test_to_yaml_round_trips(tmp_path):
    cfg = load_config(EXAMPLES / "grpo_tiny_t2i_bsq.yaml", ["run.name=007"])
    text = to_yaml(cfg)
    again = load_config(write(tmp_path / "resolved.yaml", text))
    assert again == cfg and config_hash(again) == config_hash(cfg)


def test_example_recipes_load_and_inherit():
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert {"base.yaml", "sft_tiny.yaml", "grpo_tiny.yaml"} <= set(names)
    for name in names:
        load_config(EXAMPLES / name)
    base, child = load_config(EXAMPLES / "base.yaml"), load_config(EXAMPLES / "grpo_tiny.yaml")
    assert child.trainer.optimizer.lr == base.trainer.optimizer.lr == 3e-4
    assert child.algorithm.name == "grpo" and child.run.name == "grpo_tiny"
    deep = load_config(EXAMPLES / "grpo_tiny_t2i_bsq.yaml")
    assert deep.algorithm.clip_high == 0.28 and deep.model.visual_head == "bsq"
    assert [p.name for p in deep.reward.plugins] == ["digit_classifier"]


def test_shipped_recipes_load():
    """Every recipe outside recipes/examples (those are loaded above) validates against the
    strict schema, Janus-Pro ones given a checkpoint path, and every digits GRPO recipe
    names at least one reward plugin."""
    recipes = sorted(p for p in EXAMPLES.parent.rglob("*.yaml") if p.parent != EXAMPLES)
    digits = [p for p in recipes if p.parent.name == "digits"]
    assert {"sft_vq.yaml", "grpo_i2t.yaml", "grpo_i2t_open.yaml"} <= {p.name for p in digits}
    for path in recipes:
        # Janus-Pro recipes take the local checkpoint on the command line.
        overrides = ["model.path=/ckpt/janus-pro"] if path.parent.name == "janus_pro" else []
        if overrides and path.name.startswith("opd"):  # and the teacher's
            overrides.append("algorithm.teacher.path=/ckpt/janus-pro-7b")
        cfg = load_config(path, overrides)
        if path.parent.name == "digits" and cfg.algorithm.name == "grpo":
            assert cfg.reward.plugins, path.name
    # grpo_i2t_open inherits grpo_i2t and replaces only the task, reward and start point,
    # and pins the rollout temperature, group size, batch and length it was measured with.
    base = load_config(EXAMPLES.parent / "digits" / "grpo_i2t.yaml")
    open_qa = load_config(EXAMPLES.parent / "digits" / "grpo_i2t_open.yaml")
    assert open_qa.data.tasks == ["i2t_open"]
    assert [p.name for p in open_qa.reward.plugins] == ["text_exact"]
    assert open_qa.algorithm == base.algorithm.model_copy(update={"group_size": 8})
    pinned = {"global_batch_size": 128, "total_updates": 150}
    assert open_qa.trainer == base.trainer.model_copy(update=pinned)
    assert open_qa.rollout == base.rollout.model_copy(update={"temperature": 1.0})


def test_schema_keys_and_digits_size():
    from uniweave.config.schema import DIGITS_IMAGE_SIZE
    from uniweave.data.digits_images import IMAGE_SIZE

    assert DIGITS_IMAGE_SIZE == IMAGE_SIZE
    keys = set(dotted_keys(UniweaveConfig))
    assert {"trainer.optimizer.lr", "algorithm.kl.type", "algorithm.teacher.path"} <= keys


def test_an_inert_setting_names_the_file_that_set_it_and_its_default_is_harmless(tmp_path):
    """Issue 29: a setting another one makes inactive is refused naming the file (or the
    command line) that set it; set back to its default by a child it is harmless."""
    write(tmp_path / "base.yaml", "trainer: {lora: {enabled: true, r: 16}}\n")
    child = write(
        tmp_path / "child.yaml", "defaults: base.yaml\ntrainer: {lora: {enabled: false}}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(child)
    assert info.value.key == "trainer.lora.r"
    assert info.value.source == str(tmp_path / "base.yaml")
    assert str(info.value) == (
        f"{tmp_path / 'base.yaml'}: trainer.lora.r: acts only with trainer.lora.enabled true "
        "(LoRA is off)"
    )
    back = write(
        tmp_path / "back.yaml", "defaults: base.yaml\ntrainer: {lora: {enabled: false, r: 8}}\n"
    )
    assert load_config(back).trainer.lora.model_dump() == UniweaveConfig().trainer.lora.model_dump()
    with pytest.raises(ConfigError) as info:
        load_config(back, ["trainer.lora.alpha=32"])
    assert info.value.key == "trainer.lora.alpha" and info.value.source == COMMAND_LINE


def test_a_trial_run_refused_for_the_recipes_warmup_names_both_sources(tmp_path):
    """A 3-update trial of a recipe whose base warms up for 10 updates (issue 30): the
    message names the warmup key and the base file that set it, the command line that
    set total_updates, and the override that fixes it."""
    write(tmp_path / "base.yaml", "trainer: {scheduler: {name: warmup_cosine, warmup_steps: 10}}\n")
    path = write(tmp_path / "own.yaml", "defaults: base.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["trainer.total_updates=3"])
    err = info.value
    assert err.key == "trainer.scheduler.warmup_steps"
    assert err.source == str(tmp_path / "base.yaml")
    text = str(err)
    assert "trainer.total_updates set in <command line>" in text
    assert "trainer.scheduler.warmup_steps=0" in text and "\n" not in text
    load_config(path, ["trainer.total_updates=3", "trainer.scheduler.warmup_steps=0"])
