"""Chat datasets from JSONL or parquet files with image paths, read into `Sample`s.

One row (one JSON object per line, or one parquet row):

    {"id": "q1",                                   # optional, default "<file stem>-<line>"
     "messages": [{"role": "user" | "assistant" | "system",
                   "content": [{"type": "text", "text": "..."},
                               {"type": "image", "path": "images/q1.png"}]}],
                   # content may also be a plain string (one text part)
     "answer": "7", "task": "my_task", "split": "train", "meta": {...}}  # optional

`task` is any label (routes rows to reward plugins and metrics); a row without one gets
`default_task`. `split` ("train", "val" or "test") lets one file hold every split.
An assistant content item `{"type": "generate_image", "height": H, "width": W}` asks
for an image of H x W visual positions (height/width default to the model's grid) with
no target: a text-to-image prompt. Whether a row generates an image is read from its
assistant content (an image item or a generate_image item), never from its task.

`path` is a .jsonl or .parquet file, or a directory whose *.jsonl / *.parquet files
(sorted by name) are shards of one dataset; ids must be unique across shards. Parquet
written by Hugging Face `datasets` (`Dataset.to_parquet`) loads as is.

Image paths are relative to the file that names them (absolute paths are kept). Images
are read in colour (`uniweave.data.images.read_rgb`, float32 RGB [H, W, 3] in [0, 1]) and
handed to `processor` (the model's: greyscale 8x8 for tiny, RGB for Janus-Pro), which
checks or resizes their size; without a processor they stay RGB at their own size. Each
message's content items become parts, in order, with the message's role. A null
optional field (id, answer, task, split, meta, or the unused field of a content item)
counts as absent, so parquet struct columns can hold text and image items side by side.
Unknown fields are errors.

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
from PIL import UnidentifiedImageError

from uniweave.core.sample import (
    ROLES,
    GenerationRequest,
    ImagePart,
    Part,
    Role,
    Sample,
    TextPart,
)
from uniweave.data.errors import DatasetError
from uniweave.data.images import GreyscaleProcessor, ImageProcessor, log_summary, read_rgb

ROW_FIELDS = ("id", "messages", "answer", "task", "split", "meta")
MESSAGE_FIELDS = ("role", "content")
ITEM_FIELDS = {
    "text": ("type", "text"),
    "image": ("type", "path"),
    "generate_image": ("type", "height", "width"),
}
SUFFIXES = (".jsonl", ".parquet")
SPLITS = ("train", "val", "test")


def _one_line(text: object) -> str:
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


@dataclass
class _Images:
    """How a file's rows turn images into parts: the processor and the model's grid."""

    base: Path
    processor: ImageProcessor | None
    grid: tuple[int, int] | None

    def read(self, row: _Row, field: str, rel: str) -> np.ndarray:
        path = self.base / rel
        if not path.is_file():
            raise row.error(field, f"image file {rel!r} not found (looked for {path})")
        try:
            rgb = read_rgb(path)
        except (UnidentifiedImageError, OSError, ValueError) as err:
            raise row.error(field, f"cannot read image {rel!r} ({err})") from None
        if self.processor is None:
            return rgb
        try:
            return self.processor(rgb, rel)
        except ValueError as err:
            raise row.error(field, str(err)) from None

    def request(self, row: _Row, field: str, item: dict, role: str) -> GenerationRequest:
        if role != "assistant":
            raise row.error(f"{field}.type", "generate_image belongs in an assistant message")
        sides = []
        for key, default in zip(("height", "width"), self.grid or (None, None)):
            value = item.get(key, default)
            if value is None:
                raise row.error(f"{field}.{key}", "missing (no model grid to default to)")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise row.error(
                    f"{field}.{key}", f"expected a positive int, got {_describe(value)}"
                )
            sides.append(value)
        return GenerationRequest(sides[0], sides[1], role="assistant")


def _content(row: _Row, field: str, content: Any, role: Role, images: _Images) -> list[Part]:
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
            kinds = ", ".join(repr(k) for k in ITEM_FIELDS)
            raise row.error(f"{at}.type", f"expected one of {kinds}, got {_describe(kind)}")
        row.known_keys(at, {k: v for k, v in item.items() if v is not None}, ITEM_FIELDS[kind])
        if kind == "text":
            if "text" not in item:
                raise row.error(f"{at}.text", "missing; a text item needs a string 'text'")
            parts.append(TextPart(row.expect(f"{at}.text", item["text"], str, "a string"), role))
        elif kind == "generate_image":
            parts.append(images.request(row, at, item, role))
        else:
            if "path" not in item:
                raise row.error(f"{at}.path", "missing; an image item needs a string 'path'")
            rel = row.expect(f"{at}.path", item["path"], str, "a string (image file path)")
            parts.append(ImagePart(pixels=images.read(row, f"{at}.path", rel), role=role))
    return parts


def _sample(row: _Row, obj: Any, images: _Images, stem: str, default_task: str | None) -> Sample:
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
        parts += _content(row, f"{at}.content", msg["content"], role, images)
    sample_id = obj.get("id")
    if sample_id is None:
        sample_id = f"{stem}-{row.line}"
    row.expect("id", sample_id, str, "a string")
    if not sample_id or "/" in sample_id:
        raise row.error("id", f"expected a non-empty string without '/', got {sample_id!r}")
    answer = obj.get("answer")
    if answer is not None:
        row.expect("answer", answer, str, "a string")
    task = obj.get("task", default_task)
    if task is not None:
        row.expect("task", task, str, "a string")
    split = obj.get("split")
    if split is not None and split not in SPLITS:
        raise row.error("split", f"expected one of {', '.join(SPLITS)}, got {_describe(split)}")
    meta = obj.get("meta")
    if meta is not None:
        row.expect("meta", meta, dict, "an object")
    return Sample(id=sample_id, parts=parts, answer=answer, task=task, meta=dict(meta or {}))


@dataclass
class Rows:
    """Loaded samples with where each came from ("FILE:LINE") and its split field."""

    samples: list[Sample]
    where: dict[str, str]
    splits: dict[str, str | None]

    def select(self, keep: list[bool]) -> Rows:
        samples = [s for s, k in zip(self.samples, keep) if k]
        ids = {s.id for s in samples}
        return Rows(
            samples,
            {i: w for i, w in self.where.items() if i in ids},
            {i: v for i, v in self.splits.items() if i in ids},
        )


def dataset_files(path: str | Path) -> list[Path]:
    """The files of a dataset: the file itself, or a directory's *.jsonl/*.parquet shards."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise DatasetError(f"{path}: directory holds no {' or '.join(SUFFIXES)} files")
        return files
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"{path}: unsupported dataset file; expected {' or '.join(SUFFIXES)}")
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    return [path]


def load_rows(
    path: str | Path,
    processor: ImageProcessor | None = None,
    image_grid: tuple[int, int] | None = None,
    default_task: str | None = None,
) -> Rows:
    """Every row of a dataset file or directory of shards (module docstring).

    Raises `DatasetError` for a missing/unsupported/empty dataset or the first bad row;
    never returns a partial dataset. Logs the processor's conversion counts.
    """
    samples: list[Sample] = []
    where: dict[str, str] = {}
    splits: dict[str, str | None] = {}
    before = processor.counts() if processor is not None else None
    for file in dataset_files(path):
        rows = _jsonl_rows(file) if file.suffix == ".jsonl" else _parquet_rows(file)
        images = _Images(file.parent, processor, image_grid)
        for line, obj in rows:
            row = _Row(str(file), line)
            sample = _sample(row, obj, images, file.stem, default_task)
            if sample.id in where:
                raise row.error("id", f"duplicate id {sample.id!r} (first at {where[sample.id]})")
            where[sample.id] = f"{file}:{line}"
            splits[sample.id] = obj.get("split")
            samples.append(sample)
    if not samples:
        raise DatasetError(f"{path}: empty dataset; expected at least one row")
    if processor is not None:
        log_summary(processor, str(path), before)
    return Rows(samples, where, splits)


def load_dataset(
    path: str | Path,
    image_size: tuple[int, int] | None = None,
    processor: ImageProcessor | None = None,
) -> list[Sample]:
    """The samples of `load_rows(path, processor)`. `image_size` is shorthand for the
    tiny model's processor `GreyscaleProcessor(image_size, resize="error")`."""
    if image_size is not None:
        if processor is not None:
            raise ValueError("give image_size or processor, not both")
        processor = GreyscaleProcessor((int(image_size[0]), int(image_size[1])))
    return load_rows(path, processor).samples
