"""GenEval's compositional checks (djghosh13/geneval), re-stated without mmdet, and the
models and reward that apply them (docs/geneval.md).

- `metadata`: GenEval metadata rows (tag, prompt, include/exclude clauses), read strictly;
  a bad row is a `MetadataError` naming `FILE:LINE` and the field.
- `rules`: which detections count and GenEval's verdict on one image (`judge`), every
  number a field of `GenEvalThresholds` defaulting to GenEval's.
- `detectors`: the `Detector` interface and its transformers implementations
  (Mask2Former instance segmentation, OWLv2 open vocabulary).
- `colour`: GenEval's CLIP zero-shot colour classifier on masked crops.
- `scorer`: detector + colour + rules: GenEval's verdict on images.
- `reward`: the `geneval` reward plugin.

These live with the reward plugins (layer `rewards`) because the `geneval` plugin uses
them; `uniweave.eval.geneval` re-exports them beside the results, summary and folder
modules. Importing this package loads no model: the detectors import transformers when
they are built.
"""

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
    "GenEvalThresholds",
    "Include",
    "MetadataError",
    "MetadataRow",
    "Verdict",
    "judge",
    "kept_detections",
    "parse_row",
    "read_metadata",
    "read_prompt_metadata",
    "relative_position",
]
