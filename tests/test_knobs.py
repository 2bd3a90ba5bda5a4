"""Every config knob acts (issue 13): a walk over the whole schema, every leaf field of
`UniweaveConfig` and of each algorithm variant, checked against a registry.

Each field either has a probe, a small real case in which two values of the field give a
different behaviour or output (the runtime object built from the config, a 1-3 update
tiny run, or a refusal at config time for a feature that does not exist yet), or is on
`EXEMPT` with the reason it cannot have one. A new field with neither fails
`test_every_schema_field_has_a_probe_or_an_exemption`.

Probes share one tiny setup (a width-16 one-layer model on pre-fitted codecs) and build
runtime objects rather than train wherever that proves the point.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import socket
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args, get_origin

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image
from pydantic import BaseModel

from uniweave.config import ConfigError, UniweaveConfig, resume_conflicts, validate_config
from uniweave.config.introspect import is_model, strip_optional, union_branches
from uniweave.core.determinism import set_determinism
from uniweave.core.sample import ImagePart
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.digits import make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.data.images import processor_for
from uniweave.data.loader import DatasetError
from uniweave.data.rows import split_rows
from uniweave.eval.runner import eval_samples, evaluate, make_request, run_eval
from uniweave.models import check_model_config
from uniweave.models.build import build_model, config_tokenizer, resolve_device
from uniweave.models.tiny.build import new_codec
from uniweave.rewards.digit_classifier import CLASSIFIER_DIR
from uniweave.rewards.service import build_reward_service
from uniweave.rollout.config import sampling_params
from uniweave.rollout.engine import context_length
from uniweave.train.distributed.comm import DistInfo, init_distributed, shutdown_distributed
from uniweave.train.engine.metrics import MetricsLogger
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.opd.objective import OPDObjective
from uniweave.train.run import (
    JOBS,
    _prepare_model,
    _val_evaluator,
    finish_run,
    prepare_run_dir,
    run_train,
)
from uniweave.train.state.checkpoint import checkpoint_dir

EXEMPT: dict[str, str] = {
    "logging.progress_bar": "draws only on an interactive terminal (never under pytest/CI); "
    "it changes no file or metric",
    "rollout.batch_size": "rows decoded together: speed and memory only; a row's tokens do "
    "not depend on its batch (per-row seeds, tests/test_rollout.py)",
    "algorithm[grpo].chunk_size": "scored positions per head chunk: memory only; replay is "
    "chunk-invariant by contract (tests/test_replay.py)",
    "algorithm[opd].chunk_size": "scored positions per head chunk: memory only; replay is "
    "chunk-invariant by contract (tests/test_replay.py, tests/test_opd_loop.py)",
    "trainer.world_size": "spawns worker processes (too slow for a probe); it acts in "
    "tests/test_scale.py (2 spawned workers equal torchrun bitwise; refusals)",
}


def schema_leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted keys of every leaf field under `model`; a tagged union contributes each
    branch's fields as `key[tag].field`, a list of sections as `key[].field`."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        inner, _ = strip_optional(info.annotation)
        branches = union_branches((info.annotation, info))
        if branches is not None:
            for tag, branch in branches[1].items():
                out += schema_leaves(branch, f"{key}[{tag}].")
        elif is_model(inner):
            out += schema_leaves(inner, f"{key}.")
        elif get_origin(inner) is list and is_model(get_args(inner)[0]):
            out += schema_leaves(get_args(inner)[0], f"{key}[].")
        else:
            out.append(key)
    return out


PROBES: dict[str, Callable[..., None]] = {}


def probe(*keys: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register `fn(kit)` as the probe of `keys`."""

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        for key in keys:
            assert key not in PROBES, key
            PROBES[key] = fn
        return fn

    return register


# -- the shared tiny setup -----------------------------------------------------------


@pytest.fixture(scope="module")
def kit(tmp_path_factory, small_vq_dir, small_bsq_dir, classifier_dir) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("knobs")
    vq_a = small_vq_dir
    vq_b = root / "vq_b"
    codec = new_codec(validate_config({"model": {"codec": {"codebook_size": 16}}}).model)
    codec.fit(load_split("train").images[:200], seed=1).save_pretrained(vq_b)
    bsq = small_bsq_dir
    classifier = classifier_dir
    base = {
        "run": {"name": "k", "seed": 0, "output_dir": str(root / "run"), "device": "cpu"},
        "model": {
            "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32},
            "codec": {"path": str(vq_a), "codebook_size": 16},
        },
        "data": {"tasks": ["t2i", "i2t_mc"], "train_size": 4, "val_size": 0, "test_size": 0},
        "algorithm": {"name": "sft"},
        "trainer": {
            "optimizer": {"lr": 1e-2},
            "total_updates": 3,
            "global_batch_size": 4,
            "micro_batch_size": 2,
        },
        "checkpoint": {"every_updates": 0},
        "logging": {"tensorboard": False, "progress_bar": False},
    }
    saved = root / "saved_model"
    build_model(validate_config({**base, "run": {**base["run"], "seed": 5}})).save_pretrained(saved)
    jsonl = root / "rows.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"say {w}"},
                {"role": "assistant", "content": w},
            ]
        }
        for w in ("one", "two", "three", "four")
    ]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return SimpleNamespace(
        root=root, base=base, vq_b=vq_b, bsq=bsq, classifier=classifier, saved=saved, jsonl=jsonl
    )


GRPO = {
    "data": {"tasks": ["t2i"], "train_size": 8},
    "rollout": {"max_new_tokens": 16, "length_semantics": "exact"},
    "algorithm": {
        "name": "grpo",
        "group_size": 4,
        "updates_per_batch": 2,
        "kl": {"type": "k3", "coef": 0.05},
    },
    "trainer": {"total_updates": 2, "global_batch_size": 8, "micro_batch_size": 4},
}


def config(
    kit: SimpleNamespace, changes: dict[str, Any], base: dict | None = None
) -> UniweaveConfig:
    """The kit's base config (deep-merged with `base`) with dotted `changes` applied."""
    data = copy.deepcopy(kit.base)
    for section, values in (base or {}).items():
        data[section] = {**data.get(section, {}), **copy.deepcopy(values)}
    for key, value in changes.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return validate_config(data)


def differs(
    kit: SimpleNamespace,
    observe: Callable[[UniweaveConfig], Any],
    key: str,
    a: Any,
    b: Any,
    base: dict | None = None,
    **fixed: Any,
) -> None:
    """`observe` gives different results for `key` = a and `key` = b."""
    fixed = {k.replace("__", "."): v for k, v in fixed.items()}
    first = observe(config(kit, {**fixed, key: a}, base))
    second = observe(config(kit, {**fixed, key: b}, base))
    assert first != second, f"{key}: {a!r} and {b!r} both give {first!r}"


def make_trainer(cfg: UniweaveConfig, run_dir: Path | None = None) -> Trainer:
    """What `uniweave train` builds (model, job, trainer) without the run-directory files."""
    run_dir = Path(run_dir or cfg.run.output_dir)
    model = _prepare_model(cfg, run_dir, torch.device("cpu"))
    source, objective = JOBS[cfg.algorithm.name](cfg, model, run_dir, DistInfo())
    return Trainer(
        model,
        source,
        objective,
        cfg,
        run_dir,
        DistInfo(),
        model.special_ids.pad,
        evaluator=_val_evaluator(cfg, model, run_dir),
    )


def steps(cfg: UniweaveConfig) -> list[tuple[float, ...]]:
    """(loss, grad_norm, lr, clip_scale) of each update of a run that writes no files."""
    trainer = make_trainer(cfg)
    out = []
    for _ in range(cfg.trainer.total_updates):
        m = trainer.step()
        trainer.update += 1
        out.append((m["loss"], m["grad_norm"], m["lr"], m["clip_scale"]))
    return out


def copy_classifier(kit: SimpleNamespace, run_dir: Path) -> None:
    """The kit's digits classifier where a run looks for it (no fit on the full split)."""
    (run_dir / CLASSIFIER_DIR).mkdir(parents=True)
    for f in kit.classifier.glob("*"):
        (run_dir / CLASSIFIER_DIR / f.name).write_bytes(f.read_bytes())


def fit_run(kit: SimpleNamespace, cfg: UniweaveConfig) -> tuple[Path, list[dict]]:
    """A real `Trainer.fit` into a fresh run directory; the directory and the metrics."""
    run_dir = Path(cfg.run.output_dir)
    assert not run_dir.exists()
    prepare_run_dir(cfg, DistInfo())
    copy_classifier(kit, run_dir)
    trainer = make_trainer(cfg, run_dir)
    return run_dir, [m for _, m in trainer.fit()]


_runs = iter(range(10**6))


def fresh_dir(kit: SimpleNamespace) -> str:
    return str(kit.root / f"run{next(_runs)}")


# -- run, model, codec -----------------------------------------------------------------


@probe("run.name")
def _run_name(kit):
    """The default run directory is runs/<name>."""
    differs(kit, lambda c: c.run.output_dir, "run.name", "a", "b", run__output_dir=None)


@probe("run.output_dir")
def _run_output_dir(kit):
    out = [Path(fresh_dir(kit)), Path(fresh_dir(kit))]
    for path in out:
        prepare_run_dir(config(kit, {"run.output_dir": str(path)}), DistInfo())
    assert all((p / "config.yaml").is_file() for p in out)


@probe("run.device")
def _run_device(kit):
    differs(kit, lambda c: resolve_device(c.run.device), "run.device", "cpu", "cuda:1")


@probe("run.deterministic")
def _run_deterministic(kit):
    """`uniweave train` switches torch's deterministic kernels as the setting says (the bits
    it buys are tested in tests/test_determinism.py)."""
    before = torch.are_deterministic_algorithms_enabled()

    def kernels(c):
        set_determinism(c.run.deterministic, resolve_device(c.run.device))
        return torch.are_deterministic_algorithms_enabled()

    try:
        differs(kit, kernels, "run.deterministic", True, False)
    finally:
        torch.use_deterministic_algorithms(before)


@probe("run.host_mmap_threshold")
def _run_host_mmap_threshold(kit):
    """Freed host tensors stay resident under glibc's dynamic threshold (null) and go back
    to the OS under a fixed one (tests/test_host_memory.py has the bounds)."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt thresholds are glibc's")
    from allocator_helpers import resident_after_free

    def resident(c):
        value = c.run.host_mmap_threshold
        return resident_after_free("none" if value is None else str(value))[1] > 4 * 2**20

    differs(kit, resident, "run.host_mmap_threshold", None, 2**20)


@probe(
    "run.seed",
    "model.tiny.hidden_size",
    "model.tiny.num_layers",
    "model.tiny.num_heads",
    "model.tiny.intermediate_size",
    "model.tiny.mixer_kernel",
    "model.tiny.tie_embeddings",
    "model.visual_head",
    "model.codec.path",
    "model.path",
)
def _model_weights(kit):
    """A 1-update SFT run's loss and gradient depend on each model knob."""
    one = {"trainer__total_updates": 1}
    for key, a, b in [
        ("run.seed", 0, 1),
        ("model.tiny.hidden_size", 16, 24),
        ("model.tiny.num_layers", 1, 2),
        ("model.tiny.num_heads", 2, 4),
        ("model.tiny.intermediate_size", 32, 48),
        ("model.tiny.mixer_kernel", 4, 0),
        ("model.tiny.tie_embeddings", False, True),
        ("model.codec.path", str(kit.base["model"]["codec"]["path"]), str(kit.vq_b)),
    ]:
        differs(kit, steps, key, a, b, **one)
    # model.path loads the checkpoint's sizes and codec: model.tiny / model.codec go
    loaded = {"model.path": str(kit.saved), "model.tiny": {}, "model.codec": {}}
    built = steps(config(kit, {"trainer.total_updates": 1}))
    assert built != steps(config(kit, {"trainer.total_updates": 1, **loaded})), "model.path"
    t2i = {"data.tasks": ["t2i"], "trainer.total_updates": 1}
    bsq = config(kit, {**t2i, "model.visual_head": "bsq", "model.codec.path": str(kit.bsq)})
    assert steps(config(kit, t2i)) != steps(bsq), "model.visual_head: vq and bsq agree"
    vq = config(kit, {"model.codec.path": str(kit.bsq)})
    with pytest.raises(ValueError, match="model.visual_head=vq"):
        build_model(vq)


@probe("model.kind")
def _model_kind(kit):
    """model.kind must match the checkpoint, and a mismatch stops `train` before the run
    directory exists."""
    tiny = config(kit, {"model.path": str(kit.saved), "model.kind": "tiny", "model.tiny": {},
                        "model.codec": {}})  # fmt: skip
    check_model_config(tiny.model)
    out = Path(fresh_dir(kit))
    janus = config(kit, {"model.path": str(kit.saved), "model.kind": "janus_pro",
                         "model.tiny": {}, "model.codec": {}, "run.output_dir": str(out)})  # fmt: skip
    with pytest.raises(ValueError, match="holds a 'tiny' model but model.kind is 'janus_pro'"):
        run_train(janus)
    assert not out.exists()


@probe("model.tiny.max_position_embeddings")
def _context(kit):
    observe = lambda c: context_length(build_model(c))  # noqa: E731
    differs(kit, observe, "model.tiny.max_position_embeddings", 512, 64)


@probe(
    "model.codec.patch_size",
    "model.codec.codebook_size",
    "model.codec.bits",
    "model.codec.group",
    "model.codec.image_size",
    "model.codec.channels",
)
def _codec(kit):
    """The codec a run fits when model.codec.path is null."""
    observe = lambda c: new_codec(c.model).config()  # noqa: E731
    differs(kit, observe, "model.codec.patch_size", 2, 4)
    geometry = lambda c: (new_codec(c.model).grid, new_codec(c.model).channels)  # noqa: E731
    differs(kit, geometry, "model.codec.image_size", 8, 16)
    differs(kit, geometry, "model.codec.channels", 1, 3)
    differs(kit, observe, "model.codec.codebook_size", 16, 8)
    bsq = {
        "model__visual_head": "bsq",
        "model__codec__path": None,
        "model__codec__codebook_size": 32,
    }
    differs(kit, observe, "model.codec.bits", 16, 8, **bsq)
    differs(kit, observe, "model.codec.group", 1, 2, **bsq)


# -- data --------------------------------------------------------------------------


@probe(
    "data.tasks",
    "data.task_weights",
    "data.path",
    "data.train_size",
    "data.seed",
    "data.shuffle",
)
def _data(kit):
    """Which rows an SFT update trains on: its loss."""
    one = {"trainer__total_updates": 1}
    differs(kit, steps, "data.tasks", ["t2i"], ["i2t_mc"], **one)
    differs(kit, steps, "data.task_weights", None, {"t2i": 3.0, "i2t_mc": 1.0}, **one)
    own = {"data__tasks": ["colour"], "data__default_task": "colour"}
    other = own_rows(kit)["val"]
    differs(kit, steps, "data.path", str(kit.jsonl), str(other), **one, **own)
    differs(kit, steps, "data.train_size", 4, 2, **one)
    differs(kit, steps, "data.seed", 0, 1, **one)
    differs(kit, steps, "data.shuffle", True, False, **one)


@probe("data.max_sequence_tokens", "data.over_length")
def _sequence_limit(kit):
    """Which serialised SFT rows a run keeps (t2i rows are shorter than i2t_mc rows)."""
    from uniweave.train.methods.sft.source import sft_trajectories

    observe = lambda c: len(sft_trajectories(c, build_model(c), "train", 4))  # noqa: E731
    differs(kit, observe, "data.max_sequence_tokens", 64, 40, data__over_length="drop")
    with pytest.raises(ConfigError, match="more than 40"):
        observe(config(kit, {"data.max_sequence_tokens": 40}))
    assert observe(config(kit, {"data.max_sequence_tokens": 40, "data.over_length": "drop"})) == 4


@probe("data.val_size", "trainer.eval_every")
def _validation(kit):
    def val_keys(c):
        c = config(kit, {"run.output_dir": fresh_dir(kit), "trainer.total_updates": 2,
                         "data.val_size": c.data.val_size, "trainer.eval_every": c.trainer.eval_every})  # fmt: skip
        _, metrics = fit_run(kit, c)
        return [sorted(k for k in m if k.startswith("val/")) for m in metrics]

    differs(kit, val_keys, "trainer.eval_every", 0, 1, data__val_size=2)
    model = build_model(config(kit, {}))
    val_rows = lambda c: len(eval_samples(c, model))  # noqa: E731
    differs(kit, val_rows, "data.val_size", 1, 2, evaluation__split="val")
    with pytest.raises(ConfigError, match="trainer.eval_every: 1 evaluates nothing"):
        config(kit, {"data.val_size": 0, "trainer.eval_every": 1})


@probe(
    "trainer.eval_every_epochs",
    "checkpoint.every_epochs",
    "checkpoint.keep_best",
    "checkpoint.keep_best_mode",
    "checkpoint.save_rollouts",
)
def _cadence(kit):
    """Epoch-boundary evaluations and checkpoints (R = 8 rows, B = 4: epoch 1 ends with
    update 2), the best checkpoint kept beside the newest, saved GRPO rollouts."""

    def outcome(c):
        c = config(kit, {"run.output_dir": fresh_dir(kit)}, {
            "trainer": c.trainer.model_dump(), "checkpoint": c.checkpoint.model_dump(),
            "data": c.data.model_dump(), "algorithm": c.algorithm.model_dump(),
            "rollout": c.rollout.model_dump(), "reward": c.reward.model_dump()})  # fmt: skip
        run_dir, metrics = fit_run(kit, c)
        best = checkpoint_dir(run_dir) / "best.json"
        return (
            [sorted(k for k in m if k.startswith("val/")) for m in metrics],
            sorted(p.name for p in checkpoint_dir(run_dir).glob("update-*")),
            json.loads(best.read_text()) if best.is_file() else None,
            sorted(p.name for p in (run_dir / "rollouts").glob("update-*")),
        )

    differs(kit, outcome, "trainer.eval_every_epochs", 0, 1, data__val_size=1)
    differs(kit, outcome, "checkpoint.every_epochs", 0, 1)
    best = {"data__val_size": 1, "trainer__eval_every": 1, "checkpoint__keep_last": 1}
    differs(kit, outcome, "checkpoint.keep_best", None, "val/loss", **best)
    differs(kit, outcome, "checkpoint.keep_best_mode", "min", "max",
            checkpoint__keep_best="val/loss", **best)  # fmt: skip
    plugins = [{"name": "digit_classifier", "path": str(kit.classifier)}]
    grpo = {**GRPO, "reward": {"plugins": plugins}}
    differs(kit, outcome, "checkpoint.save_rollouts", False, True, grpo)


@probe("data.test_size")
def _test_size(kit):
    def evaluated(c):
        run_dir = Path(fresh_dir(kit))
        copy_classifier(kit, run_dir)
        finish_run(c, build_model(c), run_dir)
        path = run_dir / "eval.json"
        return json.loads(path.read_text()) if path.is_file() else None

    differs(kit, evaluated, "data.test_size", 0, 2)


# -- rollout and rewards ------------------------------------------------------------


ROLLOUT_CHANGES = {
    "temperature": 0.5,
    "top_k": 3,
    "top_p": 0.5,
    "guidance": 2.0,
    "guidance_logprob": "conditional",
    "bit_temperature": 0.5,
    "max_new_tokens": 16,
    "length_semantics": "exact",
    "cycle_max_period": 0,
    "cycle_repeats": 5,
    "min_grid_side": 2,
    "max_grid_side": 8,
    "on_invalid_header": "text",
}


@probe(*(f"rollout.{k}" for k in ROLLOUT_CHANGES))
def _rollout(kit):
    """The engine's SamplingParams (each field maps onto one SamplingParams field)."""
    observe = lambda c: sampling_params(c.rollout)  # noqa: E731
    default = UniweaveConfig().rollout
    acts_with = {  # what the setting acts only with (refused otherwise)
        "guidance_logprob": {"rollout__guidance": 2.0},
        "bit_temperature": {"model__visual_head": "bsq", "model__codec__path": str(kit.bsq)},
    }
    for name, value in ROLLOUT_CHANGES.items():
        differs(kit, observe, f"rollout.{name}", getattr(default, name), value,
                data__tasks=["t2i"], **acts_with.get(name, {}))  # fmt: skip


def service_view(c: UniweaveConfig, kit) -> tuple:
    """What the reward service built from the config holds."""
    svc = build_reward_service(c.reward, decode_images=lambda codes: codes)
    specs = tuple(
        (
            s.label,
            type(s.plugin).__name__,
            s.weight,
            s.tasks,
            vars(s.plugin).get("require_image_class"),
        )
        for s in svc.plugins
    )
    return specs, svc.truncated_reward, svc.on_error


@probe(
    "reward.truncated_reward",
    "reward.on_error",
    "reward.plugins[].name",
    "reward.plugins[].weight",
    "reward.plugins[].tasks",
    "reward.plugins[].kwargs",
    "reward.plugins[].path",
)
def _reward(kit):
    observe = lambda c: service_view(c, kit)  # noqa: E731
    one = lambda **kw: [{"name": "mc_exact", **kw}]  # noqa: E731
    differs(kit, observe, "reward.truncated_reward", "zero", "keep", reward__plugins=one())
    differs(kit, observe, "reward.on_error", "raise", "zero", reward__plugins=one())
    differs(kit, observe, "reward.plugins", one(), [{"name": "text_exact"}])
    differs(kit, observe, "reward.plugins", one(), one(weight=0.5))
    differs(kit, observe, "reward.plugins", one(), one(tasks=["i2t_mc"]), data__tasks=["i2t_mc"])
    clf = {"name": "exact_answer", "path": str(kit.classifier)}
    differs(kit, observe, "reward.plugins", [{"name": "exact_answer"}],
            [{**clf, "kwargs": {"require_image_class": True}}])  # fmt: skip
    path = config(kit, {"reward.plugins": [{"name": "digit_classifier", "path": str(kit.root)}]})
    with pytest.raises(Exception, match=str(kit.root)):
        service_view(path, kit)  # the path is read: a directory without a classifier fails


# -- algorithms ------------------------------------------------------------------


@probe("algorithm[sft].lambda_visual")
def _lambda_visual(kit):
    differs(kit, steps, "algorithm.lambda_visual", 1.0, 0.25, trainer__total_updates=1)


@probe(
    "algorithm[sft].bitflip.probability",
    "algorithm[sft].bitflip.probability_mode",
    "algorithm[sft].bitflip.partition",
)
def _bitflip(kit):
    bsq = {"model__visual_head": "bsq", "model__codec__path": str(kit.bsq), "data__tasks": ["t2i"],
           "trainer__total_updates": 1}  # fmt: skip
    differs(kit, steps, "algorithm.bitflip.probability", 0.0, 0.3, **bsq)
    differs(kit, steps, "algorithm.bitflip.probability_mode", "fixed", "uniform",
            algorithm__bitflip__probability=0.3, **bsq)  # fmt: skip
    differs(kit, steps, "algorithm.bitflip.partition", "all", "half",
            algorithm__bitflip__probability=0.3, **bsq)  # fmt: skip


@probe("algorithm[sft].soft_bsq.weight")
def _soft_bsq(kit):
    bsq = {"model__visual_head": "bsq", "model__codec__path": str(kit.bsq), "data__tasks": ["t2i"],
           "trainer__total_updates": 1}  # fmt: skip
    differs(kit, steps, "algorithm.soft_bsq.weight", 0.0, 0.5, **bsq)
    with pytest.raises(ConfigError, match="soft_bsq.weight: acts only with model.visual_head bsq"):
        config(kit, {"algorithm.soft_bsq.weight": 0.5})


IG = "algorithm.information_gain."


def ig_step(cfg: UniweaveConfig) -> tuple[float, ...]:
    """The first update's loss and IG metrics on the interleaved task."""
    m = make_trainer(cfg).step()
    keys = ("loss", "ig/loss", "ig/rows", "ig/blind_calls", "ig/full_calls",
            "ig/visual_to_text/events",
            "ig/visual_to_text/blind", "ig/visual_to_text/gate")  # fmt: skip
    return tuple(m.get(k, float("nan")) for k in keys)


@probe(*(f"algorithm[sft].information_gain.{k}" for k in (
    "weight", "formulation", "temperature", "eps", "text_to_visual_weight",
    "visual_to_text_weight", "event_selection", "blind_view_chunk_size",
    "student_full_view")))  # fmt: skip
def _information_gain(kit):
    on = {"data__tasks": ["draw_then_answer"], "trainer__total_updates": 1,
          IG.replace(".", "__") + "weight": 1.0}  # fmt: skip
    differs(
        kit, ig_step, IG + "weight", 0.0, 1.0, **{k: v for k, v in on.items() if "weight" not in k}
    )
    differs(kit, ig_step, IG + "formulation", "absolute", "relative_per_unit", **on)
    differs(kit, ig_step, IG + "temperature", 0.25, 1.0, **on)
    differs(kit, ig_step, IG + "eps", 1e-4, 10.0, **on)
    differs(kit, ig_step, IG + "text_to_visual_weight", 1.0, 0.0, **on)
    differs(kit, ig_step, IG + "visual_to_text_weight", 1.0, 0.0, **on)
    differs(kit, ig_step, IG + "event_selection", "cycle", "all", **on)
    differs(kit, ig_step, IG + "blind_view_chunk_size", 8, 1, **on)
    half = {"model__visual_head": "bsq", "model__codec__path": str(kit.bsq),
            "algorithm__bitflip__probability": 0.3, "algorithm__bitflip__partition": "half",
            **on}  # fmt: skip
    differs(kit, ig_step, IG + "student_full_view", "fused", "sequential", **half)
    with pytest.raises(ConfigError, match="information_gain.weight: .* both direction weights 0"):
        config(kit, {IG + "weight": 1.0, IG + "text_to_visual_weight": 0.0,
                     IG + "visual_to_text_weight": 0.0})  # fmt: skip


ND = "algorithm.necessity_distillation."


def nd_steps(cfg: UniweaveConfig) -> list[tuple[float, ...]]:
    """Each update's loss and necessity-distillation metrics (update 1's EMA is the
    model itself, so the decay shows from update 2 on)."""
    trainer = make_trainer(cfg)
    keys = ("loss", "nd/loss", "nd/carrier_share", "nd/teacher_calls", "nd/divergence")
    out = []
    for _ in range(cfg.trainer.total_updates):
        m = trainer.step()
        trainer.update += 1
        out.append(tuple(m.get(k, float("nan")) for k in keys))
    return out


@probe(*(f"algorithm[sft].necessity_distillation.{k}" for k in (
    "weight", "ema_decay", "selection", "min_necessity", "carrier_fraction", "beta",
    "chunk_size")))  # fmt: skip
def _necessity_distillation(kit):
    on = {"data__tasks": ["draw_then_answer"], "trainer__total_updates": 2,
          ND.replace(".", "__") + "weight": 1.0}  # fmt: skip
    off = {k: v for k, v in on.items() if "weight" not in k}
    differs(kit, nd_steps, ND + "weight", 0.0, 1.0, **off)
    differs(kit, nd_steps, ND + "ema_decay", 0.99, 0.0, **on)
    differs(kit, nd_steps, ND + "selection", "min_necessity", "fraction", **on)
    differs(kit, nd_steps, ND + "min_necessity", 0.0, -100.0, **on)
    frac = {**on, ND.replace(".", "__") + "selection": "fraction"}
    differs(kit, nd_steps, ND + "carrier_fraction", 0.5, 1.0, **frac)
    differs(kit, nd_steps, ND + "beta", 0.5, 0.1, **on)
    differs(kit, nd_steps, ND + "chunk_size", 16, 1, **on)


def grpo_ig_rollout(cfg: UniweaveConfig) -> tuple:
    """The first rollout batch's advantages and RL-IG metrics."""
    rollout = make_trainer(cfg).source.rollout(0)
    metrics = tuple(sorted((k, v) for k, v in rollout.metrics.items() if k.startswith("ig/")))
    return tuple(t.advantage for t in rollout.trajectories), metrics


@probe("algorithm[grpo].information_gain.weight", "algorithm[grpo].information_gain.clip",
       "algorithm[grpo].information_gain.chunk_size")  # fmt: skip
def _grpo_information_gain(kit):
    plugins = [{"name": "digit_classifier", "path": str(kit.classifier)}]
    grpo = {**GRPO, "reward": {"plugins": plugins}}
    key = "algorithm.information_gain."
    on = {"algorithm__information_gain__weight": 0.5, "trainer__total_updates": 1,
          "algorithm__updates_per_batch": 1}  # fmt: skip
    differs(kit, grpo_ig_rollout, key + "weight", 0.0, 0.5, grpo,
            trainer__total_updates=1, algorithm__updates_per_batch=1)  # fmt: skip
    differs(kit, grpo_ig_rollout, key + "clip", 1.0, 1e-3, grpo, **on)
    differs(kit, grpo_ig_rollout, key + "chunk_size", 16, 1, grpo, **on)
    # wiring: the advantages are the group advantages of r + λ·clip(N, −c, c), N of the
    # policy that rolled out (scored again here on the same rows), and N is logged per task
    from uniweave.algorithms.grpo import group_advantages
    from uniweave.algorithms.necessity import rollout_necessity

    cfg = config(kit, {**{k.replace("__", "."): v for k, v in on.items()},
                       key + "clip": 0.05}, grpo)  # fmt: skip
    trainer = make_trainer(cfg)
    rollout = trainer.source.rollout(0)
    batch = TrajectoryBatch.collate(rollout.trajectories, trainer.pad_id)
    n, has, _ = rollout_necessity(trainer.model, batch, 16)
    assert has.all()
    # the reward service hands out float32 totals: shape them in float32 as well (r' is
    # then the same float32 number), and the advantages agree to float64 rounding
    r = torch.tensor(rollout.rewards, dtype=torch.float32)
    a = cfg.algorithm
    shaped = r + 0.5 * n.float().clamp(-0.05, 0.05)
    want, _ = group_advantages(
        shaped, sample_ids=[s.id for s in rollout.samples], scope=a.scope,
        normalize_by_std=a.normalize_by_std, std_ddof=a.std_ddof, eps=a.eps,
    )  # fmt: skip
    got = torch.tensor([t.advantage for t in rollout.trajectories], dtype=torch.float64)
    # the same function on the same float32 inputs: the same numbers
    assert torch.equal(got, want.double())
    assert rollout.metrics["ig/t2i/necessity"] == float(n.mean())


def _opd_base(kit) -> dict:
    """One OPD update on t2i + i2t_mc rows (images end with an eos text segment) against
    the kit's saved model as teacher, verified by the classifier and mc_exact."""
    plugins = [{"name": "digit_classifier", "path": str(kit.classifier), "tasks": ["t2i"]},
               {"name": "mc_exact", "tasks": ["i2t_mc"]}]  # fmt: skip
    return {
        "rollout": {"max_new_tokens": 20, "length_semantics": "cap"},
        "reward": {"plugins": plugins, "truncated_reward": "keep"},
        "algorithm": {"name": "opd", "teacher": {"path": str(kit.saved)}},
        "trainer": {"total_updates": 1, "global_batch_size": 4, "micro_batch_size": 2},
    }


OPD_CHANGES = [
    ("algorithm.beta", 0.5, 0.0, {}),
    ("algorithm.student_sampling", "temperature", "greedy", {}),
    (
        "algorithm.modality_weights.text",
        1.0,
        0.25,
        {"algorithm__gt_replay__mode": "uniform", "algorithm__gt_replay__budget": 2},
    ),
    ("algorithm.modality_weights.visual", 1.0, 0.25, {}),
    ("algorithm.top_k", 2, 3, {"algorithm__retained_mass_min": 0.0}),
    ("algorithm.retained_mass_min", 0.0, 1.0, {"algorithm__top_k": 2}),
    ("algorithm.routing", "all", "correct_only", {}),
    ("algorithm.teacher.privilege", "none", "answer", {}),
    ("algorithm.gt_replay.budget", 1, 2, {"algorithm__gt_replay__mode": "uniform"}),
    ("algorithm.carriers", "all", "necessity", {}),
    ("algorithm.carrier_min_necessity", 0.0, -100.0, {"algorithm__carriers": "necessity"}),
]


@probe("algorithm[opd].name", "algorithm[opd].teacher.path",
       "algorithm[opd].events", "algorithm[opd].gt_replay.mode",
       *(f"algorithm[opd].{k.removeprefix('algorithm.')}" for k, *_ in OPD_CHANGES))  # fmt: skip
def _opd(kit):
    """One OPD update changes its loss or gradient with each knob; privileged_correction
    and failure replay differ from their neighbours; another teacher gives another loss."""
    base = _opd_base(kit)
    for key, a, b, fixed in OPD_CHANGES:
        differs(kit, steps, key, a, b, base, **fixed)
    routed = {"algorithm__teacher__privilege": "answer"}
    differs(
        kit, steps, "algorithm.routing", "correct_only", "privileged_correction", base, **routed
    )
    uniform = {"mode": "uniform", "budget": 2}
    differs(kit, steps, "algorithm.gt_replay", {"mode": "none"}, uniform, base)
    differs(kit, steps, "algorithm.gt_replay.mode", "uniform", "failure", base,
            algorithm__routing="correct_only", algorithm__gt_replay__budget=2)  # fmt: skip
    other = kit.root / "teacher_b"
    if not other.exists():
        build_model(config(kit, {"run.seed": 11})).save_pretrained(other)
    differs(kit, steps, "algorithm.teacher.path", str(kit.saved), str(other), base)
    sft = {**base, "algorithm": {"name": "sft"}}
    differs(kit, steps, "algorithm", {"name": "sft"}, base["algorithm"], sft)
    # events: a random student's rollouts rarely end by eos (no second complete event),
    # so the objective's events are read on a draw-then-answer row (text, image, text)
    model = build_model(config(kit, {}))
    row = make_task_samples("draw_then_answer", "train", 1, seed=0)[0]
    batch = TrajectoryBatch.collate([model.prompt_trajectory(row, False)], model.special_ids.pad)
    kinds = lambda c: OPDObjective(c.algorithm, None, {})._events(batch).kinds  # noqa: E731
    differs(kit, kinds, "algorithm.events", "all_complete_transitions", "first_complete_window",
            base)  # fmt: skip


def _answer_row_loss(cfg: UniweaveConfig) -> float:
    """The OPD loss of one distilled draw-then-answer row (its reference answer as the
    response, ended by eos: text and image segments complete, which a random student's
    rollout rarely gives)."""
    from dataclasses import replace

    from uniweave.train.methods.opd.source import DistillRecord

    trainer = make_trainer(cfg)
    sample = make_task_samples("draw_then_answer", "train", 1, seed=0)[0]
    traj = trainer.model.prompt_trajectory(sample, add_generation_prompt=False)
    row = replace(traj, sampling=DistillRecord(trainer.source.params), finish_reason="eos")
    batch = TrajectoryBatch.collate([row], trainer.pad_id)
    return trainer.objective.loss(trainer.model, batch, 1)[0].item()


@probe("algorithm[opd].text_clip")
def _opd_text_clip(kit):
    """The answer row's text part of D_i is above 1e-4 nats: the clip lowers its loss."""
    differs(kit, _answer_row_loss, "algorithm.text_clip", None, 1e-4, _opd_base(kit))


@probe("logging.gradient_diagnostics_every_updates")
def _gradient_diagnostics(kit):
    """An OPD update with GT replay logs the distillation / GT-replay gradient figures
    only with the diagnostics on."""
    gt = {"algorithm__gt_replay__mode": "uniform", "algorithm__gt_replay__budget": 2}
    logged = lambda c: sorted(k for k in make_trainer(c).step() if k.startswith("grad/"))  # noqa: E731
    key = "logging.gradient_diagnostics_every_updates"
    differs(kit, logged, key, 0, 1, _opd_base(kit), **gt)


GRPO_CHANGES = [
    ("algorithm.group_size", 4, 2, {}),
    ("algorithm.scope", "group", "global", {}),
    ("algorithm.normalize_by_std", True, False, {}),
    ("algorithm.std_ddof", 1, 0, {}),
    ("algorithm.eps", 1e-6, 10.0, {}),
    ("algorithm.clip_low", 0.2, 0.001, {}),
    ("algorithm.clip_high", 0.2, 0.001, {}),
    ("algorithm.dual_clip", None, 1.001, {}),
    ("algorithm.horizon", 8, 2, {"algorithm__aggregation": "seq_mean_token_sum_norm"}),
    ("algorithm.kl.type", "k3", "k1", {}),
    ("algorithm.kl.coef", 0.05, 1.0, {}),
    ("algorithm.updates_per_batch", 2, 1, {}),
    ("algorithm.old_logp_source", "replay", "rollout", {"algorithm__updates_per_batch": 1}),
]


@probe(
    "algorithm[grpo].name",
    "algorithm[sft].name",
    "algorithm[grpo].aggregation",
    *(f"algorithm[grpo].{k.removeprefix('algorithm.')}" for k, *_ in GRPO_CHANGES),
)
def _grpo(kit):
    """Two GRPO updates on one rollout batch of 4x4 images scored by the digits
    classifier (a continuous reward; the second update off-policy at lr 1e-2) change their
    losses and gradients with each knob."""
    plugins = [{"name": "digit_classifier", "path": str(kit.classifier)}]
    grpo = {**GRPO, "reward": {"plugins": plugins}}
    for key, a, b, fixed in GRPO_CHANGES:
        differs(kit, steps, key, a, b, grpo, **fixed)
    # horizon acts only with seq_mean_token_sum_norm (refused with the other two modes)
    sum_norm = {**GRPO["algorithm"], "aggregation": "seq_mean_token_sum_norm", "horizon": 8}
    differs(kit, steps, "algorithm", GRPO["algorithm"], sum_norm, grpo)
    sft = {**grpo, "algorithm": {"name": "sft"}}
    differs(kit, steps, "algorithm", {"name": "sft"}, GRPO["algorithm"], sft)


@probe("algorithm[grpo].surrogate", "algorithm[grpo].mismatch.replay_bound",
       "algorithm[grpo].mismatch.percentile")  # fmt: skip
def _grpo_mismatch(kit):
    """One GRPO update with bf16 training numerics against fp32 rollouts (a real
    sampler/replay gap): the aligned surrogate, the replay bound and the percentile guard
    each change the loss or gradient (their formulas: tests/test_mismatch.py)."""
    plugins = [{"name": "digit_classifier", "path": str(kit.classifier)}]
    grpo = {**GRPO, "reward": {"plugins": plugins}}
    one = {"trainer__total_updates": 1, "algorithm__updates_per_batch": 1,
           "trainer__precision": "bf16", "trainer__global_batch_size": 4}  # fmt: skip
    runs: dict[str, list] = {}  # the three baselines are one config: run it once

    def once(cfg):
        key = cfg.model_dump_json()
        if key not in runs:
            runs[key] = steps(cfg)
        return runs[key]

    differs(kit, once, "algorithm.surrogate", "standard", "aligned", grpo, **one)
    differs(kit, once, "algorithm.mismatch.replay_bound", None, 1.0001, grpo, **one)
    differs(kit, once, "algorithm.mismatch.percentile", None, 50.0, grpo, **one)
    assert len(runs) == 4


@probe("rollout.precision")
def _rollout_precision(kit):
    """The rollout log-probs a GRPO run records: fp32 or bf16-autocast sampling
    (dtype path and refusals: tests/test_horizons.py)."""
    plugins = [{"name": "digit_classifier", "path": str(kit.classifier)}]
    grpo = {**GRPO, "reward": {"plugins": plugins}}

    def logps(c):
        return [t.rollout_logp.tolist() for t in make_trainer(c).source.global_batch(0)]

    differs(kit, logps, "rollout.precision", "fp32", "bf16", grpo)


@probe("rollout.continuous_batching")
def _rollout_continuous_batching(kit):
    """The engine a GRPO run builds: static batches, or `rollout.batch_size` decode slots
    (that both give the same trajectories: tests/test_continuous_batching.py)."""
    plugins = [{"name": "digit_classifier", "path": str(kit.classifier)}]
    grpo = {**GRPO, "reward": {"plugins": plugins}, "model": {"tiny": {"mixer_kernel": 0}}}

    def slots(c):
        return make_trainer(c).source.service.engine.slots

    differs(kit, slots, "rollout.continuous_batching", False, True, grpo)


@probe("rollout.assignment")
def _rollout_assignment(kit):
    """The order in which one process samples a GRPO round's rows: static, the request
    order; dynamic, longest prepared length first (i2t_mc prompts carry an image, t2i's do
    not). Same trajectories and update at 1, 2 and 3 ranks: tests/test_queues.py."""
    plugins = [{"name": "digit_classifier", "path": str(kit.classifier)}]
    grpo = {
        **GRPO,
        "data": {"tasks": ["t2i", "i2t_mc"], "train_size": 8},
        "rollout": {"max_new_tokens": 16},
        "algorithm": {**GRPO["algorithm"], "group_size": 2},
        "reward": {"plugins": plugins + [{"name": "mc_exact"}]},
    }

    def order(c):
        source = make_trainer(c).source
        requests = source.requests(0)[1]
        lengths = [source.service.prepared_length(r) for r in requests]
        assert len(set(lengths)) > 1, "the probe needs rows of different prepared lengths"
        return source.service.generate_assigned(requests)[0]

    differs(kit, order, "rollout.assignment", "static", "dynamic", grpo)


@probe(
    "rollout.workers",
    "reward.workers",
    "ray.address",
    "ray.num_cpus",
    "ray.rollout_cpus",
    "ray.rollout_gpus",
    "ray.reward_cpus",
    "ray.max_worker_restarts",
)
def _ray_workers(kit):
    """What the Ray pools are started with (`RayPlan`: ray.init arguments, actor counts,
    each actor's resources and device, the replacement budget), without starting Ray;
    real runs with actors, a killed actor and a spent budget: tests/test_ray_workers.py."""
    from uniweave.train.onpolicy.workers import RayPlan

    plugins = [{"name": "digit_classifier", "path": str(kit.classifier)}]
    grpo = {**GRPO, "reward": {"plugins": plugins}}
    plan = lambda c: RayPlan.from_config(c)  # noqa: E731
    differs(kit, plan, "rollout.workers", 0, 2, grpo)
    differs(kit, plan, "reward.workers", 0, 1, grpo)
    on = {"rollout__workers": 1, "reward__workers": 1}
    differs(kit, plan, "ray.address", None, "ray://head:10001", grpo, **on)
    differs(kit, plan, "ray.num_cpus", None, 2, grpo, **on)
    differs(kit, plan, "ray.rollout_cpus", 1.0, 2.0, grpo, **on)
    differs(kit, plan, "ray.rollout_gpus", 0.0, 1.0, grpo, **on)
    differs(kit, plan, "ray.reward_cpus", 1.0, 0.5, grpo, **on)
    differs(kit, plan, "ray.max_worker_restarts", 3, 0, grpo, **on)


@probe("algorithm[grpo].share_prompt_prefix")
def _prefix_sharing(kit):
    """One GRPO update of the tiny body without the conv prior: with sharing the replay
    runs one row per distinct prompt through the decoder before the rows' completions
    (rows per decoder call differ; loss and gradients equal the unshared replay's to
    1e-6, tests/test_prefix_sharing.py)."""

    def decoder_rows(c):
        trainer = make_trainer(c)
        rows = []
        hook = trainer.model.decoder.register_forward_pre_hook(
            lambda m, a, k: rows.append(k["inputs_embeds"].shape[0]), with_kwargs=True
        )
        trainer.step()
        hook.remove()
        return rows

    plugins = [{"name": "digit_classifier", "path": str(kit.classifier)}]
    grpo = {**GRPO, "reward": {"plugins": plugins}}
    plain = {"model__tiny__mixer_kernel": 0, "trainer__total_updates": 1}
    differs(kit, decoder_rows, "algorithm.share_prompt_prefix", False, True, grpo, **plain)


# -- trainer ---------------------------------------------------------------------


@probe(
    "trainer.optimizer.lr",
    "trainer.optimizer.betas",
    "trainer.optimizer.weight_decay",
    "trainer.optimizer.eps",
    "trainer.scheduler.name",
    "trainer.scheduler.warmup_steps",
    "trainer.scheduler.min_lr_ratio",
    "trainer.global_batch_size",
    "trainer.grad_clip",
    "trainer.precision",
)
def _optimisation(kit):
    """Three SFT updates: losses, gradient norms, learning rates and clip scales."""
    for key, a, b, fixed in [
        ("trainer.optimizer.lr", 1e-2, 1e-3, {}),
        ("trainer.optimizer.betas", [0.9, 0.999], [0.5, 0.9], {}),
        ("trainer.optimizer.weight_decay", 0.0, 0.5, {}),
        ("trainer.optimizer.eps", 1e-8, 1e-1, {}),
        ("trainer.scheduler.name", "warmup_constant", "warmup_cosine",
         {"trainer__scheduler__warmup_steps": 1}),
        ("trainer.scheduler.warmup_steps", 0, 2, {"trainer__scheduler__name": "warmup_cosine"}),
        ("trainer.scheduler.min_lr_ratio", 0.0, 0.5, {"trainer__scheduler__name": "warmup_cosine"}),
        ("trainer.global_batch_size", 4, 2, {}),
        ("trainer.grad_clip", None, 1e-3, {}),
        ("trainer.precision", "fp32", "bf16", {}),
    ]:  # fmt: skip
        differs(kit, steps, key, a, b, **fixed)


@probe(
    "trainer.micro_batch_size",
    "trainer.micro_token_budget",
    "trainer.gradient_checkpointing",
    "trainer.packing",
)
def _geometry(kit):
    """One update: forward passes of a decoder MLP (one per micro-batch), the bytes
    autograd saves for backward (checkpointing keeps only the layers' inputs), and the
    attention mask the decoder gets (packing: block-causal [B, 1, T, T]; the loss is
    packing-invariant, tests/test_packing.py)."""

    def forwards(c):
        trainer = make_trainer(c)
        calls = []
        hook = trainer.model.decoder.layers[0].mlp.register_forward_hook(lambda *a: calls.append(1))
        trainer.step()
        hook.remove()
        return len(calls)

    def saved_bytes(c):
        trainer = make_trainer(c)
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.step()
        return sum(total)

    def mask_dims(c):
        trainer = make_trainer(c)
        dims = []

        def seen(module, args, kwargs):
            dims.append(kwargs["attention_mask"].dim())

        hook = trainer.model.decoder.register_forward_pre_hook(seen, with_kwargs=True)
        trainer.step()
        hook.remove()
        return dims

    one = {"trainer__total_updates": 1}
    differs(kit, mask_dims, "trainer.packing", False, True, **one)
    differs(kit, forwards, "trainer.micro_batch_size", 2, 1, **one)
    differs(kit, forwards, "trainer.micro_token_budget", None, 8, **one)
    differs(kit, saved_bytes, "trainer.gradient_checkpointing", False, True, **one)


@probe(
    "trainer.lora.enabled",
    "trainer.lora.r",
    "trainer.lora.alpha",
    "trainer.lora.dropout",
    "trainer.lora.target_modules",
    "trainer.lora.rslora",
)
def _lora(kit):
    """The adapters a run trains: which modules, their rank, scale and dropout."""

    def adapters(c):
        model = _prepare_model(c, Path(fresh_dir(kit)), torch.device("cpu"))
        trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        layers = [
            (n, m.r, m.scaling, [d.p for d in m.lora_dropout.values() if hasattr(d, "p")])
            for n, m in model.named_modules()
            if hasattr(m, "lora_A")
        ]
        return trainable, repr(layers)

    on = {"trainer__lora__enabled": True}
    differs(kit, adapters, "trainer.lora.enabled", False, True)
    differs(kit, adapters, "trainer.lora.r", 8, 2, **on)
    differs(kit, adapters, "trainer.lora.alpha", 16.0, 4.0, **on)
    differs(kit, adapters, "trainer.lora.dropout", 0.0, 0.5, **on)
    differs(kit, adapters, "trainer.lora.rslora", False, True, **on, trainer__lora__r=4)
    differs(
        kit, adapters, "trainer.lora.target_modules", r".*\.(q_proj|v_proj)$", r".*\.o_proj$", **on
    )


@contextmanager
def one_process_group(timeout_s: float = 60.0):
    """A 1-process gloo job as torchrun would set it up (`init_distributed`, ddp)."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        init_distributed(torch.device("cpu"), "ddp", timeout_s)
        yield
    finally:
        shutdown_distributed()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@probe(
    "trainer.parallel",
    "trainer.collective_timeout_s",
    "trainer.ddp.find_unused_parameters",
    "trainer.ddp.static_graph",
    "trainer.gradient_sync",
    "trainer.fsdp.param_dtype",
    "trainer.fsdp.reduce_dtype",
    "trainer.fsdp.reshard_after_forward",
)
def _parallel(kit):
    """The wrapper a 1-process torchrun job builds (2-process equivalence, resume and
    drift: tests/test_parallel.py): its type and DDP flags, the process group's timeout,
    and under fsdp2 the loss and gradient norm (all-gather / reduce dtypes) and whether
    a layer's parameters are sharded again after its forward."""
    with pytest.raises(ConfigError, match="trainer.parallel=ddp needs torchrun"):
        init_distributed(torch.device("cpu"), "ddp", 60.0)

    def timeout(c):
        with one_process_group(c.trainer.collective_timeout_s):
            return (
                dist.distributed_c10d._get_default_group()
                ._get_backend(torch.device("cpu"))
                .options._timeout
            )

    differs(kit, timeout, "trainer.collective_timeout_s", 60.0, 90.0, trainer__parallel="ddp")
    with one_process_group():
        wrapper = lambda c: type(make_trainer(c).parallel.wrapped).__name__  # noqa: E731
        differs(kit, wrapper, "trainer.parallel", "none", "ddp")
        differs(kit, wrapper, "trainer.parallel", "ddp", "fsdp2")
        ddp = {"trainer__parallel": "ddp"}
        flag = lambda name: lambda c: getattr(make_trainer(c).parallel.wrapped, name)  # noqa: E731
        unused = flag("find_unused_parameters")
        differs(kit, unused, "trainer.ddp.find_unused_parameters", True, False, **ddp)
        differs(kit, flag("static_graph"), "trainer.ddp.static_graph", False, True, **ddp)
        # the SUM hook is registered only for post_backward_sum (2-rank equality of both:
        # tests/test_scale.py)
        hooks = lambda c: len(make_trainer(c).parallel.wrapped._comm_hooks)  # noqa: E731
        differs(kit, hooks, "trainer.gradient_sync", "ddp", "post_backward_sum", **ddp)
        fsdp = {"trainer__parallel": "fsdp2", "trainer__total_updates": 1}
        differs(kit, steps, "trainer.fsdp.param_dtype", "fp32", "bf16", **fsdp)
        # one process reduce-scatters nothing: the policy its 2-process run reduces with
        group = lambda c: make_trainer(c).parallel.runner._get_fsdp_state()._fsdp_param_group  # noqa: E731
        reduce = lambda c: group(c).mp_policy.reduce_dtype  # noqa: E731
        differs(kit, reduce, "trainer.fsdp.reduce_dtype", "fp32", "bf16", **fsdp)

        def resharded(c):
            trainer = make_trainer(c)
            batch = TrajectoryBatch.collate(trainer.source.global_batch(0), trainer.pad_id)
            with torch.no_grad():
                trainer.parallel.run(lambda m, b: m.hidden(m.prepare(b)), batch)
            weight = trainer.model.decoder.layers[0].mlp.up_proj.weight
            return type(weight).__name__

        differs(kit, resharded, "trainer.fsdp.reshard_after_forward", True, False, **fsdp)


# -- checkpoints, resume, logging, training length ---------------------------------


@probe(
    "trainer.total_updates",
    "checkpoint.every_updates",
    "checkpoint.every_minutes",
    "checkpoint.keep_last",
    "logging.jsonl",
    "logging.tensorboard",
    "logging.every",
)
def _run_files(kit):
    """What a real `fit` leaves in the run directory."""

    def files(c):
        c = config(kit, {"run.output_dir": fresh_dir(kit)}, {
            "trainer": c.trainer.model_dump(), "checkpoint": c.checkpoint.model_dump(),
            "logging": c.logging.model_dump()})  # fmt: skip
        run_dir, metrics = fit_run(kit, c)
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("update-*"))
        jsonl = run_dir / "metrics.jsonl"
        logged = (
            [json.loads(line)["update"] for line in jsonl.read_text().splitlines()]
            if jsonl.is_file()
            else None
        )
        return len(metrics), ckpts, logged, (run_dir / "tensorboard").is_dir()

    differs(kit, files, "trainer.total_updates", 3, 2)
    differs(kit, files, "checkpoint.every_updates", 0, 1)
    differs(kit, files, "checkpoint.every_minutes", 0.0, 1e-9)
    differs(kit, files, "checkpoint.keep_last", 0, 1, checkpoint__every_updates=1)
    differs(kit, files, "logging.jsonl", True, False)
    differs(kit, files, "logging.tensorboard", False, True)
    differs(kit, files, "logging.every", 1, 2)


@probe("checkpoint.resume_mode")
def _resume_mode(kit):
    saved = config(kit, {"trainer.total_updates": 2})
    observe = lambda c: resume_conflicts(saved, c)  # noqa: E731
    differs(kit, observe, "checkpoint.resume_mode", "strict", "allow_schedule_changes")
    differs(kit, observe, "checkpoint.resume_mode", "strict", "epoch_extension")
    capped = lambda c: resume_conflicts(saved, c)  # noqa: E731
    differs(
        kit, capped, "checkpoint.resume_mode", "strict", "rollout_limit_change",
        rollout__max_new_tokens=32, trainer__total_updates=2,
    )  # fmt: skip
    differs(
        kit, capped, "checkpoint.resume_mode", "rollout_limit_change", "execution_change",
        rollout__max_new_tokens=32, trainer__total_updates=2,
    )  # fmt: skip


@probe("run.parent")
def _run_parent(kit):
    """A run directory with no checkpoint starts from its parent's newest checkpoint."""
    parent = Path(fresh_dir(kit))
    fit_run(kit, config(kit, {"run.output_dir": str(parent), "trainer.total_updates": 1}))
    child = fresh_dir(kit)

    def start(c):
        trainer = make_trainer(c, Path(child))
        return trainer.resume(), trainer.update

    differs(
        kit, start, "run.parent", None, str(parent),
        run__output_dir=child, trainer__total_updates=1,
    )  # fmt: skip


@probe("model.initial_adapter")
def _initial_adapter(kit):
    """A LoRA run's adapter (written by `save_adapter`) is what the run's LoRA starts from."""
    from uniweave.train.engine.adapters import lora_targets, save_adapter

    lora = {"enabled": True, "r": 2, "target_modules": r".*\.(q_proj|v_proj)$"}
    base = {"model": {"path": str(kit.saved), "tiny": {}, "codec": {}}, "trainer": {"lora": lora}}
    trained = config(kit, {}, base)
    model = _prepare_model(trained, kit.root, torch.device("cpu"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    adapter = kit.root / "adapter"
    save_adapter(model, trained, adapter, lora_targets(model))

    def lora_b(c):
        started = _prepare_model(c, kit.root, torch.device("cpu"))
        return sum(
            float(p.detach().abs().sum()) for n, p in started.named_parameters() if "lora_B" in n
        )

    differs(kit, lora_b, "model.initial_adapter", None, str(adapter), base)


@probe("logging.samples_every", "logging.wandb")
def _logger(kit):
    """Rollout samples go out every `samples_every` updates; `wandb` starts a W&B run
    (offline here) in the run directory."""
    import os

    sample = {"prompt": "p", "response": "r", "reward": 1.0, "image": None}

    def sinks(c):
        run_dir = Path(fresh_dir(kit))
        run_dir.mkdir()
        logger = MetricsLogger(run_dir, c.logging, c.model_dump(mode="json"))
        written = [logger.log_samples(u, [sample]) for u in range(1, 5)]
        logger.close()
        return written, (run_dir / "wandb").is_dir()

    plugins = [{"name": "digit_classifier", "path": str(kit.classifier)}]
    grpo = {**GRPO, "reward": {"plugins": plugins}}
    differs(kit, sinks, "logging.samples_every", 0, 2, grpo, logging__tensorboard=True)
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        env[var] = str(kit.root / var)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        differs(kit, sinks, "logging.wandb", False, True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- the coverage check and the probes themselves -----------------------------------


# -- your own data and `uniweave eval` ---------------------------------------------------


def own_rows(kit: SimpleNamespace) -> dict[str, Path]:
    """A labelled dataset in three files: train (one untagged row), val and test."""
    out = {}
    for split, words in (("train", ("red", "blue")), ("val", ("green",)), ("test", ("gold",))):
        rows = [
            {
                "id": f"{split}-{w}",
                "answer": w,
                "messages": [
                    {"role": "user", "content": f"say {w}"},
                    {"role": "assistant", "content": w},
                ],
                **({"task": "colour"} if (split, w) != ("train", "blue") else {}),
            }
            for w in words
        ]
        path = kit.root / f"own_{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[split] = path
    return out


OWN = {"data": {"tasks": ["colour"], "default_task": "colour", "val_size": 1, "test_size": 1}}


def own_base(kit: SimpleNamespace) -> dict[str, Any]:
    paths = own_rows(kit)
    return {
        "data": {
            **OWN["data"],
            "path": str(paths["train"]),
            "val_path": str(paths["val"]),
            "test_path": str(paths["test"]),
        },
        "reward": {"plugins": [{"name": "text_exact"}]},
        "rollout": {"max_new_tokens": 4},
    }


def own_config(kit: SimpleNamespace, changes: dict[str, Any]) -> UniweaveConfig:
    return config(kit, changes, own_base(kit))


def scratch(kit: SimpleNamespace) -> Path:
    path = Path(fresh_dir(kit))
    path.mkdir()
    return path


@probe("data.val_path", "data.test_path", "data.default_task", "data.image_resize")
def _own_rows(kit):
    """Which rows a split holds, and what happens to an image of another size."""
    tmp_path = scratch(kit)
    ids = lambda split: lambda c: [s.id for s in split_rows(c.data, split).samples]  # noqa: E731
    assert ids("val")(own_config(kit, {})) == ["val-green"]
    assert ids("test")(own_config(kit, {})) == ["test-gold"]
    with pytest.raises(DatasetError, match="no rows with split 'val'"):
        ids("val")(own_config(kit, {"data.val_path": None}))
    with pytest.raises(DatasetError, match="no rows with split 'test'"):
        ids("test")(own_config(kit, {"data.test_path": None}))
    assert ids("train")(own_config(kit, {})) == ["train-red", "train-blue"]
    with pytest.raises(DatasetError, match="task: missing"):
        ids("train")(own_config(kit, {"data.default_task": None}))
    Image.fromarray(np.full((16, 16, 3), 200, np.uint8)).save(tmp_path / "big.png")
    row = {
        "id": "img",
        "task": "colour",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "path": "big.png"},
                    {"type": "text", "text": "which colour"},
                ],
            },
            {"role": "assistant", "content": "red"},
        ],
    }
    (tmp_path / "img.jsonl").write_text(json.dumps(row) + "\n")
    processor = lambda c: processor_for("tiny", (8, 8), c.data.image_resize)  # noqa: E731
    load = lambda c: split_rows(c.data, "train", processor(c)).samples  # noqa: E731
    sized = own_config(
        kit, {"data.path": str(tmp_path / "img.jsonl"), "data.image_resize": "resize"}
    )
    image = next(p for p in load(sized)[0].parts if isinstance(p, ImagePart))
    assert np.asarray(image.pixels).shape[:2] == (8, 8)
    strict = own_config(
        kit, {"data.path": str(tmp_path / "img.jsonl"), "data.image_resize": "error"}
    )
    with pytest.raises(DatasetError, match="img.jsonl:1"):
        load(strict)


@probe("data.tokenizer", "data.bpe_vocab_size")
def _own_tokenizer(kit):
    """The tiny model's tokenizer trained on the rows: its vocabulary."""

    def vocab(c: UniweaveConfig) -> int:
        return len(config_tokenizer(c, Path(fresh_dir(kit))))

    digits = kit.root / "digit_answers.jsonl"
    words = "which digit is shown here please answer quickly carefully honestly today".split()
    rows = [
        {
            "task": "colour",
            "messages": [
                {"role": "user", "content": " ".join(words[k % 5 :] + [str(k * 37)])},
                {"role": "assistant", "content": "37A"[k % 3]},
            ],
        }
        for k in range(40)
    ]
    digits.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = own_base(kit)
    base["data"] = {**base["data"], "path": str(digits)}
    differs(kit, vocab, "data.tokenizer", "bpe", "word", base=base)
    differs(kit, vocab, "data.bpe_vocab_size", 300, 320, base=base)


@probe(
    "evaluation.split",
    "evaluation.max_samples",
    "evaluation.rollouts_per_sample",
    "evaluation.greedy",
    "evaluation.sample_images",
    "evaluation.pass_threshold",
    "evaluation.output_dir",
)
def _evaluation(kit):
    """`uniweave eval` on the kit's tiny model: which rows, how many rollouts, how they are
    drawn and passed, and where the results go."""
    tmp_path = scratch(kit)
    model = build_model(own_config(kit, {})).eval()

    def records(c: UniweaveConfig) -> tuple:
        out = tmp_path / f"eval{next(_runs)}"
        summary = evaluate(c, model, out)
        lines = (out / "results.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        return summary["all"]["pass@n"], tuple((r["id"], r["member"], r["response"]) for r in rows)

    assert records(own_config(kit, {"evaluation.split": "val"}))[1][0][0] == "val-green"
    assert records(own_config(kit, {"evaluation.split": "test"}))[1][0][0] == "test-gold"
    two = {"evaluation.split": "train"}
    assert len(records(own_config(kit, {**two, "evaluation.max_samples": 1}))[1]) == 1
    assert len(records(own_config(kit, {**two, "evaluation.max_samples": 0}))[1]) == 2
    sampled = {**two, "evaluation.greedy": False}
    three = own_config(kit, {**sampled, "evaluation.rollouts_per_sample": 3})
    assert len(records(three)[1]) == 6
    request = lambda c: make_request(c, eval_samples(c, model)[0], 0, 0, (4, 4))  # noqa: E731
    assert request(own_config(kit, two)).params.greedy
    assert not request(own_config(kit, sampled)).params.greedy
    t2i = make_task_samples("t2i", "val", 1)[0]  # an image answer: sampled under greedy
    image = lambda c: make_request(c, t2i, 0, 0, (4, 4)).params  # noqa: E731
    assert not image(own_config(kit, {"evaluation.sample_images": True})).greedy
    assert image(own_config(kit, {"evaluation.sample_images": False})).greedy
    assert image(own_config(kit, {"evaluation.sample_images": False})).length_semantics == "exact"
    assert records(own_config(kit, {**two, "evaluation.pass_threshold": -1.0}))[0] == 1.0
    assert records(own_config(kit, {**two, "evaluation.pass_threshold": 2.0}))[0] == 0.0
    where = str(tmp_path / "chosen")
    chosen = own_config(kit, {**two, "evaluation.output_dir": where})
    assert run_eval(chosen) == Path(where) and (Path(where) / "summary.json").is_file()
    default = own_config(kit, {**two, "run.output_dir": str(tmp_path / "r")})
    assert run_eval(default) == tmp_path / "r" / "eval-train"


@probe("evaluation.workers_per_gpu")
def _evaluation_workers(kit):
    """Two workers both compute records (a rollout whose first call per worker waits for
    the other: neither drains the queue alone), equal to one worker's; one worker
    computes them all (tests/test_eval_workers.py: resume, exact equality)."""
    import threading

    from uniweave.eval.runner import engine_rollout

    tmp_path = scratch(kit)
    model = build_model(own_config(kit, {})).eval()
    meet = threading.Barrier(2, timeout=30)

    def meeting(m):
        generate, first = engine_rollout(m), [True]

        def rollout(requests):
            if first[0]:
                first[0] = False
                meet.wait()
            return generate(requests)

        return rollout

    def run(workers: int, **kwargs) -> tuple:
        split = {"evaluation.split": "train", "rollout.batch_size": 1}  # 2 rows: 2 claims
        c = own_config(kit, {**split, "evaluation.workers_per_gpu": workers})
        out, worked_by = tmp_path / f"workers{next(_runs)}", {}
        evaluate(c, model, out, worked_by=worked_by, **kwargs)
        lines = (out / "results.jsonl").read_text().splitlines()
        return sorted(lines), set(worked_by.values())

    one, by_one = run(1)
    two, by_two = run(2, rollout=meeting)
    assert by_one == {0} and by_two == {0, 1} and one == two


# -- health alarms (issue 34) -----------------------------------------------------------

HEALTH_STREAM = [
    {
        "adv/frac_zero_std_groups": 0.8,
        "adv/advantage_std": 0.0,
        "grad_norm": 0.0,
        "reward/overwritten_frac": 0.6,
        "reward/total_mean": 0.99,
        "policy/kl_ref_mean": 0.5 * u,
        "policy/entropy_visual": 1.0 / u,
        "reward/p/invalid_frac": 0.05 * u,
    }
    for u in range(1, 5)
]
"""Four updates' metrics, each near one of the default thresholds."""


def _heldout_records(shift: float) -> list[dict]:
    """12 prompts x 1 rollout whose totals differ by `shift` ± 0.1 (paired diff/SE ~ 3.5
    for shift 0.1)."""
    return [
        {"id": f"p{i}", "task": "t", "member": 0, "total": 0.5 + shift + 0.1 * (i % 2) * (shift != 0),
         "passed": True, "invalid": ["p"] if i < 3 * (shift != 0) else []}
        for i in range(12)
    ]  # fmt: skip


@probe(
    "health.heldout_se",
    "health.heldout_drop",
    "health.zero_variance_share",
    "health.zero_signal_updates",
    "health.truncation_overwrite_share",
    "health.reward_saturation",
    "health.entropy_collapse_ratio",
    "health.kl_max",
    "health.invalid_rise",
)
def _health(kit):
    """The alarms (name, metric) a run's monitor fires on a fixed metric stream and on a
    held-out evaluation that fell (`uniweave.eval.health`)."""
    from uniweave.eval.health import HealthMonitor
    from uniweave.eval.paired import compare

    def fired(c):
        monitor = HealthMonitor(c.health)
        for u, metrics in enumerate(HEALTH_STREAM, 1):
            monitor.observe(u, metrics)
        drop = compare(_heldout_records(0.0), _heldout_records(-0.1), c.health.heldout_se)
        monitor.heldout(5, "val", drop)
        return sorted((a.name, a.key, a.update) for a in monitor.fired)

    differs(kit, fired, "health.heldout_se", 2.0, 10.0)
    differs(kit, fired, "health.heldout_drop", True, False)
    differs(kit, fired, "health.zero_variance_share", 0.75, 0.9)
    differs(kit, fired, "health.zero_signal_updates", 3, 5)
    differs(kit, fired, "health.truncation_overwrite_share", 0.5, None)
    differs(kit, fired, "health.reward_saturation", 0.98, 0.995)
    differs(kit, fired, "health.entropy_collapse_ratio", 0.1, 0.5)
    differs(kit, fired, "health.kl_max", 1.0, 5.0)
    differs(kit, fired, "health.invalid_rise", 0.1, 0.5)


OFF_TARGET_STREAM = [
    {"reward/total_mean": r, "images/brightness": b}
    for r, b in zip([0.1, 0.25, 0.3, 0.45], [0.5, 0.45, 0.4, 0.35])
]
"""A rising reward (least-squares drift 0.33, residual noise 0.022: drift/noise 14.8) and
a brightness drifting by -0.15 over the four updates."""


@probe("health.off_target_drift", "health.off_target_reward_ratio")
def _off_target(kit):
    """The off_target alarms of a fixed stream (`uniweave.eval.health`)."""
    from uniweave.eval.health import HealthMonitor

    def fired(c):
        monitor = HealthMonitor(c.health)
        for u, metrics in enumerate(OFF_TARGET_STREAM, 1):
            monitor.observe(u, metrics)
        return sorted((a.name, a.key, a.update) for a in monitor.fired)

    differs(kit, fired, "health.off_target_drift", 0.1, 0.2)
    differs(kit, fired, "health.off_target_reward_ratio", 3.0, 20.0)


@probe("health.baseline_eval")
def _baseline_eval(kit):
    """The starting model's evaluation (update 0) of a run with test rows."""
    from uniweave.train.run import baseline_evaluations

    def baseline(c):
        run_dir = Path(fresh_dir(kit))
        copy_classifier(kit, run_dir)
        baseline_evaluations(c, build_model(c), run_dir)
        return sorted(p.name for p in (run_dir / "evals").glob("*"))

    differs(kit, baseline, "health.baseline_eval", True, False, data__test_size=2)


def test_every_schema_field_has_a_probe_or_an_exemption():
    leaves = schema_leaves(UniweaveConfig)
    assert len(leaves) == len(set(leaves))
    neither = [k for k in leaves if k not in PROBES and k not in EXEMPT]
    both = [k for k in leaves if k in PROBES and k in EXEMPT]
    stale = [k for k in [*PROBES, *EXEMPT] if k not in leaves]
    assert not neither, f"fields with no probe and no exemption: {neither}"
    assert not both and not stale, (both, stale)
    assert all(reason.strip() for reason in EXEMPT.values())


@pytest.mark.parametrize("fn", sorted(set(PROBES.values()), key=lambda f: f.__name__),
                         ids=lambda f: f.__name__.strip("_"))  # fmt: skip
def test_probe(fn, kit):
    fn(kit)


# -- settings that another setting makes inactive are refused (issue 29) --------------

GRPO_RUN = {"algorithm": {"name": "grpo"}, "reward": {"plugins": [{"name": "mc_exact"}]}}
OPD_RUN = {"algorithm": {"name": "opd", "teacher": {"path": "t"}}}
JANUS = {"model": {"kind": "janus_pro", "path": "/ckpt/janus"}}
UNIAR = {"model": {"kind": "uniar", "visual_head": "bsq", "tiny": {"mixer_kernel": 0}}}
SUM_NORM = {"algorithm": {"aggregation": "seq_mean_token_sum_norm"}}
IG_ON = {"algorithm": {"name": "sft", "information_gain": {"weight": 1.0}}}
INERT: list[tuple[str, dict, str, str, dict]] = [
    # (id, config, refused dotted key, message fragment, what makes the value act)
    ("tiny_tie_under_uniar", {**UNIAR, "model": {**UNIAR["model"], "tiny": {
        "mixer_kernel": 0, "tie_embeddings": True}}}, "model.tiny.tie_embeddings",
     "acts only with model.kind tiny", {"model": {"kind": "tiny", "visual_head": "bsq"}}),
    ("tiny_sizes_under_janus", {"model": {**JANUS["model"], "tiny": {"hidden_size": 64}}},
     "model.tiny.hidden_size", "kind 'janus_pro' takes its sizes from the model.path",
     {"model": {"kind": "tiny", "path": None}}),
    ("tiny_tie_under_janus", {"model": {**JANUS["model"], "tiny": {"tie_embeddings": True}}},
     "model.tiny.tie_embeddings", "built from the config (kind tiny or uniar)",
     {"model": {"kind": "tiny", "path": None}}),
    ("codec_geometry_under_uniar", {**UNIAR, "model": {**UNIAR["model"], "codec": {
        "image_size": 16}}}, "model.codec.image_size", "reads 8x8 greyscale digits",
     {"model": {"kind": "tiny"}}),
    ("warmup_under_constant", {"trainer": {"scheduler": {"warmup_steps": 5}}},
     "trainer.scheduler.warmup_steps", "the 'constant' schedule has no warmup",
     {"trainer": {"scheduler": {"name": "warmup_constant"}}}),
    ("min_lr_ratio_without_cosine", {"trainer": {"scheduler": {"min_lr_ratio": 0.1}}},
     "trainer.scheduler.min_lr_ratio", "the 'constant' schedule keeps the peak lr",
     {"trainer": {"scheduler": {"name": "warmup_cosine"}}}),
    ("kl_coef_without_kl", {**GRPO_RUN, "algorithm": {"name": "grpo", "kl": {"coef": 0.1}}},
     "algorithm.kl.coef", "coef=0.1 has no effect with type='none'",
     {"algorithm": {"kl": {"type": "k3"}}}),
    # a tiny or uniar model.path's sizes and a tiny one's codec path are checked against the
    # directory (with_saved_sizes): tests/test_cli.py, real saved models
    ("uniar_codec_with_a_path", {"model": {**UNIAR["model"], "path": "/ckpt/uniar", "tiny": {},
                                           "codec": {"bits": 8}}},
     "model.codec.bits", "acts only for a model built from the config (model.path null)",
     {"model": {"path": None}}),
    ("codec_under_janus", {"model": {**JANUS["model"], "codec": {"codebook_size": 64}}},
     "model.codec.codebook_size", "kind 'janus_pro' ships its image codec",
     {"model": {"kind": "tiny", "path": None}}),
    ("codebook_with_bsq", {"model": {"visual_head": "bsq", "codec": {"codebook_size": 64}}},
     "model.codec.codebook_size", "acts only with model.visual_head vq",
     {"model": {"visual_head": "vq"}}),
    ("bits_with_vq", {"model": {"codec": {"bits": 8}}}, "model.codec.bits",
     "acts only with model.visual_head bsq", {"model": {"visual_head": "bsq"}}),
    ("group_with_vq", {"model": {"codec": {"group": 2}}}, "model.codec.group",
     "acts only with model.visual_head bsq", {"model": {"visual_head": "bsq"}}),
    ("rollout_old_logp_under_aligned", {**GRPO_RUN, "algorithm": {
        "name": "grpo", "surrogate": "aligned", "old_logp_source": "rollout"}},
     "algorithm.old_logp_source", "acts only with surrogate 'standard'",
     {"algorithm": {"surrogate": "standard"}}),
    ("horizon_with_token_mean", {**GRPO_RUN, "algorithm": {"name": "grpo", "horizon": 64}},
     "algorithm.horizon", "acts only with aggregation 'seq_mean_token_sum_norm' (got "
     "'token_mean'", SUM_NORM),
    ("horizon_with_seq_mean_token_mean", {**GRPO_RUN, "algorithm": {
        "name": "grpo", "aggregation": "seq_mean_token_mean", "horizon": 64}},
     "algorithm.horizon", "(got 'seq_mean_token_mean'", SUM_NORM),
    *((f"lora_{k}_when_off", {"trainer": {"lora": {k: v}}}, f"trainer.lora.{k}",
       "acts only with trainer.lora.enabled true", {"trainer": {"lora": {"enabled": True}}})
      for k, v in [("r", 16), ("alpha", 32.0), ("dropout", 0.1), ("rslora", True),
                   ("target_modules", r".*\.q_proj$")]),
    ("ddp_under_none", {"trainer": {"ddp": {"find_unused_parameters": False}}},
     "trainer.ddp.find_unused_parameters", "acts only with trainer.parallel ddp (got 'none')",
     {"trainer": {"parallel": "ddp"}}),
    ("gradient_sync_under_none", {"trainer": {"gradient_sync": "post_backward_sum"}},
     "trainer.gradient_sync", "acts only with trainer.parallel ddp (got 'none'",
     {"trainer": {"parallel": "ddp"}}),
    ("ddp_under_fsdp2", {"trainer": {"parallel": "fsdp2", "ddp": {"static_graph": True}}},
     "trainer.ddp.static_graph", "acts only with trainer.parallel ddp (got 'fsdp2')",
     {"trainer": {"parallel": "ddp"}}),
    ("fsdp_under_ddp", {"trainer": {"parallel": "ddp", "fsdp": {"param_dtype": "fp32"}}},
     "trainer.fsdp.param_dtype", "acts only with trainer.parallel fsdp2 (got 'ddp')",
     {"trainer": {"parallel": "fsdp2"}}),
    ("fsdp_reduce_under_none", {"trainer": {"fsdp": {"reduce_dtype": "bf16"}}},
     "trainer.fsdp.reduce_dtype", "acts only with trainer.parallel fsdp2 (got 'none')",
     {"trainer": {"parallel": "fsdp2"}}),
    ("fsdp_reshard_under_none", {"trainer": {"fsdp": {"reshard_after_forward": False}}},
     "trainer.fsdp.reshard_after_forward", "acts only with trainer.parallel fsdp2",
     {"trainer": {"parallel": "fsdp2"}}),
    ("collective_timeout_under_none", {"trainer": {"collective_timeout_s": 60.0}},
     "trainer.collective_timeout_s", "opens no process group", {"trainer": {"parallel": "ddp"}}),
    *((f"ig_{k}_when_off", {"algorithm": {"name": "sft", "information_gain": {k: v}}},
       f"algorithm.information_gain.{k}", "acts only with information_gain.weight > 0", IG_ON)
      for k, v in [("formulation", "absolute"), ("temperature", 1.0), ("eps", 1e-2),
                   ("text_to_visual_weight", 0.5), ("visual_to_text_weight", 0.0),
                   ("event_selection", "all"), ("blind_view_chunk_size", 2)]),
    *((f"{k}_without_std", {**GRPO_RUN, "algorithm": {
        "name": "grpo", "normalize_by_std": False, k: v}}, f"algorithm.{k}",
       "acts only with normalize_by_std true", {"algorithm": {"normalize_by_std": True}})
      for k, v in [("std_ddof", 0), ("eps", 1e-3)]),
    ("bitflip_mode_without_flips", {"model": {"visual_head": "bsq"},
                                    "algorithm": {"name": "sft",
                                                  "bitflip": {"probability_mode": "uniform"}}},
     "algorithm.bitflip.probability_mode", "acts only with bitflip.probability > 0",
     {"algorithm": {"bitflip": {"probability": 0.1}}}),
    ("bitflip_partition_without_flips", {"model": {"visual_head": "bsq"},
                                         "algorithm": {"name": "sft",
                                                       "bitflip": {"partition": "half"}}},
     "algorithm.bitflip.partition", "acts only with bitflip.probability > 0",
     {"algorithm": {"bitflip": {"probability": 0.1}}}),
    ("full_view_without_half", {"model": {"visual_head": "bsq"}, "algorithm": {
        "name": "sft", "bitflip": {"probability": 0.1},
        "information_gain": {"weight": 1.0, "student_full_view": "sequential"}}},
     "algorithm.information_gain.student_full_view",
     "acts only with bitflip.probability > 0 and bitflip.partition half",
     {"algorithm": {"bitflip": {"partition": "half"}}}),
    ("soft_bsq_with_vq", {"algorithm": {"name": "sft", "soft_bsq": {"weight": 0.5}}},
     "algorithm.soft_bsq.weight", "acts only with model.visual_head bsq",
     {"model": {"visual_head": "bsq"}}),
    ("nd_decay_when_off", {"algorithm": {"name": "sft", "necessity_distillation": {
        "ema_decay": 0.9}}}, "algorithm.necessity_distillation.ema_decay",
     "acts only with necessity_distillation.weight > 0",
     {"algorithm": {"necessity_distillation": {"weight": 1.0}}}),
    ("nd_fraction_with_threshold_selection", {"algorithm": {"name": "sft",
        "necessity_distillation": {"weight": 1.0, "carrier_fraction": 0.3}}},
     "algorithm.necessity_distillation.carrier_fraction", "acts only with selection fraction",
     {"algorithm": {"necessity_distillation": {"selection": "fraction"}}}),
    ("nd_threshold_with_fraction_selection", {"algorithm": {"name": "sft",
        "necessity_distillation": {"weight": 1.0, "selection": "fraction",
                                   "min_necessity": 0.1}}},
     "algorithm.necessity_distillation.min_necessity", "acts only with selection min_necessity",
     {"algorithm": {"necessity_distillation": {"selection": "min_necessity"}}}),
    ("nd_with_packing", {"algorithm": {"name": "sft", "necessity_distillation": {
        "weight": 1.0}}, "trainer": {"packing": True}}, "trainer.packing",
     "packing with necessity distillation", {"algorithm": {"necessity_distillation": {
         "weight": 0.0}}}),
    ("nd_under_ddp", {"algorithm": {"name": "sft", "necessity_distillation": {"weight": 1.0}},
                      "trainer": {"parallel": "ddp"}},
     "algorithm.necessity_distillation.weight", "is built for one process",
     {"trainer": {"parallel": "none"}}),
    ("grpo_ig_clip_when_off", {**GRPO_RUN, "algorithm": {"name": "grpo",
        "information_gain": {"clip": 0.5}}}, "algorithm.information_gain.clip",
     "acts only with information_gain.weight > 0",
     {"algorithm": {"information_gain": {"weight": 0.5}}}),
    ("grpo_ig_under_ddp", {**GRPO_RUN, "algorithm": {"name": "grpo",
        "information_gain": {"weight": 0.5}}, "trainer": {"parallel": "ddp"}},
     "algorithm.information_gain.weight", "is built for one process",
     {"trainer": {"parallel": "none"}}),
    ("guidance_logprob_without_guidance", {"rollout": {"guidance_logprob": "conditional"}},
     "rollout.guidance_logprob", "acts only with rollout.guidance != 1",
     {"rollout": {"guidance": 2.0}}),
    ("bit_temperature_with_vq", {"rollout": {"bit_temperature": 0.5}},
     "rollout.bit_temperature", "acts only with model.visual_head bsq",
     {"model": {"visual_head": "bsq"}}),
    ("cycle_repeats_with_the_stop_off", {"rollout": {"cycle_max_period": 0, "cycle_repeats": 5}},
     "rollout.cycle_repeats", "acts only with rollout.cycle_max_period > 0",
     {"rollout": {"cycle_max_period": 4}}),
    ("eval_every_without_val_rows", {"trainer": {"eval_every": 5}, "data": {"val_size": 0}},
     "trainer.eval_every", "5 evaluates nothing: data.val_size is 0",
     {"data": {"val_size": 4}}),
    ("logging_every_without_a_sink", {"logging": {"every": 5, "jsonl": False,
                                                  "tensorboard": False}},
     "logging.every", "acts only with a metrics sink", {"logging": {"jsonl": True}}),
    ("samples_every_without_tb_or_wandb", {**GRPO_RUN, "logging": {
        "samples_every": 10, "tensorboard": False}}, "logging.samples_every",
     "acts only with logging.tensorboard or logging.wandb", {"logging": {"tensorboard": True}}),
    ("samples_every_under_sft", {"logging": {"samples_every": 10}}, "logging.samples_every",
     "sft logs no samples", GRPO_RUN),
    ("gradient_diagnostics_under_grpo", {**GRPO_RUN, "logging": {
        "gradient_diagnostics_every_updates": 5}}, "logging.gradient_diagnostics_every_updates",
     "acts only with opd", {"algorithm": {"name": "opd", "teacher": {"path": "t"},
                                          "gt_replay": {"mode": "uniform", "budget": 2}}}),
    ("gradient_diagnostics_without_gt_replay", {**OPD_RUN, "logging": {
        "gradient_diagnostics_every_updates": 5}}, "logging.gradient_diagnostics_every_updates",
     "acts only with GT replay", {"algorithm": {"gt_replay": {"mode": "uniform", "budget": 2}}}),
    ("shuffle_under_grpo", {**GRPO_RUN, "data": {"shuffle": False}}, "data.shuffle",
     "acts only with sft: grpo draws its prompts", {"algorithm": {"name": "sft"}}),
    ("over_length_without_a_limit", {"data": {"over_length": "drop"}}, "data.over_length",
     "acts only with data.max_sequence_tokens set", {"data": {"max_sequence_tokens": 64}}),
    ("max_sequence_tokens_under_grpo", {**GRPO_RUN, "data": {"max_sequence_tokens": 64}},
     "data.max_sequence_tokens", "acts only with sft: grpo rows are bounded by the rollout",
     {"algorithm": {"name": "sft"}}),
    ("null_horizon_with_the_cycle_stop_off", {"rollout": {"max_new_tokens": None,
                                                          "cycle_max_period": 0}},
     "rollout.max_new_tokens", "needs the cycle detector on",
     {"rollout": {"cycle_max_period": 4}}),
    ("rollout_precision_under_sft", {"rollout": {"precision": "bf16"}}, "rollout.precision",
     "acts only with rollouts in training (grpo, opd)", GRPO_RUN),
    ("continuous_batching_under_sft", {"rollout": {"continuous_batching": True}},
     "rollout.continuous_batching", "acts only with rollouts in training", {**GRPO_RUN,
     "model": {"tiny": {"mixer_kernel": 0}}}),
    ("continuous_batching_with_ray_workers", {**GRPO_RUN, "model": {"tiny": {"mixer_kernel": 0}},
     "rollout": {"continuous_batching": True, "workers": 1}}, "rollout.continuous_batching",
     "acts only in-process", {"rollout": {"workers": 0}}),
    ("continuous_batching_with_the_conv_prior", {**GRPO_RUN, "rollout": {
        "continuous_batching": True}}, "rollout.continuous_batching", "mixer_kernel=0",
     {"model": {"tiny": {"mixer_kernel": 0}}}),
    ("continuous_batching_under_uniar", {**GRPO_RUN, **UNIAR, "rollout": {
        "continuous_batching": True}}, "rollout.continuous_batching", "model.kind uniar",
     {"model": {"kind": "tiny", "visual_head": "bsq"}}),
    ("rollout_assignment_under_sft", {"rollout": {"assignment": "dynamic"}},
     "rollout.assignment", "acts only with rollouts in training (grpo, opd)", GRPO_RUN),
]  # fmt: skip


def _dotted(data: dict, key: str, value: Any = ...) -> Any:
    """`data`'s value at dotted `key`; with `value`, set it there (sections created)."""
    *parents, leaf = key.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    if value is not ...:
        data[leaf] = value
    return data[leaf]


@pytest.mark.parametrize(("case", "key", "fragment", "acts"), [c[1:] for c in INERT],
                         ids=[c[0] for c in INERT])  # fmt: skip
def test_a_setting_another_makes_inactive_is_refused(tmp_path, capsys, case, key, fragment, acts):
    """A non-default value of a setting the rest of the config makes inactive is a config
    error naming the file and the dotted key (`uniweave inspect` exits 2 with one line); the
    same value where it acts is accepted, and so is the default value where it does not."""
    from uniweave import cli
    from uniweave.config import load_config
    from uniweave.config.yaml_io import deep_merge

    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(case))  # JSON is YAML
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key, str(info.value)
    assert str(info.value).startswith(f"{path}: {key}: ") and fragment in str(info.value)
    assert "\n" not in str(info.value)
    capsys.readouterr()
    assert cli.main(["inspect", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"uniweave: error: {info.value}"]
    validate_config(deep_merge(copy.deepcopy(case), acts))
    grpo = case.get("algorithm", {}).get("name") == "grpo"
    defaults = validate_config(GRPO_RUN if grpo else {}).model_dump(mode="json")
    harmless = copy.deepcopy(case)
    _dotted(harmless, key, _dotted(defaults, key))
    validate_config(harmless)


# -- trainer.micro_token_budget: micro_batch_size still caps the rows ------------------


def promised_micro_batches(lengths: list[int], size: int, budget: int) -> list[list[int]]:
    """The row lengths of each micro-batch the two settings promise: rows in order of
    length fill a micro-batch until the next one would give it more than `size`
    (micro_batch_size) rows or more than `budget` padded tokens (rows x its longest row);
    a row longer than the budget is a micro-batch of its own."""
    out: list[list[int]] = []
    rows: list[int] = []
    for n in sorted(lengths):
        if rows and (len(rows) == size or max(rows + [n]) * (len(rows) + 1) > budget):
            out.append(rows)
            rows = []
        rows.append(n)
    return out + [rows] if rows else out


@pytest.mark.parametrize(
    ("lengths", "size", "budget", "expected"),
    [
        # the budget (25 rows of 4 tokens) would take all ten rows: 3 per micro-batch
        ([4] * 10, 3, 100, [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]),
        # both bind: three short rows hit the row cap, then 2 x 10 = 20 tokens the budget
        ([10, 2, 10, 2, 10, 2, 2, 10], 3, 20, [[1, 3, 5], [6, 0], [2, 4], [7]]),
        ([30, 5], 4, 20, [[1], [0]]),  # a row longer than the budget goes alone
        ([5] * 7, 3, 0, [[0, 1, 2], [3, 4, 5], [6]]),  # no budget: micro_batch_size rows
    ],
)
def test_micro_batches_respect_the_row_cap_and_the_token_budget(lengths, size, budget, expected):
    from uniweave.train.engine.batching import micro_batches

    rows = [[0] * n for n in lengths]  # only a row's length is read
    got = micro_batches(rows, size, budget)  # type: ignore[arg-type]
    assert got == expected
    assert sorted(i for g in got for i in g) == list(range(len(lengths)))
    if budget:
        assert [[lengths[i] for i in g] for g in got] == promised_micro_batches(
            lengths, size, budget
        )
    for g in got:
        assert len(g) <= size
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= (budget or 10**9)


BUDGETS: list[tuple[str, int, Callable[[list[int]], int], tuple[bool, bool]]] = [
    # (id, micro_batch_size, budget from the row lengths, (the cap binds, the budget binds))
    ("cap_binds", 2, lambda lengths: 100 * max(lengths), (True, False)),
    ("both_bind", 3, lambda lengths: 4 * min(lengths), (True, True)),
    ("budget_binds", 12, lambda lengths: 2 * max(lengths), (False, True)),
]


@pytest.mark.parametrize(("size", "budget_of", "binding"), [c[1:] for c in BUDGETS],
                         ids=[c[0] for c in BUDGETS])  # fmt: skip
def test_an_update_trains_on_micro_batches_within_both_limits(kit, size, budget_of, binding):
    """The micro-batches an SFT update actually runs forward and backward (12 rows of
    t2i and i2t_mc): exactly the promised ones, never more than trainer.micro_batch_size
    rows nor more padded tokens than trainer.micro_token_budget (a lone over-long row
    aside). Each case checks which limit shapes it: lifting a binding limit changes the
    promised micro-batches, lifting the other does not."""
    geometry = {"trainer.total_updates": 1, "trainer.global_batch_size": 12,
                "trainer.micro_batch_size": 2, "data.train_size": 4}  # fmt: skip
    lengths = [len(t) for t in make_trainer(config(kit, geometry)).source.global_batch(0)]
    budget = budget_of(lengths)
    promised = promised_micro_batches(lengths, size, budget)
    cap_binds = promised != promised_micro_batches(lengths, len(lengths), budget)
    budget_binds = promised != promised_micro_batches(lengths, size, sum(lengths) * len(lengths))
    assert (cap_binds, budget_binds) == binding, (sorted(lengths), promised)
    cfg = config(kit, {**geometry, "trainer.micro_batch_size": size,
                       "trainer.micro_token_budget": budget})  # fmt: skip
    trainer = make_trainer(cfg)
    seen: list[tuple[int, int, list[int]]] = []
    loss = trainer.objective.loss

    def recording(model, micro, n_global):
        rows, width = micro.token_ids.shape
        seen.append((rows, width, sorted(int(n) for n in micro.attention_mask.sum(1))))
        return loss(model, micro, n_global)

    trainer.objective.loss = recording
    trainer.step()
    assert [real for _, _, real in seen] == promised
    for rows, width, real in seen:
        assert rows == len(real) <= size and width == max(real)
        assert rows * width <= budget or rows == 1
