"""GenEval's results file and its two figures, in GenEval's own formats.

Results (`result_record`, `write_results`, `read_results`): one JSON line per image with
GenEval's keys — `filename`, `tag`, `prompt`, `correct`, `reason`, `metadata` (the row as
`json.dumps` writes it) and `details` (a JSON string: per class the kept boxes, each
`[x1, y1, x2, y2, score]`, most confident first). A results file GenEval wrote reads the
same way.

Figures (`summarise`), as GenEval's `summary_scores.py` computes them:

- per tag, the share of that tag's images judged correct; tags in the order they first
  appear in the results;
- the overall score = the unweighted mean of those tag accuracies (the number published
  tables report);
- `% correct images` = the share of all images correct (not tag-averaged);
- `% correct prompts` = the share of prompts with at least one correct image, a prompt
  being a distinct `metadata` string (images of two folders with identical rows pool into
  one prompt, as in GenEval).

`Summary.table()` prints them in GenEval's layout: percentages with two decimals, each
tag's `correct / images`, the overall score with five decimals.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uniweave.data.errors import DatasetError
from uniweave.rewards.geneval.metadata import MetadataRow
from uniweave.rewards.geneval.rules import Verdict

RESULT_KEYS: tuple[str, ...] = (
    "filename",
    "tag",
    "prompt",
    "correct",
    "reason",
    "metadata",
    "details",
)
"""The keys of one line of GenEval's results JSONL, in its order."""


def result_record(filename: str | Path, row: MetadataRow, verdict: Verdict) -> dict[str, Any]:
    """One results line for the image at `filename` judged `verdict` against `row`."""
    details = {
        label: [[*det.box, float(det.score)] for det in dets]
        for label, dets in verdict.detected.items()
    }
    return {
        "filename": str(filename),
        "tag": row.tag,
        "prompt": row.prompt,
        "correct": bool(verdict.correct),
        "reason": verdict.reason,
        "metadata": row.dumps(),
        "details": json.dumps(details),
    }


def write_results(path: str | Path, records: Iterable[Mapping[str, Any]]) -> Path:
    """Write `records` (from `result_record`) as GenEval's results JSONL at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps({key: record[key] for key in RESULT_KEYS}) + "\n")
    return path


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The records of a results JSONL (ours or GenEval's); `DatasetError` names the
    `FILE:LINE` of a line that is not JSON or lacks `tag`, `correct` or `metadata`."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DatasetError(f"{path}: not found") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{number}: row: not valid JSON ({err.msg})") from None
        for key in ("tag", "correct", "metadata"):
            if not isinstance(record, dict) or key not in record:
                raise DatasetError(f"{path}:{number}: {key}: missing")
        if not isinstance(record["correct"], bool):
            raise DatasetError(
                f"{path}:{number}: correct: expected true or false, got {record['correct']!r}"
            )
        records.append(record)
    return records


@dataclass(frozen=True)
class TagScore:
    """One tag's images: how many, how many correct."""

    tag: str
    correct: int
    images: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.images


@dataclass(frozen=True)
class Summary:
    """GenEval's figures (module docstring)."""

    images: int
    prompts: int
    correct_images: float
    correct_prompts: float
    tags: tuple[TagScore, ...]
    overall: float

    def table(self) -> str:
        """The figures as GenEval's `summary_scores.py` prints them."""
        lines = [
            "Summary",
            "=======",
            f"Total images: {self.images}",
            f"Total prompts: {self.prompts}",
            f"% correct images: {self.correct_images:.2%}",
            f"% correct prompts: {self.correct_prompts:.2%}",
            "",
            "Task breakdown",
            "==============",
        ]
        for t in self.tags:
            lines.append(f"{t.tag:<16} = {t.accuracy:.2%} ({t.correct} / {t.images})")
        lines += ["", f"Overall score (avg. over tasks): {self.overall:.5f}"]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """The figures as plain JSON values; `tags` maps tag -> accuracy, `counts` tag ->
        [correct, images]."""
        return {
            "overall": self.overall,
            "tags": {t.tag: t.accuracy for t in self.tags},
            "counts": {t.tag: [t.correct, t.images] for t in self.tags},
            "images": self.images,
            "prompts": self.prompts,
            "correct_images": self.correct_images,
            "correct_prompts": self.correct_prompts,
        }


def summarise(records: Sequence[Mapping[str, Any]]) -> Summary:
    """GenEval's figures over results `records` (module docstring)."""
    if not records:
        raise ValueError("no results to summarise")
    tags: dict[str, list[int]] = {}
    prompts: dict[str, bool] = {}
    correct = 0
    for record in records:
        ok = bool(record["correct"])
        correct += ok
        counts = tags.setdefault(record["tag"], [0, 0])
        counts[0] += ok
        counts[1] += 1
        prompts[record["metadata"]] = prompts.get(record["metadata"], False) or ok
    scores = tuple(TagScore(tag, c, n) for tag, (c, n) in tags.items())
    return Summary(
        images=len(records),
        prompts=len(prompts),
        correct_images=correct / len(records),
        correct_prompts=sum(prompts.values()) / len(prompts),
        tags=scores,
        overall=sum(t.accuracy for t in scores) / len(scores),
    )
