"""Held-out evaluation on the digits tasks, through the rollout engine and the rewards.

Per task (prompts from one split, reference answers never seen in training):

- `i2t_mc/accuracy`, `jigsaw_mc/accuracy`: greedy answer == the correct letter (strict
  A–D verifier: anything but one valid letter is wrong);
- `t2i/score`: mean p(asked digit | decoded image) under the digits classifier, images
  *sampled* at temperature 1 with stateless per-prompt seeds (greedy decoding would give one
  image per digit, whatever the prompt);
- `draw_then_answer/exact_match`: greedy trajectory (text, image, final text) whose final
  text equals the answer.

Also reported: the fraction of rows per finish reason and of invalid-format responses.
"""

from __future__ import annotations

from collections import Counter

import torch

from unirl.core.sample import Sample
from unirl.core.seeding import seed_for
from unirl.data.digits import make_task_samples
from unirl.models.base import UnifiedModel
from unirl.rewards.digit_classifier import (
    CLASSIFIER_DIR,
    DigitClassifier,
    load_or_fit_classifier,
)
from unirl.rewards.plugins import (
    DigitClassifierReward,
    ExactAnswer,
    JigsawVerifier,
    MultipleChoiceExact,
    TextExact,
    build_responses,
    parse_response,
)
from unirl.rollout import RolloutRequest, RolloutService, RolloutTrajectory, SamplingParams

METRIC = {
    "i2t_mc": "accuracy",
    "jigsaw_mc": "accuracy",
    "t2i": "score",
    "draw_then_answer": "exact_match",
    "i2t_open": "accuracy",
    "i2t_mc_say": "accuracy",
    "mc_lookup": "accuracy",
    "i2t_pick": "accuracy",
    "i2t_mc_first": "accuracy",
}
__all__ = [
    "CLASSIFIER_DIR",
    "evaluate_digits",
    "evaluate_task",
    "load_or_fit_classifier",
    "rollout_task",
    "score_task",
]


def _plugin(task: str, classifier: DigitClassifier):
    if task in ("i2t_mc", "mc_lookup", "i2t_pick", "i2t_mc_first"):
        return MultipleChoiceExact()
    if task == "jigsaw_mc":
        return JigsawVerifier()
    if task == "t2i":
        return DigitClassifierReward(classifier)
    if task in ("i2t_open", "i2t_mc_say"):
        return TextExact()
    return ExactAnswer()


def _requests(model: UnifiedModel, task: str, samples: list[Sample], seed: int):
    grid = tuple(model.codec.grid)
    if task == "t2i":
        params = SamplingParams(max_new_tokens=grid[0] * grid[1], length_semantics="exact")
        return [
            RolloutRequest(s, seed_for(seed, 0, i, 0), params, image_grid=grid)
            for i, s in enumerate(samples)
        ]
    short = (
        "i2t_mc",
        "jigsaw_mc",
        "i2t_open",
        "i2t_mc_say",
        "mc_lookup",
        "i2t_pick",
        "i2t_mc_first",
    )
    cap = 8 if task in short else 24 + grid[0] * grid[1]
    params = SamplingParams(greedy=True, max_new_tokens=cap)
    return [RolloutRequest(s, seed_for(seed, 0, i, 0), params) for i, s in enumerate(samples)]


@torch.no_grad()
def rollout_task(
    model: UnifiedModel, task: str, samples: list[Sample], seed: int = 0, batch_size: int = 64
) -> list[RolloutTrajectory]:
    """The trajectories `evaluate_task` scores: one per sample, in order."""
    return RolloutService(model, batch_size).generate(_requests(model, task, samples, seed))


def evaluate_task(
    model: UnifiedModel,
    task: str,
    samples: list[Sample],
    classifier: DigitClassifier,
    seed: int = 0,
    batch_size: int = 64,
) -> dict[str, float]:
    """Metrics of one task on `samples` (see the module docstring)."""
    trajs = rollout_task(model, task, samples, seed, batch_size)
    return score_task(model, task, samples, trajs, classifier)


def score_task(
    model: UnifiedModel,
    task: str,
    samples: list[Sample],
    trajs: list[RolloutTrajectory],
    classifier: DigitClassifier,
) -> dict[str, float]:
    """Metrics of one task from its `rollout_task` trajectories of `samples`."""
    parsed = [parse_response(t, model.tokenizer) for t in trajs]
    responses, _ = build_responses(parsed, model.codec.decode)
    plugin = _plugin(task, classifier)
    scores = torch.as_tensor(plugin.score(samples, responses), dtype=torch.float64)
    invalid = plugin.invalid_format(samples, responses)
    reasons = Counter(t.finish_reason for t in trajs)
    out = {
        f"{task}/{METRIC[task]}": float(scores.mean()),
        f"{task}/invalid_frac": sum(invalid) / len(samples),
        f"{task}/n": float(len(samples)),
    }
    for reason, count in sorted(reasons.items()):
        out[f"{task}/finish_{reason}_frac"] = count / len(samples)
    return out


def evaluate_digits(
    model: UnifiedModel,
    tasks: list[str],
    split: str,
    n_per_task: int,
    classifier: DigitClassifier,
    seed: int = 0,
    rollouts: dict[str, list[RolloutTrajectory]] | None = None,
) -> dict[str, float]:
    """Metrics of every task on `n_per_task` prompts of `split`; `rollouts`, when given,
    receives each task's trajectories (for a further evaluation of the same rows)."""
    out: dict[str, float] = {}
    for task in tasks:
        samples = make_task_samples(task, split, n_per_task, seed=seed)
        trajs = rollout_task(model, task, samples, seed)
        if rollouts is not None:
            rollouts[task] = trajs
        out.update(score_task(model, task, samples, trajs, classifier))
    return out
