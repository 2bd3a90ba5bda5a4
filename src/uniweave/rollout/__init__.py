"""Rollout: batched, KV-cached sampling of interleaved trajectories (docs/architecture.md §4)."""

from uniweave.rollout.engine import RolloutEngine, context_length
from uniweave.rollout.params import POLICY_FIELDS, SamplingParams, check_same_policy
from uniweave.rollout.request import (
    RolloutRequest,
    RolloutTrajectory,
    SamplingRecord,
    prompt_length_of,
    sampling_records,
)
from uniweave.rollout.service import RolloutService, interleave
from uniweave.rollout.state import RowState
from uniweave.rollout.stopping import has_cycle, image_header

__all__ = [
    "POLICY_FIELDS",
    "RolloutEngine",
    "RolloutRequest",
    "RolloutService",
    "RolloutTrajectory",
    "RowState",
    "SamplingParams",
    "SamplingRecord",
    "check_same_policy",
    "context_length",
    "has_cycle",
    "image_header",
    "interleave",
    "prompt_length_of",
    "sampling_records",
]
