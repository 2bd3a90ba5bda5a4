"""GenEval's compositional checks (djghosh13/geneval), re-stated without mmdet.

- `metadata`: GenEval metadata rows (tag, prompt, include/exclude clauses), read strictly;
  a bad row is a `MetadataError` naming `FILE:LINE` and the field.
- `rules`: which detections count and GenEval's verdict on one image (`judge`), every
  number a field of `GenEvalThresholds` defaulting to GenEval's.
- `summary`: GenEval's results JSONL and its figures (per-tag accuracy, overall = mean of
  the tag accuracies, % correct images and prompts), printed in its layout.
- `folder`: a folder in GenEval's layout (`<index>/metadata.jsonl`, `<index>/samples/NNNN.png`)
  with every missing or unreadable image counted and named.

Detectors, colour classification and the commands that generate and score folders are not
here yet (docs/geneval.md).
"""

from uniweave.eval.geneval.folder import FolderProblem, FolderSample, GenEvalFolder, read_folder
from uniweave.eval.geneval.metadata import (
    COCO_CLASSES,
    COLOURS,
    RELATIONS,
    TAGS,
    Exclude,
    Include,
    MetadataError,
    MetadataRow,
    parse_row,
    read_metadata,
    read_prompt_metadata,
)
from uniweave.eval.geneval.rules import (
    Detection,
    GenEvalThresholds,
    Verdict,
    judge,
    kept_detections,
    relative_position,
)
from uniweave.eval.geneval.summary import (
    Summary,
    TagScore,
    read_results,
    result_record,
    summarise,
    write_results,
)

__all__ = [
    "COCO_CLASSES",
    "COLOURS",
    "RELATIONS",
    "TAGS",
    "Detection",
    "Exclude",
    "FolderProblem",
    "FolderSample",
    "GenEvalFolder",
    "GenEvalThresholds",
    "Include",
    "MetadataError",
    "MetadataRow",
    "Summary",
    "TagScore",
    "Verdict",
    "judge",
    "kept_detections",
    "parse_row",
    "read_folder",
    "read_metadata",
    "read_prompt_metadata",
    "read_results",
    "relative_position",
    "result_record",
    "summarise",
    "write_results",
]
