"""Score a folder in GenEval's layout (what `uniweave score` runs).

`score_folder(folder, scorer, out, missing, on_error)` judges every readable image of a
`GenEvalFolder` (`read_folder`) with a `GenEvalScorer`, `scorer.detector.batch_size`
images per detector pass, and writes to `out`:

- `results.jsonl`: GenEval's results, one line per judged image (`summary.result_record`);
- `summary.txt`: GenEval's table (`Summary.table`), preceded by the problems;
- `summary.json`: the figures (`Summary.to_dict`), the problems (`kind`, `path`,
  `detail`) and counts per kind, the policy `missing` and the thresholds used.

Images that cannot be judged are never dropped silently. A *missing* or *unreadable*
image (`folder.py`) is named in both summaries and, with `missing="wrong"` (default),
also judged incorrect (a results line whose `reason` says why), so the figures stay over
every image expected; `missing="skip"` leaves it out of the figures, which then equal what
GenEval computes from the files present. An *unexpected* file is named and never scored.
A detection that fails (`DetectionError` or any error of the models) follows `on_error`:
"raise" (default) stops with an error naming the image; "zero" names it as a *failed*
problem and judges it incorrect.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from uniweave.eval.geneval.folder import FolderProblem, FolderSample, GenEvalFolder, load_image
from uniweave.eval.geneval.summary import Summary, result_record, summarise, write_results
from uniweave.rewards.geneval.metadata import read_prompt_metadata
from uniweave.rewards.geneval.rules import Verdict
from uniweave.rewards.geneval.scorer import GenEvalScorer

MissingPolicy = Literal["wrong", "skip"]
ErrorPolicy = Literal["raise", "zero"]
RESULTS = "results.jsonl"
SUMMARY_TXT = "summary.txt"
SUMMARY_JSON = "summary.json"


class ScoringError(RuntimeError):
    """A detection failed under on_error "raise"; names the image."""


@dataclass(frozen=True)
class FolderScore:
    """What `score_folder` found and wrote."""

    summary: Summary | None
    problems: tuple[FolderProblem, ...]
    judged: int
    out: Path

    def count(self, kind: str) -> int:
        return sum(p.kind == kind for p in self.problems)


def _judge_chunk(
    scorer: GenEvalScorer, chunk: Sequence[FolderSample], on_error: ErrorPolicy
) -> list[Verdict | FolderProblem]:
    images = [load_image(s.path) for s in chunk]
    try:
        return list(scorer.verdicts([s.row for s in chunk], images))
    except Exception as err:  # models may fail in any way: find the image(s)
        if len(chunk) == 1:
            why = f"{type(err).__name__}: {err}"
            if on_error == "raise":
                raise ScoringError(
                    f"{chunk[0].path}: detection failed ({why}); pass --on-error zero to "
                    "count it as a failed image"
                ) from err
            return [FolderProblem("failed", chunk[0].path, why)]
    out: list[Verdict | FolderProblem] = []
    for sample in chunk:
        out.extend(_judge_chunk(scorer, [sample], on_error))
    return out


def _unjudged_record(problem: FolderProblem, sample_row: Any) -> dict[str, Any]:
    verdict = Verdict(False, f"{problem.kind}: {problem.detail}")
    return result_record(problem.path, sample_row, verdict)


def score_folder(
    folder: GenEvalFolder,
    scorer: GenEvalScorer,
    out: str | Path,
    missing: MissingPolicy = "wrong",
    on_error: ErrorPolicy = "raise",
) -> FolderScore:
    """Judge `folder` with `scorer` and write the results to `out` (module docstring)."""
    if missing not in ("wrong", "skip"):
        raise ValueError(f"missing must be 'wrong' or 'skip', got {missing!r}")
    if on_error not in ("raise", "zero"):
        raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
    out = Path(out)
    rows = {s.path.parent.parent: s.row for s in folder.samples}
    records: list[dict[str, Any]] = []
    problems = list(folder.problems)
    judged = 0
    step = scorer.detector.batch_size
    for start in range(0, len(folder.samples), step):
        chunk = folder.samples[start : start + step]
        for sample, found in zip(chunk, _judge_chunk(scorer, chunk, on_error)):
            if isinstance(found, FolderProblem):
                problems.append(found)
                records.append(_unjudged_record(found, sample.row))
            else:
                judged += 1
                records.append(result_record(sample.path, sample.row, found))
    if missing == "wrong":
        for problem in folder.problems:
            if problem.kind in ("missing", "unreadable"):
                row = rows.get(problem.path.parent.parent) or _folder_row(problem.path)
                records.append(_unjudged_record(problem, row))
    summary = summarise(records) if records else None
    write_results(out / RESULTS, records)
    lines = [str(p) for p in problems]
    head = _problem_counts(problems)
    text = ""
    if problems:
        text = f"Problems: {head}\n" + "".join(f"  {line}\n" for line in lines) + "\n"
    text += summary.table() if summary else "No image could be judged.\n"
    (out / SUMMARY_TXT).write_text(text, encoding="utf-8")
    payload = {
        **(summary.to_dict() if summary else {}),
        "judged_images": judged,
        "problems": [{"kind": p.kind, "path": str(p.path), "detail": p.detail} for p in problems],
        "problem_counts": {k: sum(p.kind == k for p in problems) for k in _KINDS},
        "missing": missing,
        "on_error": on_error,
        "thresholds": asdict(scorer.thresholds),
        "detector": scorer.detector.name,
    }
    (out / SUMMARY_JSON).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return FolderScore(summary, tuple(problems), judged, out)


_KINDS = ("missing", "unreadable", "unexpected", "failed")


def _problem_counts(problems: Sequence[FolderProblem]) -> str:
    return ", ".join(
        f"{sum(p.kind == k for p in problems)} {k}"
        for k in _KINDS
        if any(p.kind == k for p in problems)
    )


def _folder_row(path: Path) -> Any:
    """The row of the prompt folder holding sample `path` (already checked by read_folder)."""
    return read_prompt_metadata(path.parent.parent / "metadata.jsonl")
