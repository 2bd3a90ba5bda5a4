"""Unconditional rows for classifier-free guidance (docs/numerics.md §1).

A guided request has one unconditional row per conditional row. Its prompt comes from
the model adapter (`UnifiedModel.unconditional_prompt`); everything after the prompt is
shared: the unconditional row is fed exactly the positions the conditional row samples,
so at a visual position both rows score the same history and z = u + w (c - u).
"""

from __future__ import annotations

import torch

from uniweave.core.trajectory import Trajectory
from uniweave.core.types import Modality
from uniweave.models.base import UnifiedModel


def _image_count(modality: torch.Tensor) -> int:
    """Number of images (runs of visual positions) in a modality vector."""
    visual = modality == Modality.VISUAL
    if visual.numel() == 0:
        return 0
    starts = visual[1:] & ~visual[:-1]
    return int(starts.sum()) + int(visual[0])


def unconditional_prompt(model: UnifiedModel, prompt: Trajectory) -> Trajectory:
    """The adapter's unconditional prompt, checked to use the same code kind."""
    uncond = model.unconditional_prompt(prompt)
    if uncond.visual_codes.shape[1:] != prompt.visual_codes.shape[1:] or (
        uncond.visual_codes.dtype != prompt.visual_codes.dtype
    ):
        raise ValueError(
            f"{type(model).__name__}.unconditional_prompt changed the visual code kind of "
            f"{prompt.sample_id!r}"
        )
    return uncond


def unconditional_twin(model: UnifiedModel, traj: Trajectory, prompt_length: int) -> Trajectory:
    """unconditional_prompt(traj[:prompt_length]) followed by traj[prompt_length:].

    The twin's response positions are the trajectory's, shifted by the difference of the
    two prompt lengths (0 for the default adapter). Rollout log-probs are dropped; the
    twin carries the understanding images its unconditional prompt keeps.
    """
    n = prompt_length
    head = Trajectory(
        token_ids=traj.token_ids[:n],
        modality=traj.modality[:n],
        owner=traj.owner[:n],
        visual_codes=traj.visual_codes[:n],
        image_grids=list(traj.image_grids[: _image_count(traj.modality[:n])]),
        sample_id=traj.sample_id,
        images=list(traj.images),
    )
    uncond = unconditional_prompt(model, head)
    n_prompt_images = len(head.image_grids)
    return Trajectory(
        token_ids=torch.cat([uncond.token_ids, traj.token_ids[n:]]),
        modality=torch.cat([uncond.modality, traj.modality[n:]]),
        owner=torch.cat([uncond.owner, traj.owner[n:]]),
        visual_codes=torch.cat([uncond.visual_codes, traj.visual_codes[n:]]),
        image_grids=[*uncond.image_grids, *traj.image_grids[n_prompt_images:]],
        sample_id=traj.sample_id,
        finish_reason=traj.finish_reason,
        length_semantics=traj.length_semantics,
        images=list(uncond.images),
    )
