"""What evaluation scores a task with, and what "passing" means.

`TASK_VERIFIERS` declares, for every built-in digits task, the task's own verifier (the
reward plugin that scores it when the config names none) and the name of its headline
metric in an evaluation summary (`<task>/accuracy`, `t2i/score`,
`draw_then_answer/exact_match`: the task's mean total reward, `mean@n`):

| task | default verifier | headline |
|---|---|---|
| i2t_mc, mc_lookup, i2t_pick, i2t_mc_first | mc_exact (strict A-D letter) | accuracy |
| jigsaw_mc | jigsaw (the chosen option's permutation) | accuracy |
| i2t_open, i2t_mc_say, i2t_hint, i2t_hint_wrong | text_exact | accuracy |
| t2i | digit_classifier: p(the asked digit) of the decoded image | score |
| draw_then_answer | exact_answer (the text after the drawn image) | exact_match |

`evaluation_reward(cfg)` is the reward section an evaluation scores with: `reward:` when
it names plugins (what the run trains on, also for these tasks), else one default
verifier per task of `data.tasks` (truncation shaping and the error policy still from
`reward:`); a task with neither is a ConfigError, never a silent 0.

`passes(total, threshold)` is the one definition of a passing row, used by evaluation
(pass@n, the records' `passed`), GRPO's `task/<task>/accuracy` and OPD's verified
routing: its total reward (after truncation shaping) is >= `evaluation.pass_threshold`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from uniweave.config.errors import ConfigError
from uniweave.config.resolved import data_tasks
from uniweave.config.schema import RewardConfig, RewardPluginConfig, UniweaveConfig


@dataclass(frozen=True)
class TaskVerifier:
    """A task's default verifier (a registered plugin name) and its headline metric."""

    plugin: str
    metric: str


_MC = TaskVerifier("mc_exact", "accuracy")
_TEXT = TaskVerifier("text_exact", "accuracy")
TASK_VERIFIERS: dict[str, TaskVerifier] = {
    "i2t_mc": _MC,
    "mc_lookup": _MC,
    "i2t_pick": _MC,
    "i2t_mc_first": _MC,
    "jigsaw_mc": TaskVerifier("jigsaw", "accuracy"),
    "i2t_open": _TEXT,
    "i2t_mc_say": _TEXT,
    "i2t_hint": _TEXT,
    "i2t_hint_wrong": _TEXT,
    "t2i": TaskVerifier("digit_classifier", "score"),
    "draw_then_answer": TaskVerifier("exact_answer", "exact_match"),
}
"""Task label -> its default verifier and headline metric (module docstring)."""

Source = Literal["reward.plugins", "task defaults"]


def default_reward(tasks: Sequence[str], base: RewardConfig) -> RewardConfig:
    """`base` with one plugin per default verifier, each restricted to the `tasks` it
    verifies (in `tasks` order); ConfigError naming the first task without one."""
    plugins: dict[str, list[str]] = {}
    for task in tasks:
        verifier = TASK_VERIFIERS.get(task)
        if verifier is None:
            raise ConfigError(
                f"task '{task}' has no default verifier and reward.plugins names none: "
                "evaluation has nothing to score it with",
                key="reward.plugins",
                expected="a plugin whose tasks include it (e.g. {name: text_exact, "
                f"tasks: [{task}]}}); tasks with a default: {', '.join(TASK_VERIFIERS)}",
            )
        plugins.setdefault(verifier.plugin, []).append(task)
    chosen = [RewardPluginConfig(name=name, tasks=ts) for name, ts in plugins.items()]
    return base.model_copy(update={"plugins": chosen})


def evaluation_reward(cfg: UniweaveConfig) -> tuple[RewardConfig, Source]:
    """The reward section an evaluation of `cfg` scores with, and where it came from
    (module docstring)."""
    if cfg.reward.plugins:
        return cfg.reward, "reward.plugins"
    return default_reward(data_tasks(cfg.data), cfg.reward), "task defaults"


def headline_metrics(tasks: Sequence[str]) -> dict[str, str]:
    """Task -> the name its mean total reward is also reported under (`TASK_VERIFIERS`),
    for the tasks of `tasks` that declare one."""
    return {t: TASK_VERIFIERS[t].metric for t in tasks if t in TASK_VERIFIERS}


def passes(total: torch.Tensor | float, threshold: float) -> torch.Tensor:
    """bool (same shape as `total`): the rows whose total reward is >= `threshold`.

    Compared in float64, so a float32 total of exactly 1.0 passes a threshold of 1.0.
    With the default threshold 0.5 (`evaluation.pass_threshold`) a verifier's 1 passes
    and its 0 fails, a learned scorer's probability passes when the asked class is more
    likely than not (a classifier's 0.9999 passes; a threshold of 1.0 would fail it),
    and a row that truncation shaping set to 0 fails."""
    return torch.as_tensor(total, dtype=torch.float64) >= threshold
