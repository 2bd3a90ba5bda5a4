"""`uniweave data convert`: Zebra-CoT, ThinkMorph and aligned web corpora to rows.

The tests write small parquet files in the corpora's schemas (real PNG bytes), convert
them and check the rows part by part against hand-written expectations, the rejects
file and its counts, the images (content-named, written once, never where a row's
`path` points), and that a conversion killed with SIGKILL resumes to byte-identical
output.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from uniweave.cli import main
from uniweave.data.convert import convert
from uniweave.data.loader import load_rows

SRC = Path(__file__).resolve().parents[1] / "src"
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def png(seed: int, size: tuple[int, int] = (6, 5), mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    shape = (size[0], size[1], 3) if mode == "RGB" else size
    pixels = rng.integers(0, 256, shape, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def cell(data: bytes | None, path: str | None = None) -> dict | None:
    return None if data is None and path is None else {"bytes": data, "path": path}


def image_file(out: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    return f"images/{digest[:2]}/{digest}.png"


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def rows_of(out: Path) -> list[dict]:
    lines = []
    for shard in sorted(out.glob("rows-*.jsonl")):
        lines += [json.loads(line) for line in shard.read_text().splitlines()]
    return lines


def rejects_of(out: Path) -> list[dict]:
    text = (out / "convert" / "rejects.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


P1, P2, R1, R2, R3 = (png(k) for k in range(5))


def zebra_table(rows: list[dict]) -> pa.Table:
    columns = {
        "Question": pa.string(),
        "Text Reasoning Trace": pa.string(),
        "Final Answer": pa.string(),
        **{f"problem_image_{k}": IMAGE for k in (1, 2)},
        **{f"reasoning_image_{k}": IMAGE for k in (1, 2, 3)},
    }
    schema = pa.schema(list(columns.items()))
    return pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows], schema=schema)


ZEBRA_ROWS = [
    {  # 0: a 3-image trace, the question's image inline
        "Question": "What is shown? <image_start>[problem_image_1]<image_end> Count it.",
        "Text Reasoning Trace": "THOUGHT 0: look.\n<image_start>[reasoning_image_1]<image_end>\n"
        "THOUGHT 1: closer.<image_start>[reasoning_image_2]<image_end>THOUGHT 2: "
        "<image_start>[reasoning_image_3]<image_end> so seven.",
        "Final Answer": "7",
        "problem_image_1": cell(P1, "q.png"),
        "reasoning_image_1": cell(R1),
        "reasoning_image_2": cell(R2),
        "reasoning_image_3": cell(R3),
    },
    {  # 1: a referenced image without bytes
        "Question": "Q <image_start>[problem_image_1]<image_end>",
        "Text Reasoning Trace": "THOUGHT 0: <image_start>[reasoning_image_2]<image_end> x",
        "Final Answer": "1",
        "problem_image_1": cell(P1),
        "reasoning_image_2": cell(None, "missing.png"),
    },
    {  # 2: an inline reference to a key the schema lacks
        "Question": "Q",
        "Text Reasoning Trace": "THOUGHT 0: <image_start>[reasoning_image_9]<image_end>",
        "Final Answer": "2",
    },
    {  # 3: empty trace
        "Question": "Q",
        "Text Reasoning Trace": "   ",
        "Final Answer": "3",
    },
    {  # 4: same image bytes as row 0 (written once); its path label points outside OUT;
        # the trace shows the problem image again (an input) and an unplaced problem image
        "Question": "Where?",
        "Text Reasoning Trace": "THOUGHT 0: again <image_start>[problem_image_1]<image_end>"
        " then <image_start>[reasoning_image_1]<image_end>",
        "Final Answer": "left",
        "problem_image_1": cell(P1, "../../escape.png"),
        "problem_image_2": cell(P2, "/tmp/abs.png"),
        "reasoning_image_1": cell(R1, "../../../r.png"),
    },
    {  # 5: a broken reference and undecodable bytes elsewhere
        "Question": "Q <image_start>[problem_image_1]",
        "Text Reasoning Trace": "t",
        "Final Answer": "5",
        "problem_image_1": cell(P1),
    },
    {  # 6: bytes that are not an image
        "Question": "Q <image_start>[problem_image_1]<image_end>",
        "Text Reasoning Trace": "t",
        "Final Answer": "6",
        "problem_image_1": cell(b"not a png"),
    },
]


def test_zebra_cot_rows_part_by_part(tmp_path):
    src = tmp_path / "zebra.parquet"
    pq.write_table(zebra_table(ZEBRA_ROWS), src, row_group_size=3)
    out = tmp_path / "out"
    summary = convert("zebra-cot", src, out, shard_rows=4, batch_rows=2)
    rows = rows_of(out)
    assert [r["id"] for r in rows] == ["zebra-cot-0000000", "zebra-cot-0000004"]

    def img(data):
        return {"type": "image", "path": image_file(out, data)}

    def txt(text):
        return {"type": "text", "text": text}

    assert rows[0]["messages"] == [
        {"role": "user", "content": [txt("What is shown?"), img(P1), txt("Count it.")]},
        {
            "role": "assistant",
            "content": [
                txt("THOUGHT 0: look."),
                img(R1),
                txt("THOUGHT 1: closer."),
                img(R2),
                txt("THOUGHT 2:"),
                img(R3),
                txt("so seven.\nFinal answer: 7"),
            ],
        },
    ]
    assert rows[0]["answer"] == "7" and rows[0]["task"] == "zebra_cot"
    assert rows[0]["meta"] == {"source_file": "zebra.parquet", "source_row": 0}
    assert rows[1]["messages"] == [
        {"role": "user", "content": [img(P2), txt("Where?")]},
        {"role": "assistant", "content": [txt("THOUGHT 0: again")]},
        {"role": "user", "content": [img(P1)]},
        {"role": "assistant", "content": [txt("then"), img(R1), txt("Final answer: left")]},
    ]
    # images: once each, named by their bytes, holding them; nothing outside OUT
    files = sorted(p for p in (out / "images").rglob("*") if p.is_file())
    assert [p.read_bytes() for p in files] == sorted(
        [P1, P2, R1, R2, R3], key=lambda b: hashlib.sha256(b).hexdigest()
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "zebra.parquet"]
    written = {p.relative_to(out).parts[0] for p in out.rglob("*") if p.is_file()}
    assert written == {"rows-00000.jsonl", "rows-00001.jsonl", "images", "convert"}
    rejects = rejects_of(out)
    assert [(r["index"], r["reason"]) for r in rejects] == [
        (1, "missing_image"),
        (2, "unknown_image_key"),
        (3, "empty_trace"),
        (5, "malformed_image_reference"),
        (6, "unreadable_image"),
    ]
    assert rejects[0]["file"] == "zebra.parquet" and rejects[0]["row"] == 1
    assert "missing.png" in rejects[0]["detail"]
    assert rejects[4]["detail"] == "problem_image_1: cannot identify image file the bytes"
    assert summary["rejects"] == {
        "empty_trace": 1,
        "malformed_image_reference": 1,
        "missing_image": 1,
        "unknown_image_key": 1,
        "unreadable_image": 1,
    }
    assert summary["rows"] + summary["rejected"] == summary["source_rows"] == 7
    assert summary["parts"] == {
        "user_text": 3,
        "user_image": 3,
        "assistant_text": 7,
        "assistant_image": 4,
    }
    assert summary["images"] == 5 and summary["image_refs"] == 7
    assert json.loads((out / "convert" / "summary.json").read_text()) == summary
    # the project's loader reads the rows back: roles and pixels as converted
    loaded = load_rows(out).samples
    assert [s.id for s in loaded] == [r["id"] for r in rows]
    roles = [(p.role, type(p).__name__) for p in loaded[0].parts]
    assert roles == [
        ("user", "TextPart"),
        ("user", "ImagePart"),
        ("user", "TextPart"),
        *[("assistant", "TextPart"), ("assistant", "ImagePart")] * 3,
        ("assistant", "TextPart"),
    ]
    r3 = np.asarray(Image.open(io.BytesIO(R3)).convert("RGB"), dtype=np.float32) / 255
    np.testing.assert_array_equal(loaded[0].parts[8].pixels, r3)


THINKMORPH = {
    "problem_image_0": IMAGE,
    "question": pa.string(),
    "resoning_thought_0": pa.string(),
    "reasoning_image_0": IMAGE,
    "resoning_thought_1": pa.string(),
    "answer": pa.string(),
}


def test_thinkmorph_rows_and_its_spelling(tmp_path):
    rows = [
        {
            "problem_image_0": cell(P1),
            "question": "Which piece goes top left?",
            "resoning_thought_0": "Let me assemble it.",
            "reasoning_image_0": cell(R1),
            "resoning_thought_1": "The assembled image shows a cat.",
            "answer": "B",
        },
        {
            "problem_image_0": cell(P2),
            "question": "Where is the cup?",
            "resoning_thought_0": "Zoom in.",
            "reasoning_image_0": None,
            "resoning_thought_1": "Found it.",
            "answer": "left",
        },
        {
            "problem_image_0": cell(P2),
            "question": "Q",
            "resoning_thought_0": "",
            "reasoning_image_0": cell(R2),
            "resoning_thought_1": None,
            "answer": "A",
        },
    ]
    folder = tmp_path / "tm"
    folder.mkdir()
    schema = pa.schema(list(THINKMORPH.items()))
    pq.write_table(pa.Table.from_pylist(rows[:2], schema=schema), folder / "a.parquet")
    # a second file with the corrected spelling is read the same way
    fixed = {k.replace("resoning", "reasoning"): v for k, v in THINKMORPH.items()}
    renamed = [{k.replace("resoning", "reasoning"): v for k, v in r.items()} for r in rows[2:]]
    pq.write_table(pa.Table.from_pylist(renamed, schema=pa.schema(list(fixed.items()))),
                   folder / "b.parquet")  # fmt: skip
    out = tmp_path / "out"
    summary = convert("thinkmorph", folder, out)
    (row,) = rows_of(out)
    p1, r1 = image_file(out, P1), image_file(out, R1)
    assert row["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image", "path": p1},
                {"type": "text", "text": "Which piece goes top left?"},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me assemble it."},
                {"type": "image", "path": r1},
                {
                    "type": "text",
                    "text": "The assembled image shows a cat.\nFinal answer: B",
                },
            ],
        },
    ]
    assert row["answer"] == "B" and row["id"] == "thinkmorph-0000000"
    assert [(r["index"], r["file"], r["row"], r["reason"]) for r in rejects_of(out)] == [
        (1, "a.parquet", 1, "missing_image"),
        (2, "b.parquet", 0, "empty_trace"),
    ]
    assert summary["rejects"] == {"empty_trace": 1, "missing_image": 1}
    assert summary["parts"] == {
        "user_text": 1,
        "user_image": 1,
        "assistant_text": 2,
        "assistant_image": 1,
    }


def test_a_file_without_a_needed_column_is_exit_2(tmp_path, capsys):
    schema = pa.schema([(k, v) for k, v in THINKMORPH.items() if k != "reasoning_image_0"])
    pq.write_table(pa.Table.from_pylist([], schema=schema), tmp_path / "x.parquet")
    code = main(["data", "convert", "--from", "thinkmorph", str(tmp_path / "x.parquet"),
                 str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("uniweave: error: ") and "'reasoning_image_0'" in err
    assert not (tmp_path / "out").exists()


def test_aligned_documents_from_a_local_cache(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    urls = {"http://a/1.png": P1, "http://b/2.jpg": R1}
    for k, (url, data) in enumerate(urls.items()):
        name = hashlib.sha256(url.encode()).hexdigest() + (".png" if k == 0 else "")
        (cache / name).write_bytes(data)
    docs = [
        {"texts": ["Intro.", None, "Middle.", None], "images": [None, "http://a/1.png", None,
                                                                  "http://b/2.jpg"]},
        {"texts": ["x", None], "images": [None, "http://not/cached.png"]},
        {"texts": ["x", "y"], "images": [None]},
        {"texts": ["x", "y"], "images": [None, "http://a/1.png"]},
        {"texts": [], "images": []},
    ]  # fmt: skip
    schema = pa.schema([("texts", pa.list_(pa.string())), ("images", pa.list_(pa.string()))])
    pq.write_table(pa.Table.from_pylist(docs, schema=schema), tmp_path / "web.parquet")
    out = tmp_path / "out"
    summary = convert("aligned", tmp_path / "web.parquet", out, image_cache=cache)
    (row,) = rows_of(out)
    assert row["messages"] == [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Intro."},
                {"type": "image", "path": image_file(out, P1)},
                {"type": "text", "text": "Middle."},
                {"type": "image", "path": image_file(out, R1)},
            ],
        }
    ]
    assert "answer" not in row and row["task"] == "aligned"
    assert summary["rejects"] == {
        "empty_document": 1,
        "length_mismatch": 1,
        "malformed_position": 1,
        "missing_image": 1,
    }
    assert "http://not/cached.png" in rejects_of(out)[0]["detail"]


def test_aligned_needs_an_image_cache(tmp_path, capsys):
    schema = pa.schema([("texts", pa.list_(pa.string())), ("images", pa.list_(pa.string()))])
    pq.write_table(pa.Table.from_pylist([], schema=schema), tmp_path / "web.parquet")
    code = main(["data", "convert", "--from", "aligned", str(tmp_path / "web.parquet"),
                 str(tmp_path / "out")])  # fmt: skip
    assert code == 2 and "image cache" in capsys.readouterr().err


def test_strict_stops_at_the_first_reject(tmp_path, capsys):
    src = tmp_path / "zebra.parquet"
    pq.write_table(zebra_table(ZEBRA_ROWS), src)
    code = main(["data", "convert", "--from", "zebra-cot", "--strict", str(src),
                 str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"{src}:2: missing_image:" in err and "(--strict)" in err


def test_cli_prints_counts_and_refuses_other_options_on_resume(tmp_path, capsys):
    src = tmp_path / "zebra.parquet"
    pq.write_table(zebra_table(ZEBRA_ROWS), src)
    out = tmp_path / "out"
    assert main(["data", "convert", "--from", "zebra-cot", str(src), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 rows of 7 (5 rejected" in printed
    assert "assistant_image 4" in printed and "rejected unknown_image_key: 1" in printed
    before = tree(out)
    assert main(["inspect", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{out}: 2 rows in 1 file(s)",
        "tasks: zebra_cot 2",
        "splits: train 2",
        "parts: assistant_image 4, assistant_text 7, user_image 3, user_text 3",
        "images: 5 distinct files for 7 references",
        "converted from zebra-cot: 7 source rows, 5 rejected; empty_trace 1; "
        "malformed_image_reference 1; missing_image 1; unknown_image_key 1; unreadable_image 1",
    ]
    assert main(["data", "convert", "--from", "zebra-cot", str(src), str(out)]) == 0
    assert tree(out) == before  # a finished conversion run again: unchanged
    code = main(["data", "convert", "--from", "zebra-cot", "--shard-rows", "3", str(src),
                 str(out)])  # fmt: skip
    assert code == 2 and "shard_rows differ" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    code = main(["data", "convert", "--from", "zebra-cot", str(src), str(tmp_path / "other")])
    assert code == 2 and "not empty" in capsys.readouterr().err


def many_zebra_rows(n: int) -> list[dict]:
    images = [png(100 + k) for k in range(8)]
    rows = []
    for i in range(n):
        row = dict(ZEBRA_ROWS[0])
        row["Final Answer"] = str(i)
        row["problem_image_1"] = cell(images[i % 8])
        row["reasoning_image_1"] = cell(png(1000 + i))  # a new image per row
        if i % 7 == 3:
            row["reasoning_image_2"] = None
        if i % 11 == 5:
            row["reasoning_image_3"] = cell(b"not an image")  # its reject names PIL's error
        rows.append(row)
    return rows


def test_sigkilled_conversion_resumes_to_identical_output(tmp_path):
    src = tmp_path / "zebra.parquet"
    pq.write_table(zebra_table(many_zebra_rows(240)), src, row_group_size=16)
    clean = tmp_path / "clean"
    convert("zebra-cot", src, clean, shard_rows=3, batch_rows=5)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "uniweave", "data", "convert", "--from", "zebra-cot",
           "--shard-rows", "3", "--batch-rows", "5", str(src), str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    committed = 0
    for line in proc.stderr:
        if line.startswith(b"shard "):
            committed += 1
        if committed == 3:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "convert" / "summary.json").exists()  # killed before the end
    shards = sorted(p.name for p in out.glob("rows-*.jsonl"))
    assert 3 <= len(shards) < 80
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"resuming at shard {len(shards)} of 80" in result.stderr
    assert tree(out) == tree(clean)
    summary = json.loads((clean / "convert" / "summary.json").read_text())
    rejected = [i for i in range(240) if i % 7 == 3 or i % 11 == 5]
    assert summary["rows"] == 240 - len(rejected) and summary["rejected"] == len(rejected)
    # the 8 problem images, each converted row's own reasoning image, R2 and R3; a
    # rejected row writes no image
    assert summary["images"] == 8 + (240 - len(rejected)) + 2


def test_rows_resume_from_the_middle_of_a_row_group(tmp_path):
    """Shards that end inside a row group: resuming reads that group from its start and
    skips the converted rows (the kill is simulated by deleting the last shards)."""
    src = tmp_path / "zebra.parquet"
    pq.write_table(zebra_table(many_zebra_rows(40)), src, row_group_size=7)
    out = tmp_path / "out"
    convert("zebra-cot", src, out, shard_rows=5, batch_rows=3)
    full = tree(out)
    for k in range(3, 8):
        (out / f"rows-{k:05d}.jsonl").unlink()
    (out / "convert" / "summary.json").unlink()
    convert("zebra-cot", src, out, shard_rows=5, batch_rows=3)
    assert tree(out) == full


def test_a_kill_while_writing_the_state_file_is_resumable(tmp_path):
    src = tmp_path / "zebra.parquet"
    pq.write_table(zebra_table(ZEBRA_ROWS), src)
    clean, out = tmp_path / "clean", tmp_path / "out"
    convert("zebra-cot", src, clean)
    (out / "convert").mkdir(parents=True)
    (out / "convert" / ".state.json.tmp").write_text('{"version"')  # torn temporary
    convert("zebra-cot", src, out)
    assert tree(out) == tree(clean)
