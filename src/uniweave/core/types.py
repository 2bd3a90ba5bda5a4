"""Enumerations shared by every part of the token stream (docs/architecture.md §2).

`Modality` and `Owner` are stored per position as long tensors, so they are `IntEnum`s
whose values are the stored integers. `FinishReason` says why a rollout row stopped;
`TRUNCATED_REASONS` are the reasons that truncation shaping applies to (docs/numerics.md
§10): an `eos` row finished, a `length_exact` row hit an exact count by
construction, an `invalid` row broke the format.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Literal, get_args


class Modality(IntEnum):
    """What a position holds: a text token or a visual code (placeholder token id)."""

    TEXT = 0
    VISUAL = 1


class Owner(IntEnum):
    """Who produced a position: given prompt, the trained policy, or the rule controller."""

    PROMPT = 0
    POLICY = 1
    CONTROLLER = 2


FinishReason = Literal["eos", "cap", "context", "cycle", "length_exact", "invalid"]
FINISH_REASONS: frozenset[str] = frozenset(get_args(FinishReason))
TRUNCATED_REASONS: frozenset[str] = frozenset({"cap", "context", "cycle"})

LengthSemantics = Literal["cap", "exact"]
LENGTH_SEMANTICS: frozenset[str] = frozenset(get_args(LengthSemantics))
