"""An example uniweave reward plugin, installed as its own package.

`contains_answer` scores 1.0 when the text of a response contains the row's answer as a
whole word (so "the answer is 7." passes for answer "7", "17" does not), else 0.0. A
response without text, or one that could not be parsed, is invalid (scores 0 and is
counted in `reward/contains_answer/invalid_frac`).

Options (`reward.plugins[].kwargs`): `case_sensitive` (bool, default false).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from uniweave.core.sample import Sample
from uniweave.rewards.base import Response, RewardPlugin


class ContainsAnswer(RewardPlugin):
    """1.0 if the response text contains the answer as a whole word, else 0.0."""

    name = "contains_answer"
    requires_answer = True  # uniweave checks every scored dataset row has an answer
    config_kwargs = frozenset({"case_sensitive"})  # the kwargs the constructor accepts

    def __init__(self, case_sensitive: bool = False) -> None:
        if not isinstance(case_sensitive, bool):
            raise ValueError(f"case_sensitive must be a bool, got {case_sensitive!r}")
        self.flags = 0 if case_sensitive else re.IGNORECASE

    def score(self, samples: Sequence[Sample], responses: Sequence[Response]) -> list[float]:
        out = []
        for sample, response in zip(samples, responses):
            answer = (sample.answer or "").strip()
            if not answer:
                raise ValueError(f"sample {sample.id!r} has no answer")
            pattern = rf"(?<!\w){re.escape(answer)}(?!\w)"
            out.append(float(bool(re.search(pattern, response.text, self.flags))))
        return out

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        return [not r.parsed or not r.text.strip() for r in responses]
