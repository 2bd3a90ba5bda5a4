"""GenEval metadata: the rows that say what an image must show, read and checked strictly.

A row (one line of GenEval's `evaluation_metadata.jsonl`, or the one object of a prompt
folder's `<index>/metadata.jsonl`) is

    {"tag": ..., "prompt": ...,
     "include": [{"class": ..., "count": ..., "color"?: ..., "position"?: [relation, index]}],
     "exclude"?: [{"class": ..., "count": ...}]}

- `tag` is one of `TAGS`; the score is averaged per tag (`uniweave.eval.geneval.summary`).
- `include` (at least one clause) lists object groups that must all be present: `count`
  (an int >= 1) objects of `class`, optionally all of colour `color` (one of `COLOURS`)
  and optionally all in `relation` (one of `RELATIONS`) to every object of the earlier
  include group number `index` (0-based; it must name a group before this one).
- `exclude` (optional) lists classes of which fewer than `count` (an int >= 1) objects may
  be detected; GenEval's counting rows use it to cap the count ("three buses" includes
  bus >= 3 and excludes bus >= 4).
- `class` must be a class the detector knows when a vocabulary is given (GenEval's is
  `COCO_CLASSES`, its `object_names.txt`).

No other key is accepted anywhere. A row that breaks any of this raises `MetadataError`
(a `DatasetError`, so the command line exits 2) whose one-line message is
`FILE:LINE: FIELD: what was expected, got what`, e.g.
`prompts.jsonl:7: include[1].position: index 1 names this group; it must name an earlier
include group (0..0)`. Reading stops at the first bad row, before anything is generated or
scored. Blank lines are skipped.

`MetadataRow.raw` keeps the row exactly as read (key order included): GenEval writes
`json.dumps(row)` into every result and groups images into prompts by that string.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uniweave.data.errors import DatasetError

TAGS: tuple[str, ...] = (
    "single_object",
    "two_object",
    "counting",
    "colors",
    "position",
    "color_attr",
)
"""GenEval's six tasks, in the order of its published tables."""

RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
"""The position relations GenEval can call (`uniweave.eval.geneval.rules.relative_position`)."""

COLOURS: tuple[str, ...] = (
    "red",
    "orange",
    "yellow",
    "green",
    "blue",
    "purple",
    "pink",
    "brown",
    "black",
    "white",
)
"""GenEval's ten colour names, in its classifier's order."""

COCO_CLASSES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat",
    "dog", "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack",
    "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball",
    "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket",
    "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair",
    "couch", "potted plant", "bed", "dining table", "toilet", "tv", "laptop",
    "computer mouse", "tv remote", "computer keyboard", "cell phone", "microwave", "oven",
    "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear",
    "hair drier", "toothbrush",
)  # fmt: skip
"""The 80 COCO class names as GenEval spells them (its `object_names.txt`), detector order."""

_ROW_KEYS = ("tag", "prompt", "include", "exclude")
_ROW_REQUIRED = ("tag", "prompt", "include")
_INCLUDE_KEYS = ("class", "count", "color", "position")
_EXCLUDE_KEYS = ("class", "count")


class MetadataError(DatasetError):
    """A GenEval metadata file or row that cannot be used; `str()` is
    `FILE:LINE: FIELD: what was expected, got what`."""


@dataclass(frozen=True)
class Include:
    """An include clause: at least `count` objects of `cls`, all of `colour` when set,
    all in `position[0]` to every object of include group `position[1]` when set."""

    cls: str
    count: int
    colour: str | None = None
    position: tuple[str, int] | None = None


@dataclass(frozen=True)
class Exclude:
    """An exclude clause: fewer than `count` objects of `cls`."""

    cls: str
    count: int


@dataclass(frozen=True)
class MetadataRow:
    """One checked metadata row; `raw` is the row as read, `source` its `FILE:LINE`."""

    tag: str
    prompt: str
    include: tuple[Include, ...]
    exclude: tuple[Exclude, ...]
    raw: Mapping[str, Any]
    source: str

    def dumps(self) -> str:
        """The row as GenEval writes it into a result (`json.dumps` of the row as read)."""
        return json.dumps(self.raw)


def _fail(where: str, field: str, message: str) -> MetadataError:
    return MetadataError(f"{where}: {field}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _keys(obj: Any, where: str, field: str, allowed: tuple[str, ...], required: tuple[str, ...]):
    if not isinstance(obj, dict):
        raise _fail(where, field, f"expected a JSON object, got {type(obj).__name__}")
    for key in obj:
        if key not in allowed:
            name = f"{field}.{key}" if field != "row" else key
            raise _fail(where, name, f"unknown field; expected one of {', '.join(allowed)}")
    for key in required:
        if key not in obj:
            name = f"{field}.{key}" if field != "row" else key
            raise _fail(where, name, "missing")


def _count(value: Any, where: str, field: str) -> int:
    if not _is_int(value) or value < 1:
        raise _fail(where, field, f"expected an integer >= 1, got {json.dumps(value)}")
    return value


def _cls(value: Any, where: str, field: str, classes: Collection[str] | None) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where, field, f"expected a class name, got {json.dumps(value)}")
    if classes is not None and value not in classes:
        raise _fail(where, field, f"{value!r} is not a class the detector knows")
    return value


def parse_row(obj: Any, where: str, classes: Collection[str] | None = None) -> MetadataRow:
    """Check one decoded row (module docstring); `where` is its `FILE:LINE` for errors,
    `classes` the detector's class names (None: any class name is accepted)."""
    _keys(obj, where, "row", _ROW_KEYS, _ROW_REQUIRED)
    tag = obj["tag"]
    if tag not in TAGS:
        raise _fail(where, "tag", f"expected one of {', '.join(TAGS)}, got {json.dumps(tag)}")
    prompt = obj["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise _fail(where, "prompt", f"expected a non-empty string, got {json.dumps(prompt)}")
    groups = obj["include"]
    if not isinstance(groups, list) or not groups:
        raise _fail(where, "include", f"expected a non-empty list, got {json.dumps(groups)}")
    include = []
    for i, clause in enumerate(groups):
        field = f"include[{i}]"
        _keys(clause, where, field, _INCLUDE_KEYS, ("class", "count"))
        cls = _cls(clause["class"], where, f"{field}.class", classes)
        count = _count(clause["count"], where, f"{field}.count")
        colour = clause.get("color")
        if "color" in clause and colour not in COLOURS:
            raise _fail(
                where,
                f"{field}.color",
                f"expected one of {', '.join(COLOURS)}, got {json.dumps(colour)}",
            )
        position = None
        if "position" in clause:
            position = _position(clause["position"], i, where, f"{field}.position")
        include.append(Include(cls, count, colour, position))
    clauses = obj.get("exclude", [])
    if not isinstance(clauses, list):
        raise _fail(where, "exclude", f"expected a list, got {json.dumps(clauses)}")
    exclude = []
    for i, clause in enumerate(clauses):
        field = f"exclude[{i}]"
        _keys(clause, where, field, _EXCLUDE_KEYS, _EXCLUDE_KEYS)
        cls = _cls(clause["class"], where, f"{field}.class", classes)
        exclude.append(Exclude(cls, _count(clause["count"], where, f"{field}.count")))
    return MetadataRow(tag, prompt, tuple(include), tuple(exclude), obj, where)


def _position(value: Any, group: int, where: str, field: str) -> tuple[str, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise _fail(where, field, f"expected [relation, index], got {json.dumps(value)}")
    relation, index = value
    if relation not in RELATIONS:
        raise _fail(
            where,
            field,
            f"relation: expected one of {', '.join(RELATIONS)}, got {json.dumps(relation)}",
        )
    if not _is_int(index):
        raise _fail(where, field, f"index: expected an integer, got {json.dumps(index)}")
    if not 0 <= index < group:
        if index == group:
            what = "names this group"
        elif index > group:
            what = "names a later group"
        else:
            what = "names no group"
        allowed = f"0..{group - 1}" if group else "none: this is the first group"
        raise _fail(
            where,
            field,
            f"index {index} {what}; it must name an earlier include group ({allowed})",
        )
    return relation, index


def read_metadata(path: str | Path, classes: Collection[str] | None = None) -> list[MetadataRow]:
    """Every row of a GenEval metadata JSONL file, checked (module docstring); raises
    `MetadataError` naming `FILE:LINE` and the field at the first bad row."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MetadataError(f"{path}: not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise MetadataError(f"{path}: cannot read ({err})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise _fail(where, "row", f"not valid JSON ({err.msg}, column {err.colno})") from None
        rows.append(parse_row(obj, where, classes))
    if not rows:
        raise MetadataError(f"{path}: holds no metadata rows")
    return rows


def read_prompt_metadata(path: str | Path, classes: Collection[str] | None = None) -> MetadataRow:
    """The one row of a prompt folder's `<index>/metadata.jsonl` (GenEval reads it as one
    JSON object, which may span lines); errors name the line the object starts on."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MetadataError(f"{path}: not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise MetadataError(f"{path}: cannot read ({err})") from None
    stripped = text.lstrip()
    start = 1 + text[: len(text) - len(stripped)].count("\n")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        line = err.lineno if stripped else 1
        raise _fail(
            f"{path}:{line}", "row", f"not one JSON object ({err.msg}, column {err.colno})"
        ) from None
    return parse_row(obj, f"{path}:{start}", classes)
