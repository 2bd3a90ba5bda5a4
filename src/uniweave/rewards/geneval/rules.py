"""GenEval's verdict on one image: a metadata row, the detector's output, correct or not.

The rules are those of GenEval's evaluation script (djghosh13/geneval,
`evaluation/evaluate_images.py`), re-stated here; every number in them is a field of
`GenEvalThresholds`, whose defaults are GenEval's.

Which detections count (`kept_detections`), per class:

1. keep those whose score is strictly above `threshold` (0.3), or above
   `counting_threshold` (0.9) when the row's tag is `counting`;
2. order them by score, highest first (exact ties keep the input order);
3. keep the first `max_objects` (16);
4. then drop, in that order, each one whose IoU with an already kept one of its class is
   `max_overlap` or more — unless `max_overlap` is 1.0 (the default), which turns this
   off: GenEval runs no NMS. IoU counts pixels inclusively, as GenEval does (a box's area
   is `(x2 - x1 + 1) * (y2 - y1 + 1)`).

The verdict (`judge`): include clauses are ANDed, exclude clauses ORed, and every failed
clause adds a line to the reason. For include clause i (class c, count n):

- its objects are the first n kept detections of c; fewer than n fails it;
- with a colour, each of those n must carry that colour (the colour is judged on the n
  most confident objects only; more objects of c beyond them are not looked at);
- with a position `[relation, j]` (checked only if the colour passed): when include group
  j failed, this clause fails ("no target"); else every one of its n objects must stand in
  `relation` to every one of group j's objects, by `relative_position`.

An exclude clause (class c, count n) fails when n or more detections of c are kept.

`relative_position(a, b)` — where box a stands relative to box b, image y pointing down:
with centres c and sizes d = (|x2 - x1|, |y2 - y1|), the offset o = c_a - c_b is shrunk
towards 0 per axis by the margin m = `position_threshold` · (d_a + d_b) (0.1 × the sum of
the two boxes' widths, resp. heights): r = sign(o) · max(|o| - m, 0). If both |r| are
below 1e-3 pixel no relation holds; else u = r / |o| (|o| the Euclidean length of the
unshrunk offset) and "left of" holds when u_x < -s, "right of" when u_x > s, "above" when
u_y < -s, "below" when u_y > s, with s = `direction_threshold` (0.5). So on one axis a
relation needs |o| > 2m, and a diagonal offset can hold two relations or none.

A score that a detector produced in float32 and that reads 0.3 is 0.30000001192... once
widened, so it is kept, as in GenEval (which compares float32 scores to the float 0.3):
hand over scores as they are, not rounded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from uniweave.rewards.geneval.metadata import COLOURS, RELATIONS, MetadataRow

NO_OFFSET_PX = 1e-3
"""Below this many pixels on both axes a shrunk offset is no offset (GenEval's constant)."""


@dataclass(frozen=True)
class GenEvalThresholds:
    """Every number of GenEval's rules (module docstring); defaults are GenEval's, and
    its command-line option names are the field names."""

    threshold: float = 0.3
    """A detection counts when its score is strictly above this (every tag but counting)."""
    counting_threshold: float = 0.9
    """The same for rows tagged `counting`."""
    max_objects: int = 16
    """At most this many detections per class, the most confident ones."""
    max_overlap: float = 1.0
    """Per-class NMS: drop a detection whose IoU with a kept one is >= this; 1.0: no NMS."""
    position_threshold: float = 0.1
    """The position margin per axis, as a share of the two boxes' summed sizes."""
    direction_threshold: float = 0.5
    """A relation holds when the shrunk offset over the offset's length passes this."""

    def __post_init__(self) -> None:
        for name in ("threshold", "counting_threshold", "direction_threshold"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0.0 <= value < 1.0):
                raise ValueError(f"GenEvalThresholds.{name}: expected 0 <= x < 1, got {value!r}")
        if not (isinstance(self.max_overlap, int | float) and 0.0 < self.max_overlap <= 1.0):
            raise ValueError(
                f"GenEvalThresholds.max_overlap: expected 0 < x <= 1, got {self.max_overlap!r}"
            )
        if not (
            isinstance(self.position_threshold, int | float)
            and math.isfinite(self.position_threshold)
            and self.position_threshold >= 0.0
        ):
            raise ValueError(
                "GenEvalThresholds.position_threshold: expected a finite x >= 0, "
                f"got {self.position_threshold!r}"
            )
        if (
            not isinstance(self.max_objects, int)
            or isinstance(self.max_objects, bool)
            or self.max_objects < 1
        ):
            raise ValueError(
                f"GenEvalThresholds.max_objects: expected an integer >= 1, got {self.max_objects!r}"
            )

    def score_threshold(self, tag: str) -> float:
        """The detection threshold for rows of `tag`."""
        return self.counting_threshold if tag == "counting" else self.threshold


@dataclass(frozen=True)
class Detection:
    """One detected object: class `label`, `score`, `box` (x1, y1, x2, y2) in pixels,
    optionally its `mask` (an array of the image's (height, width)) and its `colour` (one of
    `COLOURS`, from a colour classifier; needed only for objects a colour clause judges)."""

    label: str
    score: float
    box: tuple[float, float, float, float]
    mask: Any = None
    colour: str | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.score):
            raise ValueError(f"Detection {self.label!r}: score {self.score!r} is not finite")
        box = tuple(float(v) for v in self.box)
        if len(box) != 4 or not all(math.isfinite(v) for v in box):
            raise ValueError(f"Detection {self.label!r}: box {self.box!r} is not 4 finite numbers")
        if box[2] < box[0] or box[3] < box[1]:
            raise ValueError(f"Detection {self.label!r}: box {self.box!r} is not x1<=x2, y1<=y2")
        object.__setattr__(self, "box", box)
        if self.colour is not None and self.colour not in COLOURS:
            raise ValueError(
                f"Detection {self.label!r}: colour {self.colour!r} is not one of "
                f"{', '.join(COLOURS)}"
            )


@dataclass(frozen=True)
class Verdict:
    """GenEval's verdict on one image: `correct`, and `reason` with one line per failed
    clause (empty when correct); `detected` holds the kept detections per class, the most
    confident first (GenEval's `details`); `includes` / `excludes` say per clause of the
    row whether it held (the `geneval` reward's partial credit reads them)."""

    correct: bool
    reason: str
    detected: Mapping[str, tuple[Detection, ...]] = field(default_factory=dict)
    includes: tuple[bool, ...] = ()
    excludes: tuple[bool, ...] = ()


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two xyxy boxes counting pixels inclusively (GenEval's NMS measure)."""

    def area(x1: float, y1: float, x2: float, y2: float) -> float:
        return max(x2 - x1 + 1, 0) * max(y2 - y1 + 1, 0)

    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a) + area(*b) - inter
    return inter / union if union else 0.0


def kept_detections(
    detections: Sequence[Detection], tag: str, thresholds: GenEvalThresholds
) -> dict[str, tuple[Detection, ...]]:
    """The detections GenEval counts for a row of `tag`, per class, most confident first
    (module docstring, steps 1-4); classes with none kept are absent."""
    cut = thresholds.score_threshold(tag)
    by_class: dict[str, list[Detection]] = {}
    for det in detections:
        if det.score > cut:
            by_class.setdefault(det.label, []).append(det)
    kept: dict[str, tuple[Detection, ...]] = {}
    for label, dets in by_class.items():
        ordered = sorted(dets, key=lambda d: -d.score)[: thresholds.max_objects]
        if thresholds.max_overlap < 1.0:
            survivors: list[Detection] = []
            for det in ordered:
                if all(box_iou(k.box, det.box) < thresholds.max_overlap for k in survivors):
                    survivors.append(det)
            ordered = survivors
        kept[label] = tuple(ordered)
    return kept


def relative_position(
    box_a: Sequence[float], box_b: Sequence[float], thresholds: GenEvalThresholds
) -> frozenset[str]:
    """The relations (of `RELATIONS`) in which box a stands to box b (module docstring)."""
    centre_a = ((box_a[0] + box_a[2]) / 2, (box_a[1] + box_a[3]) / 2)
    centre_b = ((box_b[0] + box_b[2]) / 2, (box_b[1] + box_b[3]) / 2)
    size_a = (abs(box_a[2] - box_a[0]), abs(box_a[3] - box_a[1]))
    size_b = (abs(box_b[2] - box_b[0]), abs(box_b[3] - box_b[1]))
    offset = (centre_a[0] - centre_b[0], centre_a[1] - centre_b[1])
    shrunk = []
    for axis in (0, 1):
        margin = thresholds.position_threshold * (size_a[axis] + size_b[axis])
        shrunk.append(math.copysign(max(abs(offset[axis]) - margin, 0.0), offset[axis]))
    if all(abs(v) < NO_OFFSET_PX for v in shrunk):
        return frozenset()
    length = math.hypot(*offset)
    ux, uy = shrunk[0] / length, shrunk[1] / length
    s = thresholds.direction_threshold
    found = set()
    if ux < -s:
        found.add("left of")
    if ux > s:
        found.add("right of")
    if uy < -s:
        found.add("above")
    if uy > s:
        found.add("below")
    return frozenset(found)


def _relations(found: frozenset[str]) -> str:
    return " and ".join(r for r in RELATIONS if r in found) or "no relation"


def _check_image(detections: Sequence[Detection], image_size: tuple[int, int]) -> None:
    width, height = image_size
    if width < 1 or height < 1:
        raise ValueError(f"image_size {image_size!r}: expected (width, height) >= 1")
    for det in detections:
        x1, y1, x2, y2 = det.box
        if x2 < 0 or y2 < 0 or x1 > width or y1 > height:
            raise ValueError(
                f"Detection {det.label!r}: box {det.box} lies outside the "
                f"{width}x{height} image (boxes are in pixels)"
            )
        shape = getattr(det.mask, "shape", None)
        if det.mask is not None and tuple(shape or ()) != (height, width):
            raise ValueError(
                f"Detection {det.label!r}: mask shape {tuple(shape or ())} is not the "
                f"image's (height, width) = ({height}, {width})"
            )


def judge(
    row: MetadataRow,
    detections: Sequence[Detection],
    image_size: tuple[int, int],
    thresholds: GenEvalThresholds | None = None,
) -> Verdict:
    """GenEval's verdict on one image of `row` from the detector's `detections` (module
    docstring). `image_size` is (width, height): every box must touch the image and every
    mask have its (height, width). Raises ValueError when a colour clause judges an object
    that carries no colour (run the colour classifier on it)."""
    thresholds = thresholds or GenEvalThresholds()
    _check_image(detections, image_size)
    detected = kept_detections(detections, row.tag, thresholds)
    reasons: list[str] = []
    groups: list[tuple[Detection, ...] | None] = []
    excludes: list[bool] = []
    for i, clause in enumerate(row.include):
        name = f"include[{i}] ({clause.cls})"
        found = detected.get(clause.cls, ())[: clause.count]
        matched = len(found) >= clause.count
        if not matched:
            reasons.append(f"{name}: expected {clause.cls}>={clause.count}, found {len(found)}")
        if matched and clause.colour is not None:
            colours = [det.colour for det in found]
            if None in colours:
                raise ValueError(
                    f"{row.source}: {name} asks for colour {clause.colour!r} but a detection "
                    "of it has no colour; run the colour classifier on the judged objects"
                )
            hits = colours.count(clause.colour)
            if hits < clause.count:
                matched = False
                seen = ", ".join(f"{colours.count(c)} {c}" for c in COLOURS if c in colours)
                reasons.append(
                    f"{name}: expected {clause.colour} {clause.cls}>={clause.count}, found "
                    f"{hits} {clause.colour}; colours of the {clause.count} most confident: {seen}"
                )
        if matched and clause.position is not None:
            relation, target = clause.position
            target_objects = groups[target]
            if target_objects is None:
                matched = False
                reasons.append(
                    f"{name}: no target for {clause.cls} to be {relation} "
                    f"(include[{target}] failed)"
                )
            else:
                for obj in found:
                    for other in target_objects:
                        held = relative_position(obj.box, other.box, thresholds)
                        if relation not in held:
                            matched = False
                            reasons.append(
                                f"{name}: expected {clause.cls} {relation} include[{target}] "
                                f"({row.include[target].cls}), found {_relations(held)}"
                            )
                            break
                    if not matched:
                        break
        groups.append(found if matched else None)
    for i, excluded in enumerate(row.exclude):
        n = len(detected.get(excluded.cls, ()))
        excludes.append(n < excluded.count)
        if n >= excluded.count:
            reasons.append(
                f"exclude[{i}] ({excluded.cls}): expected {excluded.cls}<{excluded.count}, "
                f"found {n}"
            )
    includes = tuple(group is not None for group in groups)
    return Verdict(not reasons, "\n".join(reasons), detected, includes, tuple(excludes))
