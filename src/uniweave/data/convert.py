"""Public interleaved corpora (Zebra-CoT, ThinkMorph, aligned web documents) converted to
rows of the project's own format (`uniweave.data.loader`), streaming and resumable.

`convert(kind, src, out)` reads the parquet file `src` (or the *.parquet files of a
directory, sorted by name) one row group at a time, in batches of `batch_rows` rows, and
writes

    OUT/rows-00000.jsonl ...     the converted rows of source rows [k*S, (k+1)*S)
                                 (S = shard_rows): loader rows, one JSON object a line
    OUT/images/ab/<sha256>.EXT   every image once, named by the SHA-256 of its bytes
                                 (the source bytes as they are; EXT from its format)
    OUT/convert/state.json       what is being converted (kind, options, the source
                                 files' names, sizes and row counts)
    OUT/convert/shard-00000.json each shard's counts and rejects
    OUT/convert/rejects.jsonl    at the end: every source row that was not converted,
                                 {"index", "file", "row", "reason", "detail"}
    OUT/convert/summary.json     at the end: counts of rows, parts per type, images and
                                 rejects per reason

Row mapping (parts in order; an assistant part is a target, a user part an input):

- `zebra-cot`: user = `Question` with its inline `<image_start>[key]<image_end>`
  references replaced by those images (problem images no reference places come first);
  assistant = `Text Reasoning Trace` split the same way (reasoning images are target
  images; a problem image the trace refers to again is shown as a user part at that
  place, an input), then the final answer as text (`answer_format`). `answer` = `Final
  Answer`.
- `thinkmorph`: user = [`problem_image_0`, `question`]; assistant =
  [`resoning_thought_0`, `reasoning_image_0`, `resoning_thought_1`, final answer] (the
  corpus's spelling; `reasoning_thought_*` is read where `resoning_thought_*` is absent).
- `aligned` (OmniCorpus, MINT-1T): one assistant message of the document's `texts` and
  `images` in position order (every part a target). An image is a URL: it is read from
  `image_cache`, where the file of URL u is named sha256(u) in hex, with or without an
  extension; nothing is downloaded.

An image column holds `{bytes, path}` (or raw bytes); `path` is only a label. Text is
stripped; consecutive text parts of one role are joined with a newline. Row ids are
`<kind>-<index>` (index: 0-based over all source files in order); no field of a row
decides where a file is written.

A row that cannot be converted is a reject, counted by reason: `empty_question`,
`empty_trace`, `empty_answer`, `missing_image` (a null image or one the cache lacks),
`unknown_image_key` (an inline reference to a column the file does not have),
`malformed_image_reference`, `unreadable_image`, `malformed_document`,
`length_mismatch`, `malformed_position` (aligned: not exactly one of text / image),
`empty_document`. With `strict` the first reject is a `DatasetError` instead. A file
without a column the schema needs is a `DatasetError` before anything is written.

Resume: shard k is committed by renaming its rows file into place, after its new images
and its counts (shard-k.json) are on disk (fsynced). A killed conversion, run again with
the same arguments, removes the temporaries, keeps the committed shards and goes on
from the first uncommitted one (skipping whole row groups before it). Every output
file is a function of the source rows alone, so the result is byte-identical to an
uninterrupted run. OUT must be new, empty, or an unfinished (or finished) conversion of
the same source with the same options.

Importing this module is light (pyarrow and PIL are imported when converting).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from uniweave.data.errors import DatasetError

KINDS = ("zebra-cot", "thinkmorph", "aligned")
DEFAULT_TASKS = {"zebra-cot": "zebra_cot", "thinkmorph": "thinkmorph", "aligned": "aligned"}
ANSWER_FORMAT = "Final answer: {answer}"
META = "convert"
IMAGES = "images"
STATE_VERSION = 1
REF = re.compile(r"<image_start>\[([^\]]*)\]<image_end>")
ZEBRA_IMAGE = re.compile(r"(problem|reasoning)_image_\d+")
EXTENSIONS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp"}
CACHE_SUFFIXES = ("", ".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
PART_TYPES = ("user_text", "user_image", "assistant_text", "assistant_image")
REQUIRED = {
    "zebra-cot": (("Question",), ("Text Reasoning Trace",), ("Final Answer",)),
    "thinkmorph": (
        ("problem_image_0",),
        ("question",),
        ("resoning_thought_0", "reasoning_thought_0"),
        ("reasoning_image_0",),
        ("resoning_thought_1", "reasoning_thought_1"),
        ("answer",),
    ),
    "aligned": (("texts",), ("images",)),
}
"""Per kind: the columns a file must have (each tuple: accepted spellings, first wins)."""


class Reject(Exception):
    """A source row that cannot be converted: `reason` (a fixed word) and `detail`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Options:
    """What decides the output besides the source (recorded in state.json)."""

    kind: str
    shard_rows: int = 1000
    task: str | None = None
    answer_format: str = ANSWER_FORMAT
    image_cache: str | None = None

    def state(self) -> dict:
        return {
            "kind": self.kind,
            "shard_rows": self.shard_rows,
            "task": self.task or DEFAULT_TASKS[self.kind],
            "answer_format": self.answer_format,
            "image_cache": None if self.image_cache is None else str(Path(self.image_cache)),
        }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes, tmp_dir: Path) -> None:
    """Write `data` to tmp_dir, fsync, rename to `path` (torch-free: uniweave.core
    imports torch, and this command stays light)."""
    tmp = tmp_dir / f".{path.name}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, sort_keys=True, indent=1) + "\n").encode()


class ImageStore:
    """Images written once under OUT/images, named by the SHA-256 of their bytes."""

    def __init__(self, out: Path, tmp: Path) -> None:
        self.out = out
        self.tmp = tmp
        self.pending: list[Path] = []

    def name(self, data: bytes, label: str) -> str:
        """The path relative to OUT that `data` is written to; Reject("unreadable_image")
        when PIL cannot decode it. Writes nothing (a row is written whole or not at all)."""
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as image:
                fmt = image.format or "IMAGE"
                image.load()
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
            # no object addresses ("<_io.BytesIO object at 0x...>"): output is reproducible
            message = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the bytes", " ".join(str(err).split()))
            raise Reject("unreadable_image", f"{label}: {message}") from None
        digest = hashlib.sha256(data).hexdigest()
        return f"{IMAGES}/{digest[:2]}/{digest}.{EXTENSIONS.get(fmt, fmt.lower())}"

    def write(self, rel: str, data: bytes) -> None:
        """Write `data` to OUT/rel unless it is there (then it holds these bytes)."""
        path = self.out / rel
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.tmp / f".{path.name}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, path)
            self.pending.append(path)

    def sync(self) -> None:
        """fsync the images written since the last call, and their folders."""
        for path in self.pending:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for folder in sorted({p.parent for p in self.pending}):
            _fsync_dir(folder)
        if self.pending:
            _fsync_dir(self.out / IMAGES)
        self.pending = []


def _image_bytes(value: Any, column: str) -> tuple[bytes, str]:
    """(bytes, label) of an image cell ({bytes, path} or raw bytes); Reject when null."""
    label = column
    if isinstance(value, dict):
        path = value.get("path")
        if path:
            label = f"{column} ({path!r})"
        value = value.get("bytes")
    if isinstance(value, (bytes, bytearray)) and value:
        return bytes(value), label
    raise Reject("missing_image", f"{label} has no image bytes")


@dataclass
class _Row:
    """Messages under construction: (role, item) pairs, grouped by role at the end."""

    store: ImageStore
    items: list[tuple[str, dict]] = field(default_factory=list)
    images: dict[str, bytes] = field(default_factory=dict)

    def text(self, role: str, text: str) -> None:
        text = text.strip()
        if not text:
            return
        if self.items and self.items[-1][0] == role and self.items[-1][1]["type"] == "text":
            self.items[-1][1]["text"] += "\n" + text
        else:
            self.items.append((role, {"type": "text", "text": text}))

    def image(self, role: str, data: bytes, label: str) -> None:
        rel = self.store.name(data, label)
        self.images[rel] = data
        self.items.append((role, {"type": "image", "path": rel}))

    def write_images(self) -> None:
        for rel, data in self.images.items():
            self.store.write(rel, data)

    def messages(self) -> list[dict]:
        out: list[dict] = []
        for role, item in self.items:
            if not out or out[-1]["role"] != role:
                out.append({"role": role, "content": []})
            out[-1]["content"].append(item)
        return out


def _text(row: dict, column: str, reason: str) -> str:
    value = row.get(column)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise Reject(reason, f"{column} is {'empty' if isinstance(value, str) else 'null'}")
    return value


def _pieces(text: str, column: str) -> list[tuple[str, str]]:
    """[("text", t) | ("ref", key)] of `text` split at its inline image references."""
    out: list[tuple[str, str]] = []
    at = 0
    for match in REF.finditer(text):
        out.append(("text", text[at : match.start()]))
        out.append(("ref", match.group(1)))
        at = match.end()
    out.append(("text", text[at:]))
    for kind, piece in out:
        if kind == "text" and ("<image_start>" in piece or "<image_end>" in piece):
            shown = piece[piece.find("<image_") :][:60]
            raise Reject("malformed_image_reference", f"{column}: {shown!r}")
    return out


def _zebra(row: dict, into: _Row, opts: Options) -> str:
    question = _text(row, "Question", "empty_question")
    trace = _text(row, "Text Reasoning Trace", "empty_trace")
    answer = _text(row, "Final Answer", "empty_answer").strip()
    columns = sorted(k for k in row if ZEBRA_IMAGE.fullmatch(k))
    q_pieces = _pieces(question, "Question")
    t_pieces = _pieces(trace, "Text Reasoning Trace")
    referenced = [p for k, p in q_pieces + t_pieces if k == "ref"]
    for key in referenced:
        if key not in columns:
            raise Reject("unknown_image_key", f"<image_start>[{key}]<image_end>: no such column")
    images: dict[str, tuple[bytes, str]] = {}
    for key in referenced:
        images[key] = _image_bytes(row[key], key)
    placed = set(referenced)
    for key in sorted(
        (k for k in columns if k.startswith("problem_") and k not in placed),
        key=lambda k: int(k.rsplit("_", 1)[1]),
    ):
        if row.get(key) is not None:  # an unplaced problem image: shown before the question
            into.image("user", *_image_bytes(row[key], key))
    for role, pieces in (("user", q_pieces), ("assistant", t_pieces)):
        for kind, piece in pieces:
            if kind == "text":
                into.text(role, piece)
            else:
                shown_as = "user" if piece.startswith("problem_") else role
                into.image(shown_as, *images[piece])
    if not any(role == "assistant" for role, _ in into.items):
        raise Reject("empty_trace", "Text Reasoning Trace has no text or image")
    into.text("assistant", opts.answer_format.format(answer=answer))
    return answer


def _column(row: dict, names: tuple[str, ...]) -> str:
    return next((n for n in names if n in row), names[0])


def _thinkmorph(row: dict, into: _Row, opts: Options) -> str:
    question = _text(row, "question", "empty_question")
    answer = _text(row, "answer", "empty_answer").strip()
    first = _column(row, REQUIRED["thinkmorph"][2])
    second = _column(row, REQUIRED["thinkmorph"][4])
    thoughts = [row.get(first), row.get(second)]
    if not any(isinstance(t, str) and t.strip() for t in thoughts):
        raise Reject("empty_trace", f"{first} and {second} are empty")
    problem = _image_bytes(row.get("problem_image_0"), "problem_image_0")
    reasoning = _image_bytes(row.get("reasoning_image_0"), "reasoning_image_0")
    into.image("user", *problem)
    into.text("user", question)
    into.text("assistant", thoughts[0] if isinstance(thoughts[0], str) else "")
    into.image("assistant", *reasoning)
    into.text("assistant", thoughts[1] if isinstance(thoughts[1], str) else "")
    into.text("assistant", opts.answer_format.format(answer=answer))
    return answer


def cache_file(cache: Path, url: str) -> Path | None:
    """The file of `url` in an image cache (module docstring), or None."""
    stem = hashlib.sha256(url.encode()).hexdigest()
    for suffix in CACHE_SUFFIXES:
        path = cache / f"{stem}{suffix}"
        if path.is_file():
            return path
    return None


def _aligned(row: dict, into: _Row, opts: Options) -> None:
    texts, images = row.get("texts"), row.get("images")
    if not isinstance(texts, list) or not isinstance(images, list):
        raise Reject("malformed_document", "texts and images must be lists")
    if len(texts) != len(images):
        raise Reject("length_mismatch", f"{len(texts)} texts, {len(images)} images")
    if not texts:
        raise Reject("empty_document", "no positions")
    cache = Path(opts.image_cache or ".")
    for k, (text, url) in enumerate(zip(texts, images)):
        if (text is None) == (url is None) or not isinstance(text or url, str):
            raise Reject("malformed_position", f"position {k}: needs exactly one text or URL")
        if text is not None:
            into.text("assistant", text)
            continue
        path = cache_file(cache, url)
        if path is None:
            raise Reject("missing_image", f"position {k}: {url[:200]!r} not in the image cache")
        into.image("assistant", path.read_bytes(), f"position {k} ({url[:200]!r})")
    if not into.items:
        raise Reject("empty_document", "only empty texts")
    return None


CONVERTERS: dict[str, Callable[[dict, _Row, Options], str | None]] = {
    "zebra-cot": _zebra,
    "thinkmorph": _thinkmorph,
    "aligned": _aligned,
}


def source_files(src: Path) -> list[Path]:
    """The parquet file `src`, or a directory's *.parquet files sorted by name."""
    if src.is_dir():
        files = sorted(p for p in src.iterdir() if p.suffix == ".parquet" and p.is_file())
        if not files:
            raise DatasetError(f"{src}: directory holds no .parquet files")
        return files
    if not src.is_file():
        raise DatasetError(f"{src}: not found")
    if src.suffix != ".parquet":
        raise DatasetError(f"{src}: expected a .parquet file or a directory of them")
    return [src]


def _open(files: list[Path], kind: str) -> list[tuple[Path, Any]]:
    """ParquetFile per file, each checked for the columns `kind` needs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    opened = []
    for path in files:
        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as err:
            detail = " ".join(str(err).split())
            raise DatasetError(f"{path}: cannot read parquet ({detail})") from None
        names = set(pf.schema_arrow.names)
        for spellings in REQUIRED[kind]:
            if not names & set(spellings):
                raise DatasetError(
                    f"{path}: no column {' or '.join(map(repr, spellings))}; a {kind} file "
                    f"has {', '.join(repr(s[0]) for s in REQUIRED[kind])} (columns: "
                    f"{', '.join(sorted(names))})"
                )
        opened.append((path, pf))
    return opened


def _rows_from(
    opened: list[tuple[Path, Any]], start: int, batch_rows: int
) -> Iterator[tuple[int, Path, int, dict]]:
    """(index, file, row in file, row) from global index `start` on, a batch at a time;
    row groups wholly before `start` are not read."""
    file_base = 0
    for path, pf in opened:
        meta = pf.metadata
        group_base = 0  # the first row of the group, counted in the file
        for group in range(meta.num_row_groups):
            n = meta.row_group(group).num_rows
            if file_base + group_base + n <= start:
                group_base += n
                continue
            row = group_base
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[group]):
                for record in batch.to_pylist():
                    if file_base + row >= start:
                        yield file_base + row, path, row, record
                    row += 1
            group_base += n
        file_base += meta.num_rows


@dataclass
class _Shard:
    """The shard being written: its rows' temporary file, counts and rejects."""

    index: int
    tmp: Path
    handle: Any
    rows: int = 0
    parts: Counter = field(default_factory=Counter)
    image_refs: int = 0
    rejects: list[dict] = field(default_factory=list)


def shard_name(k: int) -> str:
    return f"rows-{k:05d}.jsonl"


def _check_out(out: Path, state: dict) -> bool:
    """Whether `out` resumes a conversion (True) or starts one (False); DatasetError when
    it holds something else or a conversion of other inputs / options."""
    path = out / META / "state.json"
    if path.is_file():
        recorded = json.loads(path.read_text())
        if recorded != state:
            diff = sorted(k for k in set(state) | set(recorded) if state.get(k) != recorded.get(k))
            raise DatasetError(
                f"{out}: holds a conversion of other inputs or options ({', '.join(diff)} "
                "differ); choose a new output folder"
            )
        return True
    if out.exists() and not out.is_dir():
        raise DatasetError(f"{out}: exists and is not a folder")
    if out.is_dir():
        # a conversion killed while writing state.json leaves only its temporary
        left = [p for p in out.iterdir() if p.name != META]
        started = [p for p in (out / META).iterdir()] if (out / META).is_dir() else []
        if left or any(not p.name.startswith(".") for p in started if p.name != "tmp"):
            raise DatasetError(f"{out}: exists and is not empty (nor a conversion to resume)")
    return False


def convert(
    kind: str,
    src: str | Path,
    out: str | Path,
    *,
    strict: bool = False,
    shard_rows: int = 1000,
    batch_rows: int = 64,
    task: str | None = None,
    answer_format: str = ANSWER_FORMAT,
    image_cache: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Convert `src` into `out` (module docstring); the summary (also summary.json)."""
    if kind not in KINDS:
        raise DatasetError(f"unknown corpus {kind!r}; expected one of {', '.join(KINDS)}")
    if shard_rows < 1 or batch_rows < 1:
        raise ValueError("shard_rows and batch_rows must be >= 1")
    if kind == "aligned":
        if image_cache is None:
            raise DatasetError("aligned corpora name images by URL: give an image cache folder")
        if not Path(image_cache).is_dir():
            raise DatasetError(f"{image_cache}: image cache folder not found")
    try:
        answer_format.format(answer="x")
    except (KeyError, IndexError, ValueError) as err:
        raise DatasetError(f"answer format {answer_format!r}: {err}; use {{answer}}") from None
    opts = Options(
        kind, shard_rows, task, answer_format, None if image_cache is None else str(image_cache)
    )
    src, out = Path(src), Path(out)
    opened = _open(source_files(src), kind)
    state = {
        "version": STATE_VERSION,
        **opts.state(),
        "source": [
            {"name": p.name, "size": p.stat().st_size, "rows": pf.metadata.num_rows}
            for p, pf in opened
        ],
    }
    total = sum(pf.metadata.num_rows for _, pf in opened)
    n_shards = max(1, -(-total // shard_rows))
    meta = out / META
    tmp = meta / "tmp"
    resuming = _check_out(out, state)
    if not resuming:
        meta.mkdir(parents=True, exist_ok=True)
        _write_atomic(meta / "state.json", _json_bytes(state), meta)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for stale in out.glob(".*.tmp"):
        stale.unlink()
    for stale in meta.glob(".*.tmp"):
        stale.unlink()
    done = 0
    while done < n_shards and (out / shard_name(done)).is_file():
        done += 1
    if done and progress and done < n_shards:
        progress(f"resuming at shard {done} of {n_shards} (source row {done * shard_rows})")
    store = ImageStore(out, tmp)
    convert_row = CONVERTERS[kind]
    task_name = opts.state()["task"]
    shard: _Shard | None = None

    def commit(s: _Shard) -> None:
        s.handle.flush()
        os.fsync(s.handle.fileno())
        s.handle.close()
        store.sync()
        record = {
            "shard": s.index,
            "rows": s.rows,
            "parts": {t: s.parts.get(t, 0) for t in PART_TYPES},
            "image_refs": s.image_refs,
            "rejects": s.rejects,
        }
        _write_atomic(meta / f"shard-{s.index:05d}.json", _json_bytes(record), tmp)
        os.replace(s.tmp, out / shard_name(s.index))
        _fsync_dir(meta)
        _fsync_dir(out)
        if progress:
            progress(f"shard {s.index + 1}/{n_shards}: {s.rows} rows, {len(s.rejects)} rejected")

    def open_shard(k: int) -> _Shard:
        path = tmp / f".{shard_name(k)}.tmp"
        return _Shard(k, path, open(path, "wb"))

    for index, path, row_in_file, record in _rows_from(opened, done * shard_rows, batch_rows):
        k = index // shard_rows
        if shard is None or shard.index != k:
            if shard is not None:
                commit(shard)
            shard = open_shard(k)
        row = _Row(store)
        try:
            answer = convert_row(record, row, opts)
        except Reject as rej:
            if strict:
                raise DatasetError(
                    f"{path}:{row_in_file + 1}: {rej.reason}: {rej.detail} (--strict)"
                ) from None
            shard.rejects.append(
                {
                    "index": index,
                    "file": path.name,
                    "row": row_in_file,
                    "reason": rej.reason,
                    "detail": rej.detail,
                }
            )
            continue
        row.write_images()
        sample: dict = {
            "id": f"{kind}-{index:07d}",
            "messages": row.messages(),
            "task": task_name,
            "meta": {"source_file": path.name, "source_row": row_in_file},
        }
        if answer is not None:
            sample["answer"] = answer
        for role, item in row.items:
            shard.parts[f"{role}_{item['type']}"] += 1
            shard.image_refs += item["type"] == "image"
        shard.handle.write(json.dumps(sample, ensure_ascii=False).encode() + b"\n")
        shard.rows += 1
    if shard is not None:
        commit(shard)
    for k in range(done if shard is None else shard.index + 1, n_shards):
        commit(open_shard(k))  # an empty source (no rows at all) still gets its shard
    summary = _finish(out, n_shards, state, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    return summary


def _finish(out: Path, n_shards: int, state: dict, tmp: Path) -> dict:
    """Write rejects.jsonl and summary.json from the shards' records; the summary."""
    meta = out / META
    parts: Counter = Counter()
    reasons: Counter = Counter()
    rows = refs = 0
    rejects_tmp = tmp / ".rejects.jsonl.tmp"
    with open(rejects_tmp, "wb") as handle:  # streamed: rejects are not held in memory
        for k in range(n_shards):
            record = json.loads((meta / f"shard-{k:05d}.json").read_text())
            rows += record["rows"]
            refs += record["image_refs"]
            parts.update(record["parts"])
            for rej in record["rejects"]:
                reasons[rej["reason"]] += 1
                line = json.dumps(rej, ensure_ascii=False, sort_keys=True)
                handle.write(line.encode() + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(rejects_tmp, meta / "rejects.jsonl")
    images = (
        sum(1 for p in (out / IMAGES).rglob("*") if p.is_file()) if (out / IMAGES).is_dir() else 0
    )
    summary = {
        "kind": state["kind"],
        "task": state["task"],
        "source_rows": sum(s["rows"] for s in state["source"]),
        "rows": rows,
        "rejected": sum(reasons.values()),
        "rejects": dict(sorted(reasons.items())),
        "parts": {t: parts.get(t, 0) for t in PART_TYPES},
        "image_refs": refs,
        "images": images,
        "shards": n_shards,
    }
    _write_atomic(meta / "summary.json", _json_bytes(summary), tmp)
    _fsync_dir(meta)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `uniweave data convert`."""
    parser.add_argument("--from", dest="kind", required=True, choices=KINDS, help="corpus schema")
    parser.add_argument("src", metavar="SRC", help="a .parquet file or a folder of them")
    parser.add_argument(
        "out", metavar="OUT", help="output folder (new, empty, or a conversion to resume)"
    )
    parser.add_argument(
        "--strict", action="store_true", help="stop at the first row that cannot be converted"
    )
    parser.add_argument(
        "--image-cache",
        metavar="DIR",
        default=None,
        help="aligned: folder holding the image of URL u as sha256(u)[.ext] (no downloads)",
    )
    parser.add_argument("--task", default=None, help="the rows' task (default: the corpus name)")
    parser.add_argument(
        "--answer-format",
        default=ANSWER_FORMAT,
        help=f"text of the appended final answer (default {ANSWER_FORMAT!r})",
    )
    parser.add_argument(
        "--shard-rows", type=int, default=1000, help="source rows per output shard (default 1000)"
    )
    parser.add_argument(
        "--batch-rows", type=int, default=64, help="rows read at a time (default 64)"
    )


def run(args: argparse.Namespace) -> int:
    """`uniweave data convert`: convert, print the summary; DatasetError (exit 2) for bad
    input."""
    import sys

    if args.shard_rows < 1 or args.batch_rows < 1:
        raise DatasetError("--shard-rows and --batch-rows must be >= 1")
    summary = convert(
        args.kind,
        args.src,
        args.out,
        strict=args.strict,
        shard_rows=args.shard_rows,
        batch_rows=args.batch_rows,
        task=args.task,
        answer_format=args.answer_format,
        image_cache=args.image_cache,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(summary_text(summary, args.out), end="", flush=True)
    return 0


def summary_text(summary: dict, out: str | Path) -> str:
    """The summary as lines: rows, parts per type, images, rejects per reason."""
    lines = [
        f"{summary['kind']} -> {out}: {summary['rows']} rows of {summary['source_rows']} "
        f"({summary['rejected']} rejected, listed in {Path(out) / META / 'rejects.jsonl'})",
        "parts: " + ", ".join(f"{t} {n}" for t, n in summary["parts"].items()),
        f"images: {summary['images']} files for {summary['image_refs']} references",
    ]
    lines += [f"rejected {reason}: {n}" for reason, n in summary["rejects"].items()]
    return "".join(line + "\n" for line in lines)


def inspect_rows(path: str | Path) -> str:
    """Counts of a rows folder (or one .jsonl file), read line by line: rows per task and
    split, parts per role and type, distinct image files referenced; for a converted
    folder also its source rows and rejects per reason (convert/summary.json)."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise DatasetError(f"{path}: no .jsonl rows to inspect")
    rows = 0
    tasks: Counter = Counter()
    splits: Counter = Counter()
    parts: Counter = Counter()
    images: set[str] = set()
    for file in files:
        with open(file, encoding="utf-8") as handle:
            for line, text in enumerate(handle, start=1):
                if not text.strip():
                    continue
                try:
                    row = json.loads(text)
                    messages = row["messages"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DatasetError(f"{file}:{line}: not a row with messages") from None
                rows += 1
                tasks[str(row.get("task"))] += 1
                splits[str(row.get("split", "train"))] += 1
                for message in messages:
                    content = message.get("content")
                    items = [{"type": "text"}] if isinstance(content, str) else content or []
                    for item in items:
                        parts[f"{message.get('role')}_{item.get('type')}"] += 1
                        if item.get("type") == "image":
                            images.add(str(item.get("path")))
    refs = sum(n for part, n in parts.items() if part.endswith("_image"))
    lines = [
        f"{path}: {rows} rows in {len(files)} file(s)",
        "tasks: " + ", ".join(f"{t} {n}" for t, n in sorted(tasks.items())),
        "splits: " + ", ".join(f"{t} {n}" for t, n in sorted(splits.items())),
        "parts: " + ", ".join(f"{t} {n}" for t, n in sorted(parts.items())),
        f"images: {len(images)} distinct files for {refs} references",
    ]
    summary = read_summary(path) if path.is_dir() else None
    if summary is not None:
        lines.append(
            f"converted from {summary['kind']}: {summary['source_rows']} source rows, "
            f"{summary['rejected']} rejected"
            + "".join(f"; {r} {n}" for r, n in summary["rejects"].items())
        )
    return "".join(line + "\n" for line in lines)


def read_summary(out: str | Path) -> dict | None:
    """A finished conversion's summary.json, or None when `out` holds none."""
    path = Path(out) / META / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None
