"""SFT's `MethodSpec` (`uniweave.config.methods`): cross-entropy on dataset rows.

What SFT adds to the generic rules: BitFlip noise needs BSQ bits, Soft-BSQ needs BSQ heads
and image answers, necessity distillation (an EMA shadow) and everything else run in one
process; packing is built for SFT without per-row noise or blind-view masks; the
teacher-forced validation losses (and, with Information Gain on, `val/ig/...`) are its
validation metrics; every training row must have an assistant turn to learn. The job and
the evaluation import torch only when they run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from uniweave.config.acts import ActsWhen
from uniweave.config.algorithms import InformationGainConfig, NecessityDistillationConfig, SFTConfig
from uniweave.config.base import incompatible
from uniweave.config.errors import ConfigError, InputError
from uniweave.config.methods import MethodSpec
from uniweave.config.schema import IMAGE_GENERATION_TASKS, VISUAL_LOSS


def _build_job(cfg, model, run_dir, info):
    from uniweave.train.methods.sft.job import build_sft_job

    return build_sft_job(cfg, model, run_dir, info)


FLIPS = ActsWhen(
    lambda cfg: cfg.algorithm.bitflip.probability > 0,
    "with bitflip.probability > 0",
    "acts only with bitflip.probability > 0 (no bits are flipped)",
)
IG_ON = ActsWhen(
    lambda cfg: cfg.algorithm.information_gain.weight > 0,
    "with information_gain.weight > 0",
    "acts only with information_gain.weight > 0 (IG is off)",
)
ND_ON = ActsWhen(
    lambda cfg: cfg.algorithm.necessity_distillation.weight > 0,
    "with necessity_distillation.weight > 0",
    "acts only with necessity_distillation.weight > 0 (it is off)",
)


def _selection(mode: str) -> ActsWhen:
    return ActsWhen(
        lambda cfg: cfg.algorithm.necessity_distillation.selection == mode,
        f"with selection {mode}",
    )


ACTS_WHEN: dict[str, tuple[ActsWhen, ...]] = {
    "bitflip.probability": (
        ActsWhen(
            lambda cfg: cfg.model.visual_head == "bsq",
            "with model.visual_head bsq",
            "bit flips need model.visual_head=bsq",
        ),
    ),
    "bitflip.probability_mode": (FLIPS,),
    "bitflip.partition": (FLIPS,),
    **{
        f"information_gain.{n}": (IG_ON,)
        for n in InformationGainConfig.model_fields
        if n != "weight"
    },
    "information_gain.student_full_view": (
        IG_ON,
        ActsWhen(
            lambda cfg: (
                cfg.algorithm.bitflip.probability > 0 and cfg.algorithm.bitflip.partition == "half"
            ),
            "with bitflip.probability > 0 and bitflip.partition half",
            "acts only with bitflip.probability > 0 and bitflip.partition half (IG then "
            "scores the clean half; otherwise its full view is fixed)",
        ),
    ),
    "soft_bsq.weight": (
        ActsWhen(
            lambda cfg: cfg.model.visual_head == "bsq",
            "with model.visual_head bsq",
            lambda cfg: (
                f"acts only with model.visual_head bsq (a {cfg.model.visual_head} "
                "head predicts no bits to take the expected code of)"
            ),
        ),
    ),
    **{
        f"necessity_distillation.{n}": (ND_ON,)
        for n in NecessityDistillationConfig.model_fields
        if n != "weight"
    },
    "necessity_distillation.weight": (
        ActsWhen(
            lambda cfg: cfg.trainer.parallel == "none",
            "in one process (trainer.parallel none)",
            lambda cfg: (
                "is built for one process (trainer.parallel none): its EMA shadow is "
                f"not sharded or checkpointed under {cfg.trainer.parallel}"
            ),
        ),
    ),
    "necessity_distillation.carrier_fraction": (ND_ON, _selection("fraction")),
    "necessity_distillation.min_necessity": (ND_ON, _selection("min_necessity")),
}
"""When SFT's own settings act (`uniweave.config.acts`): a switch's section acts only
with the switch on, bit flips and Soft-BSQ only with BSQ heads, necessity distillation
in one process."""


def _check(cfg: Any, tasks: set[str] | None) -> None:
    """Soft-BSQ needs, for the digits tasks, a task whose answers hold an image (dataset
    rows: checked by `_preflight_rows`)."""
    if cfg.algorithm.soft_bsq.weight > 0 and tasks is not None and cfg.data.path is None:
        if not tasks & IMAGE_GENERATION_TASKS:
            raise incompatible(
                "algorithm.soft_bsq.weight",
                f"acts only on image answers: tasks {sorted(tasks)} are text-only (add one "
                f"of {', '.join(sorted(IMAGE_GENERATION_TASKS))})",
            )


def _packing(cfg: Any) -> None:
    """Sequence packing without per-row noise or IG's blind-view masks
    (`uniweave.train.engine.batching`)."""
    algo: SFTConfig = cfg.algorithm
    if algo.bitflip.probability > 0:
        raise incompatible(
            "trainer.packing", "packing with BitFlip noise (per-row seeds) is not built"
        )
    if algo.information_gain.weight != 0:
        raise incompatible(
            "trainer.packing", "packing with Information Gain (blind-view masks) is not built"
        )
    if algo.necessity_distillation.weight != 0:
        raise incompatible(
            "trainer.packing",
            "packing with necessity distillation (blind-view masks) is not built",
        )


def _val_metrics(cfg: Any) -> tuple[set[str], str | None, str]:
    losses = {"val/loss", "val/loss_text", f"val/loss_image_{VISUAL_LOSS[cfg.model.visual_head]}"}
    ig = "val/ig/" if cfg.algorithm.information_gain.weight > 0 else None
    return losses, ig, ", or val/ig/... with information gain on"


def _evaluator(cfg: Any):
    """The teacher-forced validation losses of the val rows and, with Information Gain
    on, the IG metrics of the same rows (`uniweave.train.run._val_evaluator`)."""
    from uniweave.core.atomic import write_json_atomic
    from uniweave.train.methods.sft.information_gain import ig_evaluation
    from uniweave.train.methods.sft.source import sft_trajectories
    from uniweave.train.methods.sft.validation import ig_report_name, validation_loss

    ig = cfg.algorithm.information_gain
    rows: list = []  # serialised at the first evaluation (none without an eval cadence)

    def evaluate(model: Any, evals: Path, update: int) -> dict[str, float]:
        pad = model.special_ids.pad
        if not rows:
            rows.extend(sft_trajectories(cfg, model, "val", cfg.data.val_size))
        metrics = validation_loss(cfg, model, rows, pad)
        if ig.weight > 0:
            gains, report = ig_evaluation(model, rows, ig, pad)
            metrics.update(gains)
            evals.mkdir(parents=True, exist_ok=True)
            write_json_atomic(evals / ig_report_name(update), report, indent=1)
        return metrics

    return evaluate


def _has_target(sample: Any) -> bool:
    from uniweave.core.sample import GenerationRequest

    return any(p.role == "assistant" and not isinstance(p, GenerationRequest) for p in sample.parts)


def _has_image_target(sample: Any) -> bool:
    from uniweave.core.sample import ImagePart

    return any(p.role == "assistant" and isinstance(p, ImagePart) for p in sample.parts)


def _preflight_rows(cfg: Any, train: Any) -> None:
    for sample in train.samples:
        if not _has_target(sample):
            raise InputError(
                f"{train.where.get(sample.id, sample.id)}: messages: no assistant turn "
                "to learn (SFT trains on the assistant's answer)",
                "data.path",
            )
    soft_bsq = cfg.algorithm.soft_bsq.weight > 0
    if soft_bsq and not any(map(_has_image_target, train.samples)):
        raise ConfigError(
            "acts only on image answers: no training row of data.path has an image "
            "in an assistant turn",
            key="algorithm.soft_bsq.weight",
        )


SPEC = MethodSpec(
    name="sft",
    config=SFTConfig,
    build_job=_build_job,
    check_late=_check,
    packing=_packing,
    val_metrics=_val_metrics,
    evaluator=_evaluator,
    preflight_rows=_preflight_rows,
    progress=(),  # the loss (the cross-entropy), which every progress line shows
    acts_when=ACTS_WHEN,
)
