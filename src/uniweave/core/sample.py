"""A dataset row as ordered parts, and the sample-id lineage that groups GRPO members.

A `Sample` is what a task produces and what rewards read: an ordered list of parts
(text, image, a request to generate an image), each with a chat role. Parts whose role
is "assistant" are the response (targets for SFT); the others are the prompt.

Ids carry lineage: `fork(3)` of sample "prompt-7" is "prompt-7/3", member 3 of group
"prompt-7". Only a trailing "/<digits>" is a member number, so forks nest
("prompt-7/3/1" is member 1 of group "prompt-7/3").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

import numpy as np
import torch

Role = Literal["system", "user", "assistant"]
ROLES: frozenset[str] = frozenset(get_args(Role))

_MEMBER_RE = re.compile(r"^(?P<group>.+)/(?P<member>0|[1-9][0-9]*)$")


def _check_role(kind: str, role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"{kind}.role must be one of {sorted(ROLES)}, got {role!r}")


@dataclass(frozen=True)
class TextPart:
    """A span of text spoken by `role`."""

    text: str
    role: Role = "user"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"TextPart.text must be a str, got {type(self.text).__name__}")
        _check_role("TextPart", self.role)


@dataclass(frozen=True, eq=False)
class ImagePart:
    """An image given as pixels, codec codes, or both (at least one is set).

    `pixels`: float32 ndarray [H, W] or [H, W, C] in [0, 1]. `codes`: VQ long [gh, gw] or
    BSQ float {0, 1} [gh, gw, L]. Equality is identity (arrays do not compare as bools).
    """

    pixels: np.ndarray | None = None
    codes: torch.Tensor | None = None
    role: Role = "user"

    def __post_init__(self) -> None:
        _check_role("ImagePart", self.role)
        if self.pixels is None and self.codes is None:
            raise ValueError("ImagePart needs pixels or codes (both are None)")
        if self.pixels is not None:
            px = self.pixels
            if not isinstance(px, np.ndarray) or px.ndim not in (2, 3):
                raise ValueError("ImagePart.pixels must be an ndarray [H, W] or [H, W, C]")
            if not np.issubdtype(px.dtype, np.floating):
                raise ValueError(f"ImagePart.pixels must be floating, got dtype {px.dtype}")
            if px.size and not (np.isfinite(px).all() and px.min() >= 0.0 and px.max() <= 1.0):
                raise ValueError("ImagePart.pixels must be finite values in [0, 1]")
        if self.codes is not None:
            c = self.codes
            if not isinstance(c, torch.Tensor):
                raise ValueError("ImagePart.codes must be a torch.Tensor")
            is_vq = c.dim() == 2 and c.dtype == torch.long
            is_bsq = c.dim() == 3 and c.is_floating_point()
            if not (is_vq or is_bsq):
                raise ValueError(
                    "ImagePart.codes must be VQ long [gh, gw] or BSQ float [gh, gw, L], "
                    f"got {c.dtype} {tuple(c.shape)}"
                )

    @property
    def grid(self) -> tuple[int, int] | None:
        """(gh, gw) of the codes, or None when only pixels are set."""
        if self.codes is None:
            return None
        return int(self.codes.shape[0]), int(self.codes.shape[1])


@dataclass(frozen=True)
class GenerationRequest:
    """The assistant must now generate an image of `height` x `width` visual positions."""

    height: int
    width: int
    role: Role = "assistant"

    def __post_init__(self) -> None:
        _check_role("GenerationRequest", self.role)
        for name in ("height", "width"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"GenerationRequest.{name} must be a positive int, got {v!r}")

    @property
    def n_positions(self) -> int:
        """height * width visual positions."""
        return self.height * self.width


Part = TextPart | ImagePart | GenerationRequest
_PART_TYPES = (TextPart, ImagePart, GenerationRequest)


@dataclass
class Sample:
    """One dataset row: id with lineage, ordered parts, reference answer, task and meta."""

    id: str
    parts: list[Part]
    answer: str | None = None
    task: str | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Sample.id must be a non-empty str, got {self.id!r}")
        self.parts = list(self.parts)
        for i, part in enumerate(self.parts):
            if not isinstance(part, _PART_TYPES):
                raise TypeError(
                    f"Sample {self.id!r}: parts[{i}] must be TextPart, ImagePart or "
                    f"GenerationRequest, got {type(part).__name__}"
                )

    @property
    def prompt_parts(self) -> list[Part]:
        """Parts whose role is not "assistant" (the prompt), in order."""
        return [p for p in self.parts if p.role != "assistant"]

    @property
    def response_parts(self) -> list[Part]:
        """Parts whose role is "assistant" (SFT targets and generation requests), in order."""
        return [p for p in self.parts if p.role == "assistant"]

    @property
    def group_id(self) -> str:
        """The group this sample belongs to (its id without a trailing member number)."""
        return parse_sample_id(self.id)[0]

    @property
    def member(self) -> int | None:
        """This sample's member number in its group, or None for an un-forked sample."""
        return parse_sample_id(self.id)[1]

    def fork(self, member: int) -> Sample:
        """A copy with id f"{id}/{member}" (parts shared, meta shallow-copied)."""
        if isinstance(member, bool) or not isinstance(member, int) or member < 0:
            raise ValueError(f"fork member must be a non-negative int, got {member!r}")
        return replace(self, id=f"{self.id}/{member}", parts=list(self.parts), meta=dict(self.meta))


def parse_sample_id(sample_id: str) -> tuple[str, int | None]:
    """Split "group/member" into (group, member); an id without one gives (id, None)."""
    if not isinstance(sample_id, str) or not sample_id:
        raise ValueError(f"sample id must be a non-empty str, got {sample_id!r}")
    m = _MEMBER_RE.match(sample_id)
    if m is None:
        return sample_id, None
    return m.group("group"), int(m.group("member"))


def group_ids(ids: Sequence[str]) -> list[str]:
    """The group id of each id, in order (same length as `ids`)."""
    return [parse_sample_id(i)[0] for i in ids]


def validate_groups(ids: Sequence[str]) -> tuple[int, int]:
    """Check GRPO grouping and return (n_groups, group_size).

    Every id must carry a member number; members of one group are contiguous and
    numbered 0..G-1 in order; all groups have the same G. Otherwise ValueError naming
    the offending id.
    """
    if len(ids) == 0:
        raise ValueError("validate_groups: no sample ids")
    seen: set[str] = set()
    sizes: list[int] = []
    current: str | None = None
    for sid in ids:
        group, member = parse_sample_id(sid)
        if member is None:
            raise ValueError(f"sample id {sid!r} has no member number (expected 'group/k')")
        if group != current:
            if group in seen:
                raise ValueError(f"sample id {sid!r}: group {group!r} is not contiguous")
            if sizes and sizes[-1] != sizes[0]:
                raise ValueError(
                    f"group {current!r} has {sizes[-1]} members, expected {sizes[0]} "
                    f"(group sizes must be uniform)"
                )
            seen.add(group)
            current = group
            sizes.append(0)
        if member != sizes[-1]:
            raise ValueError(
                f"sample id {sid!r}: expected member {sizes[-1]} of group {group!r}, got {member}"
            )
        sizes[-1] += 1
    if sizes[-1] != sizes[0]:
        raise ValueError(
            f"group {current!r} has {sizes[-1]} members, expected {sizes[0]} "
            f"(group sizes must be uniform)"
        )
    return len(sizes), sizes[0]
