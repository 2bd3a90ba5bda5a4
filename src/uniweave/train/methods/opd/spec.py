"""OPD's `MethodSpec` (`uniweave.config.methods`): distillation from a frozen teacher on
the student's own rollouts.

What OPD adds to the generic rules: a verifier routing needs reward plugins; the teacher
directory (`algorithm.teacher.path`) is read like `model.path` (checked by preflight,
fingerprinted, resolved from a hub id) and must share the student's action spaces; a
privileged teacher reads every training row's answer; the gradient diagnostics split
the distillation and GT-replay gradients, in one process; the planner sizes the teacher.
The job and the teacher checks import torch only when they run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from uniweave.config.acts import ActsWhen
from uniweave.config.algorithms import OPDConfig
from uniweave.config.base import incompatible
from uniweave.config.errors import ConfigError, InputError
from uniweave.config.methods import MethodSpec


def _build_job(cfg, model, run_dir, info):
    from uniweave.train.methods.opd.job import build_opd_job

    return build_opd_job(cfg, model, run_dir, info)


def _check(cfg: Any, tasks: set[str] | None) -> None:
    algo: OPDConfig = cfg.algorithm
    if algo.routing != "all" and not cfg.reward.plugins:
        raise incompatible(
            "reward.plugins",
            f"opd routing '{algo.routing}' verifies rows: it needs at least one reward plugin",
        )


ACTS_WHEN: dict[str, tuple[ActsWhen, ...]] = {
    "text_clip": (
        ActsWhen(
            lambda cfg: cfg.algorithm.modality_weights.text > 0,
            "with modality_weights.text > 0",
            "acts only with modality_weights.text > 0 (text contributes nothing)",
        ),
    ),
    "retained_mass_min": (
        ActsWhen(
            lambda cfg: cfg.algorithm.top_k > 0,
            "with top_k > 0",
            "has no effect with top_k 0 (full vocab)",
        ),
    ),
    "carrier_min_necessity": (
        ActsWhen(lambda cfg: cfg.algorithm.carriers == "necessity", "with carriers necessity"),
    ),
}
"""When OPD's own settings act (`uniweave.config.acts`)."""


def _gradient_diagnostics(cfg: Any) -> None:
    key = "logging.gradient_diagnostics_every_updates"
    if cfg.algorithm.gt_replay.mode == "none":
        raise incompatible(
            key,
            "acts only with GT replay (algorithm.gt_replay.mode uniform or failure): "
            "without GT rows there is no second gradient to compare",
        )
    if cfg.trainer.parallel != "none":
        raise incompatible(
            key,
            f"is built for one process (trainer.parallel none), not {cfg.trainer.parallel}",
        )


def _preflight_prompt(cfg: Any, sample: Any, where: str) -> None:
    if cfg.algorithm.teacher.privilege == "answer" and sample.answer is None:
        raise InputError(
            f"{where}: answer: missing; the privileged teacher reads the row's answer",
            "algorithm.teacher.privilege",
        )


def _preflight(cfg: Any, tools: Any) -> None:
    """The teacher directory holds a model of the student's action spaces
    (`compare_action_spaces`), from its files (`uniweave.train.preflight`)."""
    from uniweave.train.methods.opd.objective import KEY as TEACHER_KEY
    from uniweave.train.methods.opd.objective import compare_action_spaces

    path = cfg.algorithm.teacher.path
    if not Path(path).is_dir():
        raise ConfigError(f"{path} is not a directory", key=TEACHER_KEY)
    teacher = tools.inspect(path, TEACHER_KEY, full=True)
    if teacher is None:
        return  # a kind without `inspect`: checked when the teacher is loaded
    student = tools.student_facts(cfg)
    if student is not None:
        compare_action_spaces(student, teacher)


def _plan_setup(algo: OPDConfig) -> dict[str, Any]:
    return {"chunk": algo.chunk_size}


SPEC = MethodSpec(
    name="opd",
    config=OPDConfig,
    build_job=_build_job,
    rollouts=True,
    ray_workers=True,
    check=_check,
    acts_when=ACTS_WHEN,
    gradient_diagnostics=_gradient_diagnostics,
    model_dirs=("teacher.path",),
    preflight_prompt=_preflight_prompt,
    preflight=_preflight,
    plan_setup=_plan_setup,
    teacher="teacher.path",
    # the student's distance to the teacher (JSD over positions), their top-1 agreement,
    # and the verifier's mean reward when routing verifies rows
    progress=(
        ("jsd", "opd/jsd", ".4f"),
        ("top1", "opd/top1_agreement", ".2f"),
        ("reward", "reward/total_mean", ".4f"),
    ),
)
