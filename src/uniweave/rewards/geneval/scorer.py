"""GenEval's verdicts on images: a detector, the colour classifier and the rules together.

`GenEvalScorer.verdicts(rows, images)` runs the detector on all images (batched, with
`min_score` = the lowest threshold the rules apply to these rows), then per image:

1. the detections the rules count (`kept_detections` with the row's tag);
2. for each include clause with a colour, its objects — the first `count` counted
   detections of its class, exactly those `judge` will look at — get their colour from
   the colour classifier (each object once, whichever clauses judge it);
3. `judge` on the detections, coloured where needed.

A detector whose detections carry their colour (`colours_objects`: the digits detector's
stroke colours) needs no colour classifier: its colours are used as they are. Otherwise a
row with a colour clause and no colour classifier is a ValueError naming the row (the
command line refuses it before loading any model; the reward plugin counts it under its
error policy). `classes` (the detector's vocabulary) is what metadata is checked against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from PIL import Image

from uniweave.rewards.geneval.colour import ClipColourClassifier
from uniweave.rewards.geneval.detectors import Detector, ImageInput, to_pil
from uniweave.rewards.geneval.metadata import MetadataRow
from uniweave.rewards.geneval.rules import (
    Detection,
    GenEvalThresholds,
    Verdict,
    judge,
    kept_detections,
)


def needs_colour(row: MetadataRow) -> bool:
    """Whether any include clause of `row` asks for a colour."""
    return any(clause.colour is not None for clause in row.include)


class GenEvalScorer:
    """A detector, an optional colour classifier and the thresholds (module docstring)."""

    def __init__(
        self,
        detector: Detector,
        colours: ClipColourClassifier | None = None,
        thresholds: GenEvalThresholds | None = None,
    ) -> None:
        self.detector = detector
        self.colours = colours
        self.thresholds = thresholds or GenEvalThresholds()

    @property
    def classes(self) -> tuple[str, ...]:
        return self.detector.classes

    def coloured(
        self, row: MetadataRow, image: Image.Image, detections: Sequence[Detection]
    ) -> list[Detection]:
        """`detections` with a colour on each object a colour clause of `row` judges."""
        if not needs_colour(row) or self.detector.colours_objects:
            return list(detections)
        if self.colours is None:
            raise ValueError(
                f"{row.source}: asks for a colour but no colour classifier (CLIP) was given"
            )
        index = {id(det): i for i, det in enumerate(detections)}
        kept = kept_detections(detections, row.tag, self.thresholds)
        judged: list[int] = []
        for clause in row.include:
            if clause.colour is None:
                continue
            for det in kept.get(clause.cls, ())[: clause.count]:
                if index[id(det)] not in judged:
                    judged.append(index[id(det)])
        out = list(detections)
        found = self.colours.colours(image, [detections[i] for i in judged])
        for i, colour in zip(judged, found):
            out[i] = dataclasses.replace(detections[i], colour=colour)
        return out

    def judge_detections(
        self, row: MetadataRow, image: ImageInput, detections: Sequence[Detection]
    ) -> Verdict:
        """GenEval's verdict on one image from its detections (steps 1-3)."""
        pil = to_pil(image)
        found = self.coloured(row, pil, detections)
        return judge(row, found, (pil.width, pil.height), self.thresholds)

    def verdicts(self, rows: Sequence[MetadataRow], images: Sequence[ImageInput]) -> list[Verdict]:
        """GenEval's verdict on each image against its row (module docstring)."""
        if len(rows) != len(images):
            raise ValueError(f"{len(rows)} metadata rows for {len(images)} images")
        if self.colours is None and not self.detector.colours_objects:
            for row in rows:
                if needs_colour(row):
                    raise ValueError(
                        f"{row.source}: asks for a colour but no colour classifier (CLIP) was given"
                    )
        if not rows:
            return []
        pil = [to_pil(image) for image in images]
        floor = min(self.thresholds.score_threshold(row.tag) for row in rows)
        detections = self.detector.detect(pil, min_score=floor)
        return [
            self.judge_detections(row, image, dets)
            for row, image, dets in zip(rows, pil, detections)
        ]
