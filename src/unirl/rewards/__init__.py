"""Reward plugins: learned scorers (the digits classifier) and verifiers, behind the
`RewardService` (weighted sum, truncation shaping, format and error accounting)."""

from __future__ import annotations

from unirl.rewards.answers import check_answers, check_dataset_answers
from unirl.rewards.plugins import (
    PLUGINS,
    DecodeImages,
    DigitClassifierReward,
    ExactAnswer,
    JigsawVerifier,
    MultipleChoiceExact,
    Response,
    RewardPlugin,
    TextExact,
    build_plugin,
    build_responses,
    parse_response,
    response_parts,
)
from unirl.rewards.service import (
    AllRewardsOverwrittenWarning,
    PluginSpec,
    RewardError,
    RewardResult,
    RewardService,
    build_reward_service,
)

__all__ = [
    "PLUGINS",
    "AllRewardsOverwrittenWarning",
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
    "TextExact",
    "build_plugin",
    "build_responses",
    "build_reward_service",
    "check_answers",
    "check_dataset_answers",
    "parse_response",
    "response_parts",
]
