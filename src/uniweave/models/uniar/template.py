"""UniAR's chat format: canonical ChatML (`uniweave.data.template`) on Qwen's tokenizer.

A generated (assistant) image is ``<image_gen> generate image H W<|vision_start|>`` + H*W
composite VISUAL positions (POLICY, holding ``<|image_pad|>`` and their k*k*L bits) +
``<|vision_end|>`` (CONTROLLER). An understanding (user/system) image is Qwen-VL's
``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>``, all PROMPT and TEXT:
the N placeholders (N from the image processor's grid) receive the vision tower's
features, and the image's pixels travel with the trajectory (`Trajectory.images`); it
has no entry in `image_grids` (which lists generated images only). Grid sides of a
generated image are 1..`MAX_GRID_SIDE`.

The special tokens UniAR adds to a Qwen tokenizer (`add_special_tokens`): ``<image_gen>``
and the pad ``<pad>``; their ids are recorded in `uniweave_model.json` and checked on load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from tokenizers import AddedToken

from uniweave.core.sample import GenerationRequest, ImagePart, Part, Sample
from uniweave.core.trajectory import Trajectory
from uniweave.core.types import Modality, Owner
from uniweave.data.template import parse_response, serialize
from uniweave.data.tokenizer import IMAGE_GEN, PAD, SpecialIds

MAX_GRID_SIDE = 30
ADDED_TOKENS = (IMAGE_GEN, PAD)


def add_special_tokens(tokenizer) -> dict[str, int]:
    """Add UniAR's tokens that a (Qwen) tokenizer lacks, as special tokens with the next
    free ids (ids already there are kept); every stream special id by name."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in ADDED_TOKENS if t not in vocab]
    if missing:
        tokens = [AddedToken(t, special=True, normalized=False) for t in missing]
        tokenizer.add_tokens(tokens, special_tokens=True)
    return special_id_map(tokenizer)


def special_id_map(tokenizer) -> dict[str, int]:
    """Every stream special id by field name (`SpecialIds`), for the checkpoint record."""
    return dict(vars(SpecialIds.from_tokenizer(tokenizer)))


def check_grid(height: int, width: int, where: str) -> None:
    """ValueError unless both sides are in 1..MAX_GRID_SIDE."""
    if not (1 <= height <= MAX_GRID_SIDE and 1 <= width <= MAX_GRID_SIDE):
        raise ValueError(
            f"{where}: image grid {height}x{width} outside 1..{MAX_GRID_SIDE} per side"
        )


def serialize_uniar(
    sample: Sample,
    tokenizer,
    n_tokens: Callable[[np.ndarray], int],
    check_pixels: Callable[[np.ndarray, str], np.ndarray],
    encode_image: Callable[[torch.Tensor], torch.Tensor] | None,
    add_generation_prompt: bool,
    bits: int,
) -> Trajectory:
    """The sample in UniAR's format (module docstring). `n_tokens(pixels)` is the number
    of placeholders an understanding image fills."""
    parts: list[Part] = []
    pixels, is_input = [], []
    for k, part in enumerate(sample.parts):
        where = f"sample {sample.id!r} parts[{k}]"
        if isinstance(part, GenerationRequest):
            check_grid(part.height, part.width, where)
        if isinstance(part, ImagePart):
            is_input.append(part.role != "assistant")
            if part.role != "assistant":
                if part.pixels is None:
                    raise ValueError(f"{where}: UniAR reads {part.role} images as pixels")
                px = check_pixels(part.pixels, where)
                pixels.append(px)
                part = ImagePart(codes=torch.zeros(1, n_tokens(px), bits), role=part.role)
            else:
                codes = part.codes
                if codes is not None:
                    check_grid(int(codes.shape[0]), int(codes.shape[1]), where)
        parts.append(part)
    traj = serialize(
        Sample(id=sample.id, parts=parts),
        tokenizer,
        encode_image=encode_image,
        add_generation_prompt=add_generation_prompt,
        bits=bits,
    )
    return _inputs_as_placeholders(traj, is_input, pixels)


def _inputs_as_placeholders(traj: Trajectory, is_input: list[bool], pixels: list) -> Trajectory:
    """Turn the visual runs of understanding images into TEXT placeholder runs (no code,
    no `image_grids` entry) and attach their pixels."""
    visual = (traj.modality == Modality.VISUAL).tolist()
    modality, codes = traj.modality.clone(), traj.visual_codes.clone()
    grids, n_inputs, image, t = [], 0, 0, 0
    while t < len(visual):
        if not visual[t]:
            t += 1
            continue
        h, w = traj.image_grids[image]
        if is_input[image]:
            modality[t : t + h * w] = Modality.TEXT
            codes[t : t + h * w] = 0
            n_inputs += 1
        else:
            grids.append((h, w))
        image, t = image + 1, t + h * w
    return replace(
        traj,
        modality=modality,
        visual_codes=codes,
        image_grids=grids,
        images=[torch.from_numpy(px) for px in pixels[:n_inputs]],
    ).validate()


def uniar_parse_response(traj: Trajectory, tokenizer) -> list[Part] | None:
    """The response parts of a rollout row: ChatML `parse_response` from the
    ``<|im_start|>`` of the turn holding the first POLICY position (earlier turns may hold
    understanding placeholders, which the ChatML reader does not take)."""
    policy = (traj.owner == Owner.POLICY).nonzero()
    if policy.numel() == 0:
        return []
    im_start = SpecialIds.from_tokenizer(tokenizer).im_start
    ids = traj.token_ids.tolist()
    first = int(policy[0])
    starts = [t for t in range(first) if ids[t] == im_start]
    if not starts:
        return None
    cut = starts[-1]
    visual = (traj.modality == Modality.VISUAL).tolist()
    n_after = sum(1 for t in range(cut, len(ids)) if visual[t] and (t == 0 or not visual[t - 1]))
    grids = traj.image_grids[len(traj.image_grids) - n_after :] if n_after else []
    tail = Trajectory(
        token_ids=traj.token_ids[cut:],
        modality=traj.modality[cut:],
        owner=traj.owner[cut:],
        visual_codes=traj.visual_codes[cut:],
        image_grids=list(grids),
        sample_id=traj.sample_id,
    )
    return parse_response(tail, tokenizer)
