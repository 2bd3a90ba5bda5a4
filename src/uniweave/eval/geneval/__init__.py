"""GenEval's compositional checks (djghosh13/geneval), re-stated without mmdet.

Metadata, rules, detectors, the colour classifier and the `geneval` reward live in
`uniweave.rewards.geneval` (the reward plugin needs them, and rewards sit below eval);
their public names are re-exported here. This package adds:

- `summary`: GenEval's results JSONL and its figures (per-tag accuracy, overall = mean of
  the tag accuracies, % correct images and prompts), printed in its layout.
- `folder`: a folder in GenEval's layout (`<index>/metadata.jsonl`, `<index>/samples/NNNN.png`)
  with every missing or unreadable image counted and named.
- `score`: a folder scored with a `GenEvalScorer` (`uniweave score`): results JSONL,
  summary table and JSON, problems named.
"""

from uniweave.eval.geneval.folder import FolderProblem, FolderSample, GenEvalFolder, read_folder
from uniweave.eval.geneval.summary import (
    Summary,
    TagScore,
    read_results,
    result_record,
    summarise,
    write_results,
)
from uniweave.rewards.geneval.metadata import (
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
from uniweave.rewards.geneval.rules import (
    Detection,
    GenEvalThresholds,
    Verdict,
    judge,
    kept_detections,
    relative_position,
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
