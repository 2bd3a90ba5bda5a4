"""Core data types: samples and parts, the token stream, action distributions, seeding."""

from uniweave.core.distributions import (
    TextCategorical,
    VisualBits,
    VisualCategorical,
    entropy_from_logp,
    guide,
    jsd_from_logp,
    kl_from_logp,
    process_logits,
)
from uniweave.core.sample import (
    ROLES,
    GenerationRequest,
    ImagePart,
    Part,
    Role,
    Sample,
    TextPart,
    group_ids,
    parse_sample_id,
    validate_groups,
)
from uniweave.core.seeding import generator_for, seed_for
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.core.types import (
    FINISH_REASONS,
    LENGTH_SEMANTICS,
    TRUNCATED_REASONS,
    FinishReason,
    LengthSemantics,
    Modality,
    Owner,
)

__all__ = [
    "FINISH_REASONS",
    "LENGTH_SEMANTICS",
    "ROLES",
    "TRUNCATED_REASONS",
    "FinishReason",
    "GenerationRequest",
    "ImagePart",
    "LengthSemantics",
    "Modality",
    "Owner",
    "Part",
    "Role",
    "Sample",
    "TextCategorical",
    "TextPart",
    "Trajectory",
    "TrajectoryBatch",
    "VisualBits",
    "VisualCategorical",
    "entropy_from_logp",
    "generator_for",
    "group_ids",
    "guide",
    "jsd_from_logp",
    "kl_from_logp",
    "parse_sample_id",
    "process_logits",
    "seed_for",
    "validate_groups",
]
