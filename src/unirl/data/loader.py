"""Chat datasets from JSONL or parquet files with image paths, read into `Sample`s.

One row (one JSON object per line, or one parquet row):

    {"id": "q1",                                   # optional, default "<file stem>-<line>"
     "messages": [{"role": "user" | "assistant" | "system",
                   "content": [{"type": "text", "text": "..."},
                               {"type": "image", "path": "images/q1.png"}]}],
                   # content may also be a plain string (one text part)
     "answer": "7", "task": "t2i", "meta": {...}}  # optional

Image paths are relative to the dataset file (absolute paths are kept). Images are read
with PIL, converted to grayscale and to float32 in [0, 1] (value / 255), and must be
exactly `image_size` = (height, width) pixels. Each message's content items become
parts, in order, with the message's role. A null optional field (id, answer, task,
meta, or the unused field of a content item) counts as absent, so parquet struct columns
can hold text and image items side by side. Unknown fields are errors.

Everything is checked before anything is returned: the first bad row raises one
`DatasetError` whose one-line message is "FILE:LINE: FIELD: what was expected, got what"
(LINE is the 1-based line for JSONL, the 1-based row for parquet). Blank JSONL lines are
skipped; a file with no rows is an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from unirl.core.sample import ROLES, ImagePart, Part, Sample, TextPart

ROW_FIELDS = ("id", "messages", "answer", "task", "meta")
MESSAGE_FIELDS = ("role", "content")
ITEM_FIELDS = {"text": ("type", "text"), "image": ("type", "path")}
SUFFIXES = (".jsonl", ".parquet")


class DatasetError(ValueError):
    """A dataset file or row is malformed; the message names the file, line and field."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _describe(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    kind = names.get(type(value), "a number" if isinstance(value, (int, float)) else None)
    kind = kind or f"a {type(value).__name__}"
    shown = repr(value)
    return f"{kind} {shown if len(shown) <= 40 else shown[:37] + '...'}"


@dataclass(frozen=True)
class _Row:
    file: str
    line: int

    def error(self, field: str, what: str) -> DatasetError:
        return DatasetError(_one_line(f"{self.file}:{self.line}: {field}: {what}"))

    def expect(self, field: str, value: Any, kind: type, what: str) -> Any:
        if not isinstance(value, kind):
            raise self.error(field, f"expected {what}, got {_describe(value)}")
        return value

    def known_keys(self, field: str, obj: dict, allowed: tuple[str, ...]) -> None:
        for key in obj:
            if key not in allowed:
                prefix = f"{field}." if field else ""
                raise self.error(
                    f"{prefix}{key}", f"unknown field; expected one of {', '.join(allowed)}"
                )


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 text ({_one_line(err)})") from None
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            yield line, json.loads(raw)
        except json.JSONDecodeError as err:
            raise DatasetError(
                f"{path}:{line}: invalid JSON ({err.msg} at column {err.colno})"
            ) from None


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(f"{path}: cannot read parquet ({_one_line(err)})") from None
    for k, row in enumerate(rows):
        yield k + 1, {key: v for key, v in row.items() if v is not None}


def _read_image(row: _Row, field: str, base: Path, rel: str, size: tuple[int, int]) -> np.ndarray:
    path = base / rel
    if not path.is_file():
        raise row.error(field, f"image file {rel!r} not found (looked for {path})")
    try:
        with Image.open(path) as image:
            gray = image.convert("L")
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise row.error(field, f"cannot read image {rel!r} ({err})") from None
    h, w = size
    if gray.size != (w, h):
        got_w, got_h = gray.size
        raise row.error(
            field, f"image {rel!r} is {got_h}x{got_w}; expected {h}x{w} pixels (height x width)"
        )
    return np.asarray(gray, dtype=np.float32) / np.float32(255.0)


def _content(
    row: _Row, field: str, content: Any, role: str, base: Path, size: tuple[int, int]
) -> list[Part]:
    if isinstance(content, str):
        return [TextPart(content, role)]
    row.expect(field, content, list, "a string or a non-empty array of content items")
    if not content:
        raise row.error(field, "expected a string or a non-empty array of content items, got []")
    parts: list[Part] = []
    for j, item in enumerate(content):
        at = f"{field}[{j}]"
        row.expect(at, item, dict, "an object {type, text|path}")
        kind = item.get("type")
        if kind not in ITEM_FIELDS:
            raise row.error(f"{at}.type", f"expected 'text' or 'image', got {_describe(kind)}")
        row.known_keys(at, {k: v for k, v in item.items() if v is not None}, ITEM_FIELDS[kind])
        if kind == "text":
            if "text" not in item:
                raise row.error(f"{at}.text", "missing; a text item needs a string 'text'")
            parts.append(TextPart(row.expect(f"{at}.text", item["text"], str, "a string"), role))
        else:
            if "path" not in item:
                raise row.error(f"{at}.path", "missing; an image item needs a string 'path'")
            rel = row.expect(f"{at}.path", item["path"], str, "a string (image file path)")
            parts.append(
                ImagePart(pixels=_read_image(row, f"{at}.path", base, rel, size), role=role)
            )
    return parts


def _sample(row: _Row, obj: Any, base: Path, size: tuple[int, int], stem: str) -> Sample:
    row.expect("row", obj, dict, "a JSON object")
    row.known_keys("", obj, ROW_FIELDS)
    if "messages" not in obj:
        raise row.error("messages", "missing; expected a non-empty array of messages")
    messages = row.expect("messages", obj["messages"], list, "a non-empty array of messages")
    if not messages:
        raise row.error("messages", "expected a non-empty array of messages, got []")
    parts: list[Part] = []
    for i, msg in enumerate(messages):
        at = f"messages[{i}]"
        row.expect(at, msg, dict, "an object {role, content}")
        row.known_keys(at, msg, MESSAGE_FIELDS)
        for key in MESSAGE_FIELDS:
            if msg.get(key) is None:
                raise row.error(f"{at}.{key}", "missing")
        role = msg["role"]
        if role not in ROLES:
            roles = ", ".join(repr(r) for r in ("user", "assistant", "system"))
            raise row.error(f"{at}.role", f"expected one of {roles}, got {_describe(role)}")
        parts += _content(row, f"{at}.content", msg["content"], role, base, size)
    sample_id = obj.get("id")
    if sample_id is None:
        sample_id = f"{stem}-{row.line}"
    row.expect("id", sample_id, str, "a string")
    if not sample_id or "/" in sample_id:
        raise row.error("id", f"expected a non-empty string without '/', got {sample_id!r}")
    answer = obj.get("answer")
    if answer is not None:
        row.expect("answer", answer, str, "a string")
    task = obj.get("task")
    if task is not None:
        row.expect("task", task, str, "a string")
    meta = obj.get("meta")
    if meta is not None:
        row.expect("meta", meta, dict, "an object")
    return Sample(id=sample_id, parts=parts, answer=answer, task=task, meta=dict(meta or {}))


def load_dataset(path: str | Path, image_size: tuple[int, int] = (8, 8)) -> list[Sample]:
    """All samples of a .jsonl or .parquet file (format in the module docstring).

    Raises `DatasetError` for a missing/unsupported/empty file or the first bad row;
    never returns a partial dataset.
    """
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"{path}: unsupported dataset file; expected {' or '.join(SUFFIXES)}")
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
    samples: list[Sample] = []
    seen: dict[str, int] = {}
    for line, obj in rows:
        row = _Row(str(path), line)
        sample = _sample(row, obj, path.parent, image_size, path.stem)
        if sample.id in seen:
            raise row.error(
                "id", f"duplicate id {sample.id!r} (first used on line {seen[sample.id]})"
            )
        seen[sample.id] = line
        samples.append(sample)
    if not samples:
        raise DatasetError(f"{path}: empty dataset; expected at least one row")
    return samples
