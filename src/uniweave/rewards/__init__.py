"""Reward plugins: learned scorers (the digits classifier) and verifiers, behind the
`RewardService` (weighted sum, truncation shaping, format and error accounting)."""

from __future__ import annotations

from uniweave.rewards.answers import check_answers, check_dataset_answers
from uniweave.rewards.defaults import (
    TASK_VERIFIERS,
    TaskVerifier,
    evaluation_reward,
    headline_metrics,
    passes,
)
from uniweave.rewards.judge import AnswerJudge
from uniweave.rewards.plugins import (
    ENTRY_POINT_GROUP,
    PLUGINS,
    DecodeImages,
    DigitClassifierReward,
    ExactAnswer,
    JigsawVerifier,
    MultipleChoiceExact,
    Response,
    RewardPlugin,
    TextExact,
    VisualJigsaw,
    build_plugin,
    build_responses,
    installed_plugins,
    parse_response,
    plugin_class,
    response_parts,
)
from uniweave.rewards.service import (
    AllRewardsOverwrittenWarning,
    PluginSpec,
    RewardError,
    RewardResult,
    RewardService,
    build_reward_service,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGINS",
    "TASK_VERIFIERS",
    "AllRewardsOverwrittenWarning",
    "AnswerJudge",
    "DecodeImages",
    "DigitClassifierReward",
    "ExactAnswer",
    "JigsawVerifier",
    "MultipleChoiceExact",
    "PluginSpec",
    "Response",
    "RewardError",
    "RewardPlugin",
    "RewardResult",
    "RewardService",
    "TaskVerifier",
    "TextExact",
    "VisualJigsaw",
    "build_plugin",
    "build_responses",
    "build_reward_service",
    "check_answers",
    "check_dataset_answers",
    "evaluation_reward",
    "headline_metrics",
    "installed_plugins",
    "parse_response",
    "passes",
    "plugin_class",
    "response_parts",
]
