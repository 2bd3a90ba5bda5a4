"""The method registry: one `MethodSpec` per training method, looked up by `algorithm.name`.

A method lives in its folder, `uniweave.train.methods.<name>`, whose `spec` module builds
its `MethodSpec` and registers it: the config class of its `algorithm:` section, the job
builder that makes its batch source and objective, its config checks, its preflight
checks, its planner hooks, the model directories it reads (checked, fingerprinted and
resolved from hub ids like `model.path`), the keys a resume may change and the metrics
its progress lines show. The config
schema, `uniweave.train.preflight`, `uniweave.train.run`, the planner, the input
fingerprints and the trainer ask the spec of `cfg.algorithm.name`; none of them names a
method.

The built-in methods (sft, grpo, opd, in that order: the order of the `algorithm` union
and of the method lists in messages) register when `uniweave.train.methods` is imported,
which `methods()` and `method()` do on first use by name (`importlib`): the config layer
imports nothing of `uniweave.train`, and the spec modules import only the config layer at
module level, so validating a config loads no torch. A method defined elsewhere (a test,
a plug-in) calls `register_method(spec)`: its config class joins the discriminated
`algorithm` union of `UniweaveConfig` (the schema rebuilds that field; `inspect`, `plan`
and `uniweave config describe` then know its keys), and `unregister_method(name)` takes it
out again.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

BUILTIN_PACKAGE = "uniweave.train.methods"
"""The package whose import registers the built-in methods."""


def _no_rounds(algo: Any) -> int:
    return 1


@dataclass(frozen=True)
class MethodSpec:
    """What the rest of uniweave knows of a method. `cfg` below is a `UniweaveConfig`,
    `algo` its `algorithm` section (an instance of `config`)."""

    name: str
    """`algorithm.name`; the `name` field of `config` is `Literal[name]`."""
    config: type
    """The `algorithm:` section class (a `uniweave.config.base.StrictModel`)."""
    build_job: Callable[..., tuple[Any, Any]]
    """(cfg, model, run_dir, DistInfo) -> (BatchSource, Objective) of a run."""
    rollouts: bool = False
    """True: trains on rollouts of the policy (the `rollout` section's training settings,
    `logging.samples_every`, `checkpoint.save_rollouts`, the prompt checks of preflight
    act); False: trains on dataset rows (`data.max_sequence_tokens`, `data.shuffle`,
    epoch cadences act: the run has one epoch boundary)."""
    ray_workers: bool = False
    """Rollout and reward workers in Ray (`rollout.workers`, `reward.workers`) are built."""
    check: Callable[[Any, set[str] | None], None] | None = None
    """Cross-section config checks of the method (cfg, data.tasks as a set or None when
    the dataset rows name them), run before the generic ones; raise `incompatible(...)`."""
    check_late: Callable[[Any, set[str] | None], None] | None = None
    """As `check`, run after the model-adapter and packing checks."""
    packing: Callable[[Any], None] | None = None
    """None: `trainer.packing` is not built for the method; else its own refusals of
    packing (cfg)."""
    gradient_diagnostics: Callable[[Any], None] | None = None
    """None: `logging.gradient_diagnostics_every_updates` does not act; else its checks."""
    val_metrics: Callable[[Any], tuple[set[str], str | None, str]] | None = None
    """The method's own validation metrics (cfg) -> (names, an accepted prefix or None,
    the clause `checkpoint.keep_best`'s error adds), beside `val/<task>/<statistic>`."""
    evaluator: Callable[[Any], Callable[[Any, Any, int], dict[str, float]]] | None = None
    """(cfg) -> evaluate(model, run_dir, update) -> {metric without `val/`: value}: the
    method's own validation metrics, on rank 0, after the task evaluation."""
    model_dirs: tuple[str, ...] = ()
    """Dotted keys under `algorithm` that name model directories the run reads (OPD:
    `teacher.path`): checked by preflight, fingerprinted, resolved from hub ids."""
    updates_per_round: Callable[[Any], int] = _no_rounds
    """(algo) -> K: updates drawn from one batch of rollouts; a child run starts only at a
    multiple of it."""
    resumable_keys: tuple[str, ...] = ()
    """Dotted keys under `algorithm` that any resume may change (they cannot alter the
    objective)."""
    preflight_model: Callable[[Any, Any, str], None] | None = None
    """(cfg, ModelFacts of model.path, where) -> None: checks of the model's files."""
    preflight_rows: Callable[[Any, Any], None] | None = None
    """(cfg, training Rows) -> None: checks of data.path's training rows."""
    preflight_prompt: Callable[[Any, Any, str], None] | None = None
    """(cfg, Sample, where) -> None: per training prompt (rollout methods)."""
    preflight: Callable[[Any, Any], None] | None = None
    """(cfg, tools) -> None: last checks (tools: `inspect(path, key)` and
    `student_facts()` of `uniweave.train.preflight`)."""
    plan_setup: Callable[[Any], dict[str, Any]] = lambda algo: {}
    """(algo) -> `uniweave.plan.Setup` fields the method sets (chunk, kl_copy)."""
    teacher: str | None = None
    """Dotted key under `algorithm` of a frozen teacher directory the planner sizes."""
    progress: tuple[tuple[str, str, str], ...] = ()
    """What a progress line shows beside the loss and the learning rate, when the update
    logged it: (label, metric key, format spec) each, in order (GRPO: its reward, KL to
    the reference and zero-variance share)."""
    acts_when: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    """Dotted key under `algorithm` -> its `uniweave.config.acts.ActsWhen` declarations:
    when the method's own settings act, checked by the generic rule
    (`uniweave.config.acts.refuse_inactive`) and written into docs/config.md."""


_REGISTRY: dict[str, MethodSpec] = {}
_LISTENERS: list[Callable[[], None]] = []
_BUILTINS_LOADED = False


def _load_builtins() -> None:
    if not _BUILTINS_LOADED:
        importlib.import_module(BUILTIN_PACKAGE)  # calls register_builtins


def _changed() -> None:
    for listener in _LISTENERS:
        listener()


def register_builtins(*specs: MethodSpec) -> None:
    """Register the built-in methods ahead of any other (`uniweave.train.methods`)."""
    global _BUILTINS_LOADED
    others = {name: spec for name, spec in _REGISTRY.items() if spec not in specs}
    _REGISTRY.clear()
    _REGISTRY.update({spec.name: spec for spec in specs})
    _REGISTRY.update(others)
    _BUILTINS_LOADED = True
    _changed()


def on_change(listener: Callable[[], None]) -> None:
    """Call `listener()` after every registration or removal (the schema rebuilds its
    `algorithm` union)."""
    _LISTENERS.append(listener)


def register_method(spec: MethodSpec) -> MethodSpec:
    """Register `spec` under `spec.name` (a name already taken by another spec is refused)."""
    _load_builtins()
    known = _REGISTRY.get(spec.name)
    if known is not None and known is not spec:
        raise ValueError(f"method {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    _changed()
    return spec


def unregister_method(name: str) -> None:
    """Take method `name` out of the registry (a test's own method)."""
    _REGISTRY.pop(name, None)
    _changed()


def methods() -> tuple[MethodSpec, ...]:
    """Every registered method, in registration order (the built-ins first)."""
    _load_builtins()
    return tuple(_REGISTRY.values())


def method(name: str) -> MethodSpec:
    """The spec of `algorithm.name` `name`; KeyError when none is registered."""
    _load_builtins()
    return _REGISTRY[name]


def names(*, rollouts: bool | None = None, ray_workers: bool | None = None) -> list[str]:
    """Registered method names, optionally only those that train on rollouts (or not), or
    build Ray workers (for messages: 'acts only with grpo, opd')."""
    return [
        m.name
        for m in methods()
        if (rollouts is None or m.rollouts == rollouts)
        and (ray_workers is None or m.ray_workers == ray_workers)
    ]


def get_key(section: Any, dotted: str) -> Any:
    """The value at `dotted` ('teacher.path') under a config section."""
    for part in dotted.split("."):
        section = getattr(section, part)
    return section


def with_key(section: Any, dotted: str, value: Any) -> Any:
    """A copy of `section` with `dotted` set to `value` (nested `model_copy`)."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return section.model_copy(update={head: value})
    return section.model_copy(update={head: with_key(getattr(section, head), rest, value)})
