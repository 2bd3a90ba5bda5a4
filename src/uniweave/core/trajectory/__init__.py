"""The token stream (docs/architecture.md §2): a `Trajectory` per sample, `TrajectoryBatch` padded.

Convention: position t holds token t. Scored positions are those with owner == POLICY
(never position 0); the log-prob stored at position t is log pi(token t | tokens < t),
computed from the model's hidden state at t-1. `visual_codes` is VQ long [T] (-1 where
not visual) or BSQ float32 [T, L] with values {0, 1} (0 where not visual). Visual
positions hold the placeholder token id (`<|image_pad|>`).

`images` are the trajectory's *understanding-image inputs*, in order of appearance: what
the model reads that its token stream only points at (Janus-Pro: the pixels of each
``<begin_of_image>`` + placeholder block, float [S, S, 3] in [0, 1]). They travel with the
trajectory — in a batch, across processes, on disk — so any model built from the same
checkpoint (a frozen reference, a teacher, a resumed run, a worker) can replay it with no
state hidden in the model. Models that encode input images into visual positions (the
tiny model) carry none.

A batch is right-padded: row i's real positions are 0..lengths[i]-1. Padding values:
token_ids = pad_id, modality = TEXT, owner = PROMPT, visual_codes = -1 (VQ) / 0 (BSQ),
rollout log-probs = 0. `collate` then `unbatch` returns equal trajectories.
`to_state` / `from_state` turn a trajectory into plain tensors, strings and numbers (what
`torch.load(..., weights_only=True)` accepts) and back; `save_trajectories` /
`load_trajectories` write and read a list of them atomically.

Per-row training data (one separated block of fields): what a batch source attaches to a
row for the objective that trains on it, so that a micro-batch is self-describing —
`advantage` (a float; collated to float32 [B]), the ratio's anchor `old_logp` /
`old_logp_factors` (laid out like the rollout log-probs, 0 off the policy positions),
the row's stateless `seed`, and `sampling` (how the row was produced; opaque to core, the
rollout layer's `SamplingRecord`). Each is optional; a batch has a tensor field only when
every row has it.

Modules: `stream` (the two dataclasses), `rules` (what a valid trajectory is, each rule
written once: `Trajectory.validate` and `validate_all` apply the same ones) and `files`
(`save_trajectories` / `load_trajectories`); their public names are re-exported here.
"""

from uniweave.core.trajectory.files import load_trajectories, save_trajectories
from uniweave.core.trajectory.rules import BITS_PAD, VQ_PAD, validate_all
from uniweave.core.trajectory.stream import Trajectory, TrajectoryBatch

__all__ = [
    "BITS_PAD",
    "VQ_PAD",
    "Trajectory",
    "TrajectoryBatch",
    "load_trajectories",
    "save_trajectories",
    "validate_all",
]
