"""GenEval's compositional checks (`uniweave.eval.geneval`, issue 52 part 1).

The verdict table holds hand-built detections for every tag, each threshold edge (the
0.3 and 0.9 score cuts exactly at and on either side, the 16-per-class cap, NMS off and
on), exclude clauses, every position relation with its margin edge, and colour judged on
the most confident objects. Each case's expected verdict and failing clauses are worked
out in its comment from GenEval's written rules (djghosh13/geneval,
evaluation/evaluate_images.py; restated in `uniweave.eval.geneval.rules`), not by running
the code. Then: every kind of bad metadata (the message names FILE:LINE and the field),
the summary figures and table against a hand computation, and the folder reader's
missing / unreadable / unexpected counts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from uniweave.data.errors import DatasetError
from uniweave.eval.geneval import (
    COCO_CLASSES,
    Detection,
    GenEvalThresholds,
    MetadataError,
    judge,
    parse_row,
    read_folder,
    read_metadata,
    read_results,
    result_record,
    summarise,
    write_results,
)

SIZE = (200, 200)
"""(width, height) of every hand-built image; all boxes lie inside it."""


def row(tag: str, include: list[dict], exclude: list[dict] | None = None):
    obj = {"tag": tag, "prompt": f"a {tag} prompt", "include": include}
    if exclude is not None:
        obj["exclude"] = exclude
    return parse_row(obj, "cases:1", COCO_CLASSES)


def det(label: str, score: float, box=(10, 10, 20, 20), colour: str | None = None) -> Detection:
    return Detection(label, score, box, colour=colour)


def at(cx: float, cy: float, w: float = 10, h: float = 10) -> tuple[float, ...]:
    """A w x h box centred on (cx, cy)."""
    return (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)


DOG = {"class": "dog", "count": 1}
CAT = {"class": "cat", "count": 1}
COUCH = {"class": "couch", "count": 1}
THREE_DOGS = ("counting", [{"class": "dog", "count": 3}], [{"class": "dog", "count": 4}])
FLOAT32_POINT_3 = float(np.float32(0.3))
"""0.300000011920928955...: a float32 detector's "0.3", above the float 0.3."""


def left_of_couch(relation: str = "left of", count: int = 1) -> tuple:
    return ("position", [COUCH, {"class": "dog", "count": count, "position": [relation, 0]}])


# Position boxes: 10 x 10 boxes, couch centred on (100, 100). The margin per axis is
# 0.1 * (10 + 10) = 2 px (exact in floats), so an offset o along one axis shrinks to
# |o| - 2 and a relation needs (|o| - 2) / |o| > 0.5, i.e. |o| > 4: o = 4 is the edge
# (0.5, not above it), o = 2 the margin itself (shrunk to 0: no relation at all).
C = (100, 100)


def dog_off(dx: float, dy: float, score: float = 0.8, colour: str | None = None) -> Detection:
    return det("dog", score, at(C[0] + dx, C[1] + dy), colour)


COUCH_DET = det("couch", 0.8, at(*C))


@dataclass
class Case:
    name: str
    spec: tuple
    detections: list[Detection]
    correct: bool
    failed: list[str] = field(default_factory=list)
    """The clauses whose reason lines the verdict holds, in order."""
    thresholds: dict = field(default_factory=dict)
    says: str = ""
    """A phrase the reason must contain."""


CASES = [
    # --- single_object: one include clause, kept above 0.3 (strictly) ---
    Case("single kept", ("single_object", [DOG]), [det("dog", 0.5)], True),
    # score > 0.3 is the rule: exactly 0.3 is not above it, so no dog is kept.
    Case("single at 0.3", ("single_object", [DOG]), [det("dog", 0.3)], False, ["include[0]"],
         says="expected dog>=1, found 0"),
    Case("single just above 0.3", ("single_object", [DOG]), [det("dog", 0.3001)], True),
    Case("single just below 0.3", ("single_object", [DOG]), [det("dog", 0.2999)], False,
         ["include[0]"]),
    # A float32 score that reads 0.3 is 0.30000001... > 0.3: kept, as in GenEval.
    Case("single float32 0.3", ("single_object", [DOG]), [det("dog", FLOAT32_POINT_3)], True),
    # The threshold knob: at 0.6 the 0.5 dog no longer counts.
    Case("single threshold knob", ("single_object", [DOG]), [det("dog", 0.5)], False,
         ["include[0]"], {"threshold": 0.6}),
    # Another class never satisfies the clause.
    Case("single wrong class", ("single_object", [DOG]), [det("cat", 0.9)], False, ["include[0]"]),
    # --- two_object: include clauses are ANDed; each failing one adds a line ---
    Case("two both", ("two_object", [DOG, CAT]), [det("dog", 0.5), det("cat", 0.5)], True),
    Case("two cat missing", ("two_object", [DOG, CAT]), [det("dog", 0.5), det("cat", 0.2)],
         False, ["include[1]"], says="expected cat>=1, found 0"),
    Case("two both missing", ("two_object", [DOG, CAT]), [], False, ["include[0]", "include[1]"]),
    # No NMS by default (max_overlap 1.0): two identical boxes are two objects.
    Case("no NMS: duplicates count", ("two_object", [{"class": "dog", "count": 2}]),
         [det("dog", 0.8), det("dog", 0.7)], True),
    # max_overlap 0.5: the second box has IoU 1 >= 0.5 with the first and is dropped.
    Case("NMS knob drops a duplicate", ("two_object", [{"class": "dog", "count": 2}]),
         [det("dog", 0.8), det("dog", 0.7)], False, ["include[0]"], {"max_overlap": 0.5},
         says="found 1"),
    # IoU with inclusive pixels: [0,0,9,9] and [5,0,14,9] are 10x10 = 100 px each and
    # share 5x10 = 50, IoU = 50 / 150 = 1/3: dropped when max_overlap = 1/3 (IoU >= it),
    Case("NMS edge at the IoU", ("two_object", [{"class": "dog", "count": 2}]),
         [det("dog", 0.8, (0, 0, 9, 9)), det("dog", 0.7, (5, 0, 14, 9))], False, ["include[0]"],
         {"max_overlap": 1 / 3}),
    # kept when max_overlap is just above 1/3.
    Case("NMS edge above the IoU", ("two_object", [{"class": "dog", "count": 2}]),
         [det("dog", 0.8, (0, 0, 9, 9)), det("dog", 0.7, (5, 0, 14, 9))], True,
         thresholds={"max_overlap": 0.34}),
    # --- counting: kept above 0.9; include dog >= 3 and exclude dog >= 4 ---
    Case("count 3 of 3", THREE_DOGS, [det("dog", 0.95)] * 3, True),
    # 0.9 is not above 0.9: two dogs kept, the include fails.
    Case("count one at 0.9", THREE_DOGS, [det("dog", 0.95)] * 2 + [det("dog", 0.9)], False,
         ["include[0]"], says="expected dog>=3, found 2"),
    Case("count one just above 0.9", THREE_DOGS, [det("dog", 0.95)] * 2 + [det("dog", 0.9001)],
         True),
    Case("count one just below 0.9", THREE_DOGS, [det("dog", 0.95)] * 2 + [det("dog", 0.8999)],
         False, ["include[0]"]),
    # The 0.5 dog counts for no clause under the counting cut (0.3 is for other tags):
    Case("count ignores a 0.5 fourth", THREE_DOGS, [det("dog", 0.95)] * 3 + [det("dog", 0.5)],
         True),
    # but with counting_threshold 0.4 it is kept: 4 dogs, exclude dog < 4 fails.
    Case("counting_threshold knob", THREE_DOGS, [det("dog", 0.95)] * 3 + [det("dog", 0.5)],
         False, ["exclude[0]"], {"counting_threshold": 0.4}, says="expected dog<4, found 4"),
    # Four confident dogs: the include holds (>= 3), the exclude fails (4 is not < 4).
    Case("count 4 of 3", THREE_DOGS, [det("dog", 0.95)] * 4, False, ["exclude[0]"]),
    # Two dogs: include fails; exclude holds (2 < 4).
    Case("count 2 of 3", THREE_DOGS, [det("dog", 0.95)] * 2, False, ["include[0]"]),
    # --- the 16-per-class cap: at most 16 kept, so an exclude of 17 can never fail ---
    Case("cap at 16", ("counting", [{"class": "dog", "count": 16}], [{"class": "dog", "count": 17}]),
         [det("dog", 0.95)] * 20, True),
    # max_objects 15: 15 kept, the include of 16 fails (found 15).
    Case("max_objects knob", ("counting", [{"class": "dog", "count": 16}]),
         [det("dog", 0.95)] * 20, False, ["include[0]"], {"max_objects": 15}, says="found 15"),
    # --- exclude on any tag: kept detections of the class, counted ---
    Case("exclude fires", ("two_object", [DOG], [{"class": "cat", "count": 1}]),
         [det("dog", 0.5), det("cat", 0.4)], False, ["exclude[0]"], says="expected cat<1, found 1"),
    # The 0.2 cat is not kept, so it is not counted by the exclude.
    Case("exclude ignores unkept", ("two_object", [DOG], [{"class": "cat", "count": 1}]),
         [det("dog", 0.5), det("cat", 0.2)], True),
    # Include and exclude failing together: both lines, includes first.
    Case("include and exclude fail", ("two_object", [DOG], [{"class": "cat", "count": 2}]),
         [det("cat", 0.5), det("cat", 0.5)], False, ["include[0]", "exclude[0]"]),
    # --- colors: the colour of the `count` most confident objects ---
    # Top dog red (0.9); the blue 0.8 dog is beyond count 1 and not looked at.
    Case("colour on the top object", ("colors", [{"class": "dog", "count": 1, "color": "red"}]),
         [det("dog", 0.8, colour="blue"), det("dog", 0.9, colour="red")], True),
    # Top dog blue: fails even though a red dog (0.8) is kept.
    Case("colour top is wrong", ("colors", [{"class": "dog", "count": 1, "color": "red"}]),
         [det("dog", 0.9, colour="blue"), det("dog", 0.8, colour="red")], False, ["include[0]"],
         says="found 0 red"),
    # Count 2: the two most confident must both be red; a blue third does not matter,
    Case("colour count 2 ok", ("colors", [{"class": "dog", "count": 2, "color": "red"}]),
         [det("dog", 0.9, colour="red"), det("dog", 0.7, colour="red"),
          det("dog", 0.6, colour="blue")], True),
    # a blue second does.
    Case("colour count 2 wrong", ("colors", [{"class": "dog", "count": 2, "color": "red"}]),
         [det("dog", 0.9, colour="red"), det("dog", 0.7, colour="blue"),
          det("dog", 0.6, colour="red")], False, ["include[0]"], says="found 1 red"),
    # The red dog at 0.2 is not kept; the kept one is blue.
    Case("colour unkept red", ("colors", [{"class": "dog", "count": 1, "color": "red"}]),
         [det("dog", 0.2, colour="red"), det("dog", 0.5, colour="blue")], False, ["include[0]"]),
    # --- color_attr: two coloured include clauses ---
    Case("color_attr ok", ("color_attr", [{"class": "dog", "count": 1, "color": "red"},
                                          {"class": "cat", "count": 1, "color": "blue"}]),
         [det("dog", 0.5, colour="red"), det("cat", 0.5, colour="blue")], True),
    Case("color_attr swapped", ("color_attr", [{"class": "dog", "count": 1, "color": "red"},
                                               {"class": "cat", "count": 1, "color": "blue"}]),
         [det("dog", 0.5, colour="blue"), det("cat", 0.5, colour="red")], False,
         ["include[0]", "include[1]"]),
    # --- position: dog relative to the couch (include[0]); edges in the comment above ---
    Case("left of", left_of_couch(), [COUCH_DET, dog_off(-4.5, 0)], True),
    Case("right of", left_of_couch("right of"), [COUCH_DET, dog_off(4.5, 0)], True),
    Case("above", left_of_couch("above"), [COUCH_DET, dog_off(0, -4.5)], True),
    Case("below", left_of_couch("below"), [COUCH_DET, dog_off(0, 4.5)], True),
    # The opposite side is not the relation asked for.
    Case("left of, dog right", left_of_couch(), [COUCH_DET, dog_off(4.5, 0)], False,
         ["include[1]"], says="found right of"),
    Case("below, dog above", left_of_couch("below"), [COUCH_DET, dog_off(0, -4.5)], False,
         ["include[1]"], says="found above"),
    # o = -4: shrunk -2, -2 / 4 = -0.5 is not below -0.5: no relation.
    Case("left of at the edge", left_of_couch(), [COUCH_DET, dog_off(-4, 0)], False,
         ["include[1]"], says="found no relation"),
    Case("left of inside the edge", left_of_couch(), [COUCH_DET, dog_off(-3.5, 0)], False,
         ["include[1]"]),
    Case("above at the edge", left_of_couch("above"), [COUCH_DET, dog_off(0, -4)], False,
         ["include[1]"]),
    Case("above past the edge", left_of_couch("above"), [COUCH_DET, dog_off(0, -4.01)], True),
    # o = -2 is the margin: shrunk to 0, no relation; -1 even more so.
    Case("left of at the margin", left_of_couch(), [COUCH_DET, dog_off(-2, 0)], False,
         ["include[1]"]),
    Case("overlapping centres", left_of_couch("below"), [COUCH_DET, dog_off(0, 0)], False,
         ["include[1]"]),
    # Diagonal (-6, -6): shrunk (-4, -4) over |o| = 8.49 gives -0.47 on each axis: neither.
    Case("diagonal, no relation", left_of_couch(), [COUCH_DET, dog_off(-6, -6)], False,
         ["include[1]"]),
    # Diagonal (-10, -10): (-8, -8) / 14.14 = -0.57 on each axis: left of and above both hold.
    Case("diagonal, two relations", left_of_couch("above"), [COUCH_DET, dog_off(-10, -10)],
         True),
    Case("diagonal, two relations (left)", left_of_couch(), [COUCH_DET, dog_off(-10, -10)],
         True),
    # position_threshold 0.05: margin 1 px, a relation needs |o| > 2: -3.5 is left of.
    Case("position_threshold knob", left_of_couch(), [COUCH_DET, dog_off(-3.5, 0)], True,
         thresholds={"position_threshold": 0.05}),
    # direction_threshold 0.4: at o = -4 the ratio -0.5 is below -0.4: left of.
    Case("direction_threshold knob", left_of_couch(), [COUCH_DET, dog_off(-4, 0)], True,
         thresholds={"direction_threshold": 0.4}),
    # The couch not detected: include[0] fails and include[1] has no target.
    Case("no target", left_of_couch(), [dog_off(-10, 0)], False, ["include[0]", "include[1]"],
         says="no target for dog to be left of"),
    # Position judged on the most confident dog only (count 1): the 0.9 dog is left of,
    Case("position on the top dog", left_of_couch(),
         [COUCH_DET, dog_off(-10, 0, 0.9), dog_off(10, 0, 0.5)], True),
    # and when the top dog is right of, the clause fails whatever the other dog does.
    Case("position top dog wrong", left_of_couch(),
         [COUCH_DET, dog_off(10, 0, 0.9), dog_off(-10, 0, 0.5)], False, ["include[1]"]),
    # Count 2: every one of the two dogs must be left of the couch.
    Case("position count 2", left_of_couch(count=2),
         [COUCH_DET, dog_off(-10, 0, 0.9), dog_off(10, 0, 0.5)], False, ["include[1]"]),
    # A position clause on a coloured group whose colour fails: no position line, the
    # colour failure is the reason (position is judged only if the colour passed).
    Case("colour fails before position",
         ("position", [COUCH, {"class": "dog", "count": 1, "color": "red",
                               "position": ["left of", 0]}]),
         [COUCH_DET, dog_off(10, 0, colour="blue")], False, ["include[1]"], says="found 0 red"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_verdict_table(case: Case) -> None:
    verdict = judge(row(*case.spec), case.detections, SIZE, GenEvalThresholds(**case.thresholds))
    assert verdict.correct is case.correct, verdict.reason
    lines = verdict.reason.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == case.failed, verdict.reason
    assert (verdict.reason == "") is case.correct
    assert case.says in verdict.reason


def test_every_tag_and_relation_is_in_the_table() -> None:
    tags = {c.spec[0] for c in CASES}
    assert tags == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    relations = {i["position"][0] for c in CASES for i in c.spec[1] if "position" in i}
    assert relations == {"left of", "right of", "above", "below"}
    knobs = {k for c in CASES for k in c.thresholds}
    assert knobs == set(GenEvalThresholds.__dataclass_fields__)


def test_cap_keeps_the_most_confident() -> None:
    # 17 dogs above 0.3; the cap of 16 drops the least confident one (0.31), and the kept
    # ones come most confident first.
    scores = [0.31] + [0.4 + 0.01 * i for i in range(16)]
    verdict = judge(row("single_object", [DOG]), [det("dog", s) for s in scores], SIZE)
    kept = [d.score for d in verdict.detected["dog"]]
    assert kept == sorted(scores[1:], reverse=True)


def test_colour_needed_but_absent_is_an_error() -> None:
    with pytest.raises(ValueError, match="no colour"):
        judge(
            row("colors", [{"class": "dog", "count": 1, "color": "red"}]), [det("dog", 0.5)], SIZE
        )


def test_image_size_checks_boxes_and_masks() -> None:
    dog = row("single_object", [DOG])
    with pytest.raises(ValueError, match="outside the 200x200 image"):
        judge(dog, [det("dog", 0.5, (300, 300, 310, 310))], SIZE)
    wrong = Detection("dog", 0.5, (10, 10, 20, 20), mask=np.zeros((200, 100), bool))
    with pytest.raises(ValueError, match=r"mask shape \(200, 100\)"):
        judge(dog, [wrong], (200, 100))
    right = Detection("dog", 0.5, (10, 10, 20, 20), mask=np.zeros((100, 200), bool))
    assert judge(dog, [right], (200, 100)).correct


@pytest.mark.parametrize(
    "bad",
    [
        {"threshold": 1.0},
        {"counting_threshold": -0.1},
        {"max_objects": 0},
        {"max_objects": 2.0},
        {"max_overlap": 0.0},
        {"position_threshold": -0.1},
        {"direction_threshold": 1.0},
    ],
)
def test_thresholds_are_checked(bad: dict) -> None:
    with pytest.raises(ValueError, match=f"GenEvalThresholds.{next(iter(bad))}"):
        GenEvalThresholds(**bad)


def test_detection_is_checked() -> None:
    with pytest.raises(ValueError, match="x1<=x2"):
        Detection("dog", 0.5, (20, 10, 10, 20))
    with pytest.raises(ValueError, match="not finite"):
        Detection("dog", float("nan"), (0, 0, 1, 1))
    with pytest.raises(ValueError, match="colour 'teal'"):
        Detection("dog", 0.5, (0, 0, 1, 1), colour="teal")


# --- metadata ---

GOOD = {"tag": "two_object", "include": [DOG, CAT], "prompt": "a photo of a dog and a cat"}


def _with(**changes) -> str:
    obj = json.loads(json.dumps(GOOD))
    obj.update(changes)
    return json.dumps(obj)


def _clause(i: int, **changes) -> str:
    obj = json.loads(json.dumps(GOOD))
    obj["include"][i].update(changes)
    return json.dumps(obj)


BAD_ROWS = [
    # (bad line, the field the message must name, a phrase it must hold)
    (_with(tag="counting_objects"), "tag", "expected one of"),
    (_clause(0, count=0), "include[0].count", "got 0"),
    (_clause(0, count=-2), "include[0].count", "got -2"),
    (_clause(0, count=1.5), "include[0].count", "got 1.5"),
    (_clause(0, count=True), "include[0].count", "got true"),
    (_clause(0, count="2"), "include[0].count", 'got "2"'),
    (_clause(1, position=["left of", 1]), "include[1].position", "names this group"),
    (_clause(1, position=["left of", 2]), "include[1].position", "names a later group"),
    (_clause(1, position=["left of", -1]), "include[1].position", "names no group"),
    (_clause(0, position=["left of", 0]), "include[0].position", "this is the first group"),
    (_clause(1, position=["left of", "0"]), "include[1].position", "index"),
    (_clause(1, position=["next to", 0]), "include[1].position", "relation"),
    (_clause(1, position="left of"), "include[1].position", "expected [relation, index]"),
    (_clause(0, **{"class": "unicorn"}), "include[0].class", "not a class the detector knows"),
    (_with(exclude=[{"class": "unicorn", "count": 1}]), "exclude[0].class", "not a class"),
    (_clause(0, color="teal"), "include[0].color", "expected one of red"),
    ('{"tag": "two_object", "include": [', "row", "not valid JSON"),
    (json.dumps({"tag": "two_object", "include": [DOG]}), "prompt", "missing"),
    (json.dumps({"prompt": "p", "include": [DOG]}), "tag", "missing"),
    (json.dumps({"tag": "two_object", "prompt": "p"}), "include", "missing"),
    (_with(include=[]), "include", "non-empty list"),
    (_with(include=[{"class": "dog"}]), "include[0].count", "missing"),
    (_with(exclude=[{"count": 1}]), "exclude[0].class", "missing"),
    (_with(exclude=[{"class": "dog", "count": 0}]), "exclude[0].count", "got 0"),
    (_with(exclude={"class": "dog", "count": 1}), "exclude", "expected a list"),
    (_with(seed=3), "seed", "unknown field"),
    (_clause(0, colour="red"), "include[0].colour", "unknown field"),
    (_with(exclude=[{"class": "dog", "count": 1, "color": "red"}]), "exclude[0].color", "unknown"),
    (json.dumps([GOOD]), "row", "expected a JSON object"),
]


@pytest.mark.parametrize(
    "line,field,phrase", BAD_ROWS, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_ROWS)]
)
def test_bad_metadata_names_file_line_and_field(tmp_path: Path, line, field, phrase) -> None:
    path = tmp_path / "meta.jsonl"
    # The bad row is line 3: a good row, a blank line (skipped, still counted), the bad one.
    path.write_text(json.dumps(GOOD) + "\n\n" + line + "\n")
    with pytest.raises(MetadataError) as info:
        read_metadata(path, COCO_CLASSES)
    message = str(info.value)
    assert isinstance(info.value, DatasetError)  # the CLI's exit-2 error
    assert "\n" not in message
    assert message.startswith(f"{path}:3: {field}: "), message
    assert phrase in message, message


def test_metadata_reads_geneval_rows(tmp_path: Path) -> None:
    lines = [
        '{"tag": "counting", "include": [{"class": "bus", "count": 3}], "exclude": '
        '[{"class": "bus", "count": 4}], "prompt": "a photo of three buses"}',
        '{"tag": "position", "include": [{"class": "skateboard", "count": 1}, {"class": '
        '"bird", "count": 1, "position": ["below", 0]}], "prompt": "a photo of a bird below '
        'a skateboard"}',
        '{"tag": "color_attr", "include": [{"class": "dog", "count": 1, "color": "white"}, '
        '{"class": "potted plant", "count": 1, "color": "blue"}], "prompt": "a photo of a '
        'white dog and a blue potted plant"}',
    ]
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = read_metadata(path, COCO_CLASSES)
    assert [r.tag for r in rows] == ["counting", "position", "color_attr"]
    assert rows[0].exclude[0].count == 4 and rows[1].include[1].position == ("below", 0)
    assert rows[2].include[1].colour == "blue" and rows[2].source == f"{path}:3"
    # GenEval's `metadata` field is json.dumps of the row as read: the line itself here.
    assert [r.dumps() for r in rows] == lines
    # Without a vocabulary any class is accepted; with one, "unicorn" is refused.
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"tag": "single_object", "prompt": "p", "include": [
        {"class": "unicorn", "count": 1}]}))  # fmt: skip
    assert read_metadata(other)[0].include[0].cls == "unicorn"
    with pytest.raises(MetadataError, match=r"other.jsonl:1: include\[0\].class"):
        read_metadata(other, COCO_CLASSES)


# --- summary ---


def _record(tag: str, prompt: int, correct: bool) -> dict:
    return {"tag": tag, "correct": correct, "metadata": json.dumps({"tag": tag, "p": prompt})}


# 9 images: single_object 2 of 3 correct, counting 0 of 2, position 1 of 4.
# Prompts: s0 (ok, no), s1 (ok); c0 (no, no); p0 (no, no), p1 (ok, no): 3 of 5 prompts
# have a correct image.
RECORDS = [
    _record("single_object", 0, True),
    _record("single_object", 0, False),
    _record("counting", 0, False),
    _record("single_object", 1, True),
    _record("counting", 0, False),
    _record("position", 0, False),
    _record("position", 0, False),
    _record("position", 1, True),
    _record("position", 1, False),
]


def test_summary_figures_by_hand() -> None:
    s = summarise(RECORDS)
    assert (s.images, s.prompts) == (9, 5)
    # one division of two counts each: correctly rounded, so exactly Python's 3 / 9
    assert s.correct_images == 3 / 9
    assert s.correct_prompts == 3 / 5
    assert [(t.tag, t.correct, t.images) for t in s.tags] == [
        ("single_object", 2, 3),
        ("counting", 0, 2),
        ("position", 1, 4),
    ]
    # overall = mean of the tag accuracies = (2/3 + 0 + 1/4) / 3 = 11/36, not 3/9.
    # float64: three accuracies (one rounding each) summed and divided by 3, against the
    # bound: exact 11/36 rounded once: at most 6 roundings of values <= 1, 6 * 2**-53
    assert s.overall == pytest.approx(11 / 36, abs=6 * 2**-53)
    assert s.table() == (
        "Summary\n"
        "=======\n"
        "Total images: 9\n"
        "Total prompts: 5\n"
        "% correct images: 33.33%\n"
        "% correct prompts: 60.00%\n"
        "\n"
        "Task breakdown\n"
        "==============\n"
        "single_object    = 66.67% (2 / 3)\n"
        "counting         = 0.00% (0 / 2)\n"
        "position         = 25.00% (1 / 4)\n"
        "\n"
        "Overall score (avg. over tasks): 0.30556\n"
    )
    assert s.to_dict()["counts"]["position"] == [1, 4]


def test_results_round_trip_in_genevals_format(tmp_path: Path) -> None:
    couch_dog = row(*left_of_couch())
    good = judge(couch_dog, [COUCH_DET, dog_off(-10, 0, 0.75)], SIZE)
    bad = judge(couch_dog, [dog_off(-10, 0, 0.75)], SIZE)
    records = [
        result_record("out/00000/samples/0000.png", couch_dog, good),
        result_record("out/00000/samples/0001.png", couch_dog, bad),
    ]
    path = write_results(tmp_path / "results.jsonl", records)
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first) == ["filename", "tag", "prompt", "correct", "reason", "metadata", "details"]
    # details: per class, [x1, y1, x2, y2, score] of the kept boxes.
    assert json.loads(first["details"]) == {
        "couch": [[95.0, 95.0, 105.0, 105.0, 0.8]],
        "dog": [[85.0, 95.0, 95.0, 105.0, 0.75]],
    }
    back = read_results(path)
    assert [r["correct"] for r in back] == [True, False]
    s = summarise(back)
    assert (s.images, s.prompts, s.overall, s.correct_prompts) == (2, 1, 0.5, 1.0)
    (tmp_path / "broken.jsonl").write_text(json.dumps(first) + "\n" + '{"tag": "x"}\n')
    with pytest.raises(DatasetError, match=r"broken.jsonl:2: correct: missing"):
        read_results(tmp_path / "broken.jsonl")


# --- the folder reader ---


def _png(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(path)


def _prompt_folder(root: Path, index: str, meta: dict) -> Path:
    folder = root / index
    (folder / "samples").mkdir(parents=True)
    (folder / "metadata.jsonl").write_text(json.dumps(meta))
    return folder


def test_folder_counts_and_names_missing_and_unreadable(tmp_path: Path) -> None:
    a = _prompt_folder(tmp_path, "00000", GOOD)
    for n in (0, 1, 3):  # 0002 missing (a gap)
        _png(a / "samples" / f"{n:04d}.png")
    _png(a / "grid.png")  # not a sample: ignored
    b = _prompt_folder(tmp_path, "00001", GOOD | {"tag": "single_object", "include": [DOG]})
    _png(b / "samples" / "0000.png")
    (b / "samples" / "0001.png").write_bytes(b"not a png")  # unreadable
    (b / "samples" / "0002.png").write_bytes(b"")  # unreadable (empty)
    png = (b / "samples" / "0000.png").read_bytes()
    (b / "samples" / "0003.png").write_bytes(png[: len(png) // 2])  # truncated: unreadable
    (tmp_path / "notes").mkdir()  # not a prompt folder: ignored

    found = read_folder(tmp_path, COCO_CLASSES)
    # Numbers expected per prompt: 0..highest found (a: 0-3, b: 0-3).
    assert found.prompts == 2
    assert [(s.index, s.number) for s in found.samples] == [("00000", 0), ("00000", 1),
                                                            ("00000", 3), ("00001", 0)]  # fmt: skip
    assert found.samples[3].row.tag == "single_object"
    assert (found.missing, found.unreadable, found.count("unexpected")) == (1, 3, 0)
    named = {(p.kind, p.path.relative_to(tmp_path).as_posix()) for p in found.problems}
    assert named == {
        ("missing", "00000/samples/0002.png"),
        ("unreadable", "00001/samples/0001.png"),
        ("unreadable", "00001/samples/0002.png"),
        ("unreadable", "00001/samples/0003.png"),
    }

    # With 5 images per prompt 0004 is missing in both; an extra 0005 is unexpected, as is
    # a second file numbered 0.
    _png(a / "samples" / "0005.png")
    _png(a / "samples" / "0.png")
    found = read_folder(tmp_path, COCO_CLASSES, images_per_prompt=5)
    assert (found.missing, found.unreadable, found.count("unexpected")) == (3, 3, 2)
    assert "00000/samples/0004.png: missing" in "\n".join(str(p) for p in found.problems)


def test_folder_with_no_samples_counts_one_missing(tmp_path: Path) -> None:
    _prompt_folder(tmp_path, "00000", GOOD)
    found = read_folder(tmp_path)
    assert (len(found.samples), found.missing) == (0, 1)


def test_folder_bad_metadata_names_file_and_field(tmp_path: Path) -> None:
    folder = _prompt_folder(tmp_path, "00007", GOOD | {"tag": "shapes"})
    with pytest.raises(
        MetadataError, match="^" + re.escape(f"{folder / 'metadata.jsonl'}:1: tag: ")
    ):
        read_folder(tmp_path)
    (folder / "metadata.jsonl").write_text("\n\n" + json.dumps(GOOD | {"seed": 1}, indent=1))
    with pytest.raises(MetadataError, match=r"metadata.jsonl:3: seed: unknown field"):
        read_folder(tmp_path)
    (folder / "metadata.jsonl").unlink()
    with pytest.raises(MetadataError, match=r"metadata.jsonl: not found"):
        read_folder(tmp_path)
    with pytest.raises(MetadataError, match="holds no prompt folders"):
        read_folder(tmp_path / "00007")
