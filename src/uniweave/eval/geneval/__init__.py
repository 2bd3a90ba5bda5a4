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
from uniweave.rewards import geneval as _rewards_geneval
from uniweave.rewards.geneval import *  # noqa: F403  (the metadata and rules names)

__all__ = [
    *_rewards_geneval.__all__,
    "FolderProblem",
    "FolderSample",
    "GenEvalFolder",
    "Summary",
    "TagScore",
    "read_folder",
    "read_results",
    "result_record",
    "summarise",
    "write_results",
]
