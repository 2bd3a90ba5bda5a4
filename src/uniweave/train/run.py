"""`uniweave train`: turn a validated config into a run directory, a trainer and a report.

Layout of a run directory::

    config.yaml          the resolved config (as `uniweave inspect` prints it), then comment
                         lines giving each relative path's absolute form
    config_hash          its SHA-256
    codec/               the fitted image codec (reused on resume)
    checkpoints/         atomic checkpoints (update-NNNNNN)
    metrics.jsonl        one line per update; tensorboard/ event files
    model/               the final model (save_pretrained; LoRA merged)
    adapter/             LoRA runs: the adapter alone, in peft's format (+ uniweave_adapter.json)
    classifier/          the digits classifier, when a reward plugin or a task's default
                         verifier needs it (fitted on first use)
    evals/<split>-update-NNNNNN/   the evaluator's records, summary and page of every
                         validation (val), of the final test evaluation (test) and, with
                         health.baseline_eval, of the starting model (update 000000)
    evals/ig-val-update-NNNNNN.json   SFT with Information Gain: the IG validation
                         report of each validation (distributions and per-event values)
    eval.json, curves.png
    report.md, report.html, report.json   the run report (`uniweave.eval.run_report`,
                         docs/reports.md), rewritten after every evaluation and at the end

Re-running the same command on the same directory resumes from the latest intact
checkpoint (see `uniweave.train.state.checkpoint`).

Order of a run: everything it reads is validated first (`uniweave.train.preflight`); only
then is the run directory created or opened. An existing run's newest intact checkpoint
is checked against the config (a refused resume is a `ConfigError` naming the keys and
changes nothing on disk); once accepted, stale temporaries are removed, corrupt
checkpoints moved aside, and the run's record (`config.yaml`, `config_hash`) written
atomically — once, and only when it changed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from uniweave.config import ConfigError, UniweaveConfig, config_hash, to_yaml
from uniweave.config.methods import method, methods
from uniweave.config.resolved import run_dir as resolved_run_dir
from uniweave.config.trained_on import write_trained_on
from uniweave.core.determinism import set_determinism
from uniweave.core.host_memory import apply_mmap_threshold
from uniweave.core.status import RUN_LOG, open_run_log, status
from uniweave.data.rows import has_split, resolve_tasks
from uniweave.eval.health import HealthMonitor
from uniweave.eval.run_report import write_report
from uniweave.eval.runner import evaluate, split_config, task_metrics
from uniweave.models.base import UnifiedModel
from uniweave.models.build import build_model, resolve_device
from uniweave.models.registry import with_saved_sizes
from uniweave.rewards import evaluation_reward
from uniweave.rewards.digit_classifier import CLASSIFIER_DIR
from uniweave.train.distributed.comm import (
    DistInfo,
    barrier,
    init_distributed,
    shutdown_distributed,
)
from uniweave.train.distributed.spawn import check_world_size, is_spawned_worker
from uniweave.train.engine.adapters import (
    ADAPTER_DIR,
    load_initial_adapter,
    lora_targets,
    save_adapter,
)
from uniweave.train.engine.batching import check_rank_geometry
from uniweave.train.engine.faults import inject_fault
from uniweave.train.engine.lora import adapter_state, apply_lora, merged_state_dict
from uniweave.train.engine.metrics import METRICS, read_metrics
from uniweave.train.engine.protocols import BatchSource, Objective
from uniweave.train.engine.resume import check_resume
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.sft.validation import ig_report_name
from uniweave.train.preflight import EVALS, preflight
from uniweave.train.state import checkpoint as ckpt
from uniweave.train.state.checkpoint import write_text_atomic
from uniweave.train.state.parent import parent_checkpoint

logger = logging.getLogger(__name__)


def _record(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        write_text_atomic(path, text)


def _path_values(value, key: str = ""):
    """(dotted key, value) of every path the config holds: a string under a key named
    `path`, `*_path` or `*_dir` (model.path, data.test_path, run.output_dir, ...)."""
    if isinstance(value, dict):
        for name, child in value.items():
            yield from _path_values(child, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list):
        for k, child in enumerate(value):
            yield from _path_values(child, f"{key}.{k}")
    elif isinstance(value, str) and value:
        last = key.rsplit(".", 1)[-1]
        if last == "path" or last.endswith(("_path", "_dir")):
            yield key, value


def absolute_paths(cfg: UniweaveConfig) -> str:
    """Comment lines for config.yaml: each relative path of the config as given and
    resolved against the working directory of the run's command, so the record still
    says which files were read when it is read from elsewhere. Empty when every path is
    absolute."""
    lines = [
        f"#   {key}: {value} -> {Path(value).resolve()}\n"
        for key, value in _path_values(cfg.model_dump(mode="json"))
        if not Path(value).is_absolute()
    ]
    if not lines:
        return ""
    return (
        "# absolute paths (the relative ones above, resolved from the working directory):\n"
        + "".join(lines)
    )


def prepare_run_dir(cfg: UniweaveConfig, info: DistInfo) -> Path:
    """Open the run directory (module docstring): check that its newest intact checkpoint
    may be resumed under `cfg` (ConfigError otherwise, nothing changed), then create it,
    tidy it and record the resolved config and its hash (rank 0)."""
    run_dir = resolved_run_dir(cfg)
    scan = ckpt.scan_checkpoints(run_dir)
    if scan.latest is not None:
        check_resume(scan.latest, cfg)
    elif cfg.run.parent is not None and not scan.n_candidates:
        check_resume(parent_checkpoint(cfg), cfg)
    elif scan.n_candidates:
        raise ConfigError(
            f"no intact checkpoint among {scan.n_candidates} in {ckpt.checkpoint_dir(run_dir)} "
            f"({scan.corrupt[0][1]}); move them away to start this run over",
            source=str(run_dir),
        )
    barrier(info)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.tidy_run_dir(run_dir, scan)
        _record(run_dir / "config.yaml", to_yaml(cfg) + absolute_paths(cfg))
        _record(run_dir / "config_hash", config_hash(cfg) + "\n")
    barrier(info)
    return run_dir


def _prepare_model(cfg: UniweaveConfig, run_dir: Path, device: torch.device) -> UnifiedModel:
    model = build_model(cfg, codec_dir=run_dir / "codec", tokenizer_dir=run_dir / "tokenizer")
    if cfg.trainer.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    if cfg.trainer.lora.enabled:
        targets = apply_lora(model, cfg)
        if cfg.model.initial_adapter is not None:  # base + adapter, unmerged
            load_initial_adapter(model, cfg, targets)
    if cfg.trainer.precision == "fp64":  # float64 weights, compute and optimizer state
        model = model.to(torch.float64)
    return model.to(device).train()


JobBuilder = Callable[[UniweaveConfig, UnifiedModel, Path, DistInfo], tuple[BatchSource, Objective]]


class _Jobs(Mapping[str, JobBuilder]):
    """`algorithm.name` -> its job builder: the registered methods' specs
    (`uniweave.config.methods`), read at each lookup."""

    def __getitem__(self, name: str) -> JobBuilder:
        return method(name).build_job

    def __iter__(self) -> Iterator[str]:
        return iter([spec.name for spec in methods()])

    def __len__(self) -> int:
        return len(methods())


JOBS: Mapping[str, JobBuilder] = _Jobs()


def run_train(cfg: UniweaveConfig, stop_after: int | None = None) -> Path:
    """Train as the config says (resuming if the run directory has a checkpoint); return
    the run directory. `stop_after` N: commit a checkpoint and return after N new
    updates (no export or final evaluation unless the run is complete)."""
    cfg = resolve_tasks(cfg)  # data.tasks null: the rows' one label
    cfg = with_saved_sizes(cfg)  # model.path: the loaded model's sizes in config.yaml
    preflight(cfg, JOBS)
    check_world_size(cfg.trainer.world_size, cfg.run.device)
    if cfg.trainer.world_size > 1 and not is_spawned_worker():
        raise ConfigError(
            f"trainer.world_size={cfg.trainer.world_size}: the workers are spawned by the CLI "
            "(`uniweave train CONFIG`), not by run_train",
            key="trainer.world_size",
        )
    cadence = cfg.trainer.eval_every > 0 or cfg.trainer.eval_every_epochs > 0
    validates = cadence and _has_rows(cfg, "val", cfg.data.val_size)
    if validates or _has_rows(cfg, "test", cfg.data.test_size):
        evaluation_reward(cfg)  # a task nothing can score: a ConfigError before anything runs
    device = resolve_device(cfg.run.device)
    set_determinism(cfg.run.deterministic, device)
    apply_mmap_threshold(cfg.run.host_mmap_threshold)
    info, device = init_distributed(device, cfg.trainer.parallel, cfg.trainer.collective_timeout_s)
    source, close_log = None, None
    try:
        check_rank_geometry(cfg.trainer, info.world_size)  # before anything is written
        run_dir = prepare_run_dir(cfg, info)
        if info.is_main:  # the console's status lines and log messages, in the run
            close_log = open_run_log(run_dir / RUN_LOG)
        model = _prepare_model(cfg, run_dir, device)
        baseline_evaluations(cfg, model, run_dir, info)  # the ranks share it
        barrier(info)
        source, objective = JOBS[cfg.algorithm.name](cfg, model, run_dir, info)
        trainer = Trainer(
            model,
            source,
            objective,
            cfg,
            run_dir,
            info,
            model.special_ids.pad,
            trainable_state=(lambda: adapter_state(model)) if cfg.trainer.lora.enabled else None,
            # under ddp and fsdp2 every rank validates (its share of the queries); rank 0 logs
            evaluator=_val_evaluator(cfg, model, run_dir, info)
            if info.is_main or info.enabled
            else None,
        )
        health = HealthWatch(cfg, run_dir) if info.is_main else None
        for update, metrics in trainer.fit(stop_after):
            if health is not None:
                health.update(update, metrics)
        if trainer.update >= cfg.trainer.total_updates:
            # fsdp2: the whole model on every rank (export on rank 0, shared test evaluation)
            with evaluation_model(cfg, model, run_dir) as final:
                finish_run(cfg, final, run_dir, info)
        barrier(info)
        return run_dir
    finally:
        if source is not None:
            source.close()  # Ray workers
        shutdown_distributed()
        if close_log is not None:
            close_log()


def _digits_tasks(cfg: UniweaveConfig) -> bool:
    """The built-in digits tasks (no `data.path`), whatever the model kind."""
    return cfg.data.path is None


def _has_rows(cfg: UniweaveConfig, split: str, size: int) -> bool:
    """`data.<split>_size` > 0 and, for a `data.path` run, the split has rows."""
    return size > 0 and (_digits_tasks(cfg) or has_split(cfg.data, split))


def _rows_of(cfg: UniweaveConfig, split: str, size: int) -> bool:
    """Whether the run evaluates `split` (`_has_rows`); logs why not when a `data.path`
    run's split has no rows."""
    if size == 0:
        return False
    if _has_rows(cfg, split, size):
        return True
    logger.warning(
        "no %s rows (neither data.%s_path nor data.path rows with split: %s): no %s "
        "evaluation (set %s to silence this)",
        split,
        split,
        split,
        "validation" if split == "val" else "test",
        " ".join(silencing_overrides(cfg, split)),
    )
    return False


def silencing_overrides(cfg: UniweaveConfig, split: str) -> list[str]:
    """The overrides that turn off evaluating `split` and everything the config refuses
    without it: validation cadences (`trainer.eval_every`, `eval_every_epochs`) and the
    best checkpoint, which is measured on validation (its mode with it)."""
    out = [f"data.{split}_size=0"]
    if split == "val":
        if cfg.trainer.eval_every > 0:
            out.append("trainer.eval_every=0")
        if cfg.trainer.eval_every_epochs > 0:
            out.append("trainer.eval_every_epochs=0")
        if cfg.checkpoint.keep_best is not None:
            out.append("checkpoint.keep_best=null")
            mode = type(cfg.checkpoint).model_fields["keep_best_mode"].default
            if cfg.checkpoint.keep_best_mode != mode:  # a mode without keep_best is refused
                out.append(f"checkpoint.keep_best_mode={mode}")
    return out


def evaluate_split(
    cfg: UniweaveConfig,
    model: UnifiedModel,
    run_dir: Path,
    split: str,
    update: int,
    info: DistInfo | None = None,
) -> dict[str, float]:
    """The run's evaluation of `model` on `split` after `update` updates — validation and
    the final test evaluation alike: `uniweave eval` (`uniweave.eval.runner.evaluate`) on the
    first `data.<split>_size` rows per task, into `<run_dir>/evals/<split>-update-NNNNNN`,
    with the run's digits classifier; per task t and summary statistic k (mean@n, pass@n,
    the task's headline metric, <plugin>/mean, invalid_frac, finish_<reason>_frac,
    n_samples, n_rollouts, the masked-image probe; `uniweave.eval.scorecard`), `t/k`. `info`
    with several ranks: every rank calls it and evaluates its claimed share
    (`uniweave.eval.runner`, "Several ranks"); the metrics on rank 0, {} on the others."""
    size = {"val": cfg.data.val_size, "test": cfg.data.test_size}[split]
    out = run_dir / EVALS / f"{split}-update-{update:06d}"
    main = info is None or info.is_main
    if main:  # a progress line: an evaluation can take longer than many updates
        what = "the starting model" if update == 0 else f"the model at update {update}"
        status(f"evaluating {what} on {split} ({size} rows per task at most) into {out}")
    t0 = time.perf_counter()
    summary = evaluate(
        split_config(cfg, split),
        model,
        out,
        per_task=size,
        classifier_dir=run_dir / CLASSIFIER_DIR,
        stale="replace",
        ranks=(info.rank, info.world_size, info.cpu_group) if info and info.enabled else None,
    )
    if main:
        status(f"evaluated {split} in {time.perf_counter() - t0:.0f} s")
    return task_metrics(summary) if summary is not None else {}


def _val_evaluator(cfg: UniweaveConfig, model: UnifiedModel, run_dir: Path, info=None):
    """Validation metrics every `trainer.eval_every` updates, or None when the run has no
    val rows: `val/<task>/<statistic>` (`evaluate_split` on the val split) and the
    method's own metrics (its spec's `evaluator`, `uniweave.config.methods`): for SFT,
    the teacher-forced validation loss `val/loss`, `val/loss_text`, `val/loss_image_<head>`
    of the val rows (`uniweave.train.methods.sft.validation`) and, with Information Gain on,
    the IG metrics `val/ig/...` of the same rows (cycle index pinned to 0): means, and the
    quantiles and saturation rates of `ig_distributions`, whose whole report (per-event
    values included) goes atomically to `evals/ig-val-update-NNNNNN.json`
    (`ig_report_path`). Everything runs on `evaluation_model` (under fsdp2 an unsharded
    copy). `info` with several ranks (ddp, fsdp2): the task evaluation is shared by every
    rank (`evaluate_split`); the SFT losses run on rank 0; the metrics on rank 0, {}
    elsewhere."""
    info = info or DistInfo()
    if not _rows_of(cfg, "val", cfg.data.val_size):
        return None
    spec = method(cfg.algorithm.name)
    own = spec.evaluator(cfg) if spec.evaluator is not None else None  # SFT's losses, IG

    def evaluate_val(update: int) -> dict[str, float]:
        with evaluation_model(cfg, model, run_dir) as evaluated:
            found = evaluate_split(cfg, evaluated, run_dir, "val", update, info)
            metrics = {f"val/{k}": v for k, v in found.items()}
            if own is None or not info.is_main:
                return metrics
            found = own(evaluated, run_dir / EVALS, update)
            metrics.update({f"val/{k}": v for k, v in found.items()})
            return metrics

    return evaluate_val


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model`'s parameters are FSDP2 shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


@contextmanager
def evaluation_model(cfg: UniweaveConfig, model: UnifiedModel, run_dir: Path):
    """The model the run's evaluations (validation, the SFT validation losses, the final
    export and test evaluation) run on: `model` itself, or, when its parameters are FSDP2
    shards, an unsharded copy on every rank. A collective then: every rank all-gathers
    the whole state (`get_model_state_dict`, full, kept on the device) into a model
    built as training built it (`_prepare_model`: LoRA, fp64, same training flag), so
    the copy holds the very weights one process would hold and generates without any
    collective: the ranks are then free to decode different claims of different
    lengths, which lockstep forwards through the sharded layers could not do (every
    layer's forward would be an all-gather that every rank must join). Memory: one whole
    model (parameters and buffers in the training dtype) per rank while the evaluation
    runs, freed after it."""
    if not is_sharded(model):
        yield model
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    first = next(iter(full.values()))
    assert isinstance(first, torch.Tensor), "a model state holds tensors"
    device = first.device
    copy = _prepare_model(cfg, run_dir, device)
    copy.load_state_dict(full)
    del full
    copy.train(model.training)
    try:
        yield copy
    finally:
        del copy
        if device.type == "cuda":
            torch.cuda.empty_cache()


def ig_report_path(run_dir: Path, update: int) -> Path:
    """Where the IG validation report of update `update` is written (`ig_distributions`)."""
    return run_dir / EVALS / ig_report_name(update)


def finish_run(
    cfg: UniweaveConfig, model: UnifiedModel, run_dir: Path, info: DistInfo | None = None
) -> None:
    """Export the final model (atomically) and plot the curves (rank 0), evaluate it on
    the test split (`evaluate_split`: the first `data.test_size` rows per task, into
    `<run_dir>/evals/test-update-NNNNNN`; with several ranks in `info`, every rank calls
    this and the ranks share the evaluation as they share validation) into eval.json,
    then DONE and the report (rank 0). `model`: whole on every rank (`evaluation_model`)."""
    info = info or DistInfo()
    if info.is_main:

        def export(path: Path) -> None:
            model.save_pretrained(path, state_dict=merged_state_dict(model))
            write_trained_on(path, cfg, config_hash(cfg))  # what `eval` checks against
            inject_fault("model_write", cfg.trainer.total_updates)

        ckpt.write_dir_atomic(run_dir, "model", export)
        if cfg.trainer.lora.enabled:  # the adapter alone, in peft's format (engine.adapters)
            targets = lora_targets(model)
            ckpt.write_dir_atomic(
                run_dir, ADAPTER_DIR, lambda p: save_adapter(model, cfg, p, targets)
            )
    if _rows_of(cfg, "test", cfg.data.test_size):
        results = evaluate_split(cfg, model, run_dir, "test", cfg.trainer.total_updates, info)
        if info.is_main:
            write_text_atomic(
                run_dir / "eval.json", json.dumps(results, indent=2, sort_keys=True) + "\n"
            )
    if info.is_main:
        done = json.dumps({"updates": cfg.trainer.total_updates}) + "\n"
        write_text_atomic(run_dir / "DONE", done)
        report(run_dir, cfg.trainer.total_updates, "test")


def _evaluated_splits(cfg: UniweaveConfig) -> list[str]:
    """The held-out splits the run evaluates: val (validation every trainer.eval_every)
    and test (the final evaluation), each when it has rows."""
    splits = []
    if cfg.trainer.eval_every > 0 and _has_rows(cfg, "val", cfg.data.val_size):
        splits.append("val")
    if _has_rows(cfg, "test", cfg.data.test_size):
        splits.append("test")
    return splits


def baseline_evaluations(
    cfg: UniweaveConfig, model: UnifiedModel, run_dir: Path, info: DistInfo | None = None
) -> None:
    """With `health.baseline_eval`, evaluate the starting model (update 0) on every split
    the run evaluates (`<run_dir>/evals/<split>-update-000000`; an evaluation already
    complete is kept), then write the run report (before training). With several ranks
    in `info` every rank calls this and the ranks share each evaluation (they all see
    the same summary.json files: only rank 0 writes one, at the end of its split's
    evaluation, after every rank has decided whether to run it); the report on rank 0."""
    info = info or DistInfo()
    if not cfg.health.baseline_eval:
        return
    for split in _evaluated_splits(cfg):
        if not (run_dir / EVALS / f"{split}-update-{0:06d}" / "summary.json").is_file():
            evaluate_split(cfg, model, run_dir, split, 0, info)
    if info.is_main:
        report(run_dir, 0, None)


def report(run_dir: Path, update: int, split: str | None) -> None:
    """Rewrite the run report (`uniweave.eval.run_report`) and print the held-out alarms of
    the `split` evaluation at `update` that fired for the first time, one line each, to
    stderr."""
    summary = write_report(run_dir)
    for alarm in summary["alarms"]:  # each alarm once, at its first firing
        fresh = alarm["update"] == update and alarm["key"].startswith(f"{split}/")
        if split is not None and alarm["name"].startswith("heldout") and fresh:
            status(
                f"health alarm: {alarm['name']} at update {update}: {alarm['message']} "
                f"(health.{alarm['knob']}={alarm['threshold']:g})",
                err=True,
            )


class HealthWatch:
    """Rank 0's live health alarms (`uniweave.eval.health`): every update's metrics through
    the monitor, an alarm printed as one line to stderr when it first fires (once per run:
    the report lists the updates it fired again at), and the report rewritten after every
    evaluation. A resumed run first replays its logged updates silently."""

    def __init__(self, cfg: UniweaveConfig, run_dir: Path) -> None:
        self.monitor = HealthMonitor(cfg.health)
        self.run_dir = run_dir
        self.started = False

    def update(self, update: int, metrics: dict[str, float]) -> None:
        if not self.started:
            self.started = True
            for record in read_metrics(self.run_dir / METRICS):
                if record.get("update", 0) < update:
                    self.monitor.observe(record["update"], record)
        for alarm in self.monitor.first_time(self.monitor.observe(update, metrics)):
            status(alarm.line(), err=True)
        if any(k.startswith("val/") for k in metrics):
            report(self.run_dir, update, "val")
