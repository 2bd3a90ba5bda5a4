from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from tolerances import elementwise_bound

from uniweave.core.sample import GenerationRequest, ImagePart, Sample, TextPart
from uniweave.data.digits import TASKS, make_task_samples
from uniweave.data.export import export_samples, export_task, main
from uniweave.data.loader import DatasetError, load_dataset

LEVELS = np.arange(64, dtype=np.uint8).reshape(8, 8) * 4
PIXEL = elementwise_bound(1.0, 1, paths=1)
"""float32 k / 255 against float64: one rounding of a value <= 1 (2^-24)."""


def write_png(path: Path, array: np.ndarray, mode: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(array)
    (image.convert(mode) if mode else image).save(path)


def write_jsonl(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def user_text(text: str = "hi") -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def test_load_jsonl_rows(tmp_path):
    write_png(tmp_path / "img" / "a.png", LEVELS)
    write_png(tmp_path / "img" / "rgb.png", np.stack([LEVELS] * 3, axis=-1))
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {
                "id": "q1",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "path": "img/a.png"},
                            {"type": "text", "text": "Which digit?"},
                        ],
                    },
                    {"role": "assistant", "content": [{"type": "text", "text": "B"}]},
                ],
                "answer": "B",
                "task": "i2t_mc",
                "meta": {"digit": 3},
            },
            "",
            {"messages": [{"role": "user", "content": [{"type": "image", "path": "img/rgb.png"}]}]},
        ],
    )
    first, second = load_dataset(path, image_size=(8, 8))
    assert first.id == "q1" and first.answer == "B" and first.task == "i2t_mc"
    assert first.meta == {"digit": 3}
    kinds = [(type(p).__name__, p.role) for p in first.parts]
    assert kinds == [
        ("TextPart", "system"),
        ("ImagePart", "user"),
        ("TextPart", "user"),
        ("TextPart", "assistant"),
    ]
    pixels = first.parts[1].pixels
    assert pixels.dtype == np.float32 and pixels.shape == (8, 8)
    # float32 k / 255 is the correctly rounded quotient: one rounding of a value <= 1
    np.testing.assert_allclose(pixels, LEVELS / 255.0, atol=PIXEL)
    assert second.id == "d-3" and second.answer is None and second.meta == {}
    np.testing.assert_allclose(second.parts[0].pixels, LEVELS / 255.0, atol=PIXEL)


def test_load_parquet_with_mixed_items(tmp_path):
    write_png(tmp_path / "a.png", LEVELS)
    rows = [
        {
            "id": "p1",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "path": "a.png", "text": None},
                        {"type": "text", "text": "Which digit?", "path": None},
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "7", "path": None}]},
            ],
            "answer": "7",
            "task": None,
        },
        {"id": "p2", "messages": [user_text("again")], "answer": None, "task": "x"},
    ]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    first, second = load_dataset(path, image_size=(8, 8))
    assert [type(p) for p in first.parts] == [ImagePart, TextPart, TextPart]
    assert first.parts[1].text == "Which digit?" and first.task is None
    np.testing.assert_allclose(first.parts[0].pixels, LEVELS / 255.0, atol=PIXEL)
    assert second.parts == [TextPart("again", "user")] and second.task == "x"
    assert second.answer is None


def test_parquet_errors_name_the_row(tmp_path):
    rows = [
        {"messages": [user_text()]},
        {"messages": [{"role": "bot", "content": [{"type": "text", "text": "x"}]}]},
    ]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(path))}:2: messages\[0\]\.role: expected one of"
    ):
        load_dataset(path)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(bad))}: cannot read parquet"):
        load_dataset(bad)


def _garbage_png(d: Path) -> None:
    (d / "bad.png").write_bytes(b"\x89PNG not really")


def _big_png(d: Path) -> None:
    write_png(d / "big.png", np.zeros((16, 12), dtype=np.uint8))


IMAGE = {"type": "image", "path": "missing.png"}
MALFORMED = [
    # (rows, setup, line, expected message fragment)
    ([{"messages": [user_text()]}, '{"messages": [}'], None, 2, "invalid JSON"),
    ([{"answer": "7"}], None, 1, "messages: missing; expected a non-empty array of messages"),
    (
        [{"messages": "hi"}],
        None,
        1,
        "messages: expected a non-empty array of messages, got a string 'hi'",
    ),
    (
        [{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}],
        None,
        1,
        "messages[0].content[0].text: expected a string, got a number 5",
    ),
    (
        [{"messages": [user_text(), {"role": "user", "content": [IMAGE]}]}],
        None,
        1,
        "messages[1].content[0].path: image file 'missing.png' not found",
    ),
    (
        [{"messages": [{"role": "user", "content": [{"type": "image", "path": "big.png"}]}]}],
        _big_png,
        1,
        "messages[0].content[0].path: image 'big.png' is 16x12; the model takes 8x8 pixels",
    ),
    (
        [{"messages": [{"role": "user", "content": [{"type": "image", "path": "bad.png"}]}]}],
        _garbage_png,
        1,
        "messages[0].content[0].path: cannot read image 'bad.png'",
    ),
    (
        [{"messages": [user_text()]}, {"messages": [user_text(), {"role": "bot", "content": "x"}]}],
        None,
        2,
        "messages[1].role: expected one of 'user', 'assistant', 'system', got a string 'bot'",
    ),
    (
        [{"messages": [user_text()], "answer": 7}],
        None,
        1,
        "answer: expected a string, got a number 7",
    ),
    ([{"messages": [user_text()], "answer": "7", "score": 1}], None, 1, "score: unknown field"),
    (
        [{"messages": [{"role": "user", "content": [{"type": "video", "path": "v.mp4"}]}]}],
        None,
        1,
        "messages[0].content[0].type: expected one of 'text', 'image', 'generate_image', got a "
        "string 'video'",
    ),
    (
        [{"messages": [{"role": "user"}]}],
        None,
        1,
        "messages[0].content: missing",
    ),
    (
        [{"id": "a", "messages": [user_text()]}, {"id": "a", "messages": [user_text()]}],
        None,
        2,
        "id: duplicate id 'a' (first at",
    ),
    (["[1, 2]"], None, 1, "row: expected a JSON object, got an array [1, 2]"),
    (
        [{"id": "g/1", "messages": [user_text()]}],
        None,
        1,
        "id: expected a non-empty string without '/'",
    ),
]


@pytest.mark.parametrize(("rows", "setup", "line", "fragment"), MALFORMED)
def test_malformed_rows(tmp_path, rows, setup, line, fragment):
    if setup is not None:
        setup(tmp_path)
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError) as info:
        load_dataset(path, image_size=(8, 8))
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: ")
    assert fragment in message
    assert "\n" not in message


def test_empty_and_unsupported_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(empty))}: empty dataset; expected at least one row$"
    ):
        load_dataset(empty)
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", "   "])
    with pytest.raises(DatasetError, match="empty dataset"):
        load_dataset(blank)
    with pytest.raises(
        DatasetError, match=r"unsupported dataset file; expected \.jsonl or \.parquet"
    ):
        load_dataset(tmp_path / "d.csv")
    with pytest.raises(DatasetError, match="dataset file not found"):
        load_dataset(tmp_path / "nope.jsonl")


def test_custom_image_size(tmp_path):
    write_png(tmp_path / "big.png", np.full((16, 12), 255, dtype=np.uint8))
    row = {"messages": [{"role": "user", "content": [{"type": "image", "path": "big.png"}]}]}
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    (sample,) = load_dataset(path, image_size=(16, 12))
    assert sample.parts[0].pixels.shape == (16, 12) and sample.parts[0].pixels.min() == 1.0


@pytest.mark.parametrize("task", TASKS)
def test_export_round_trip(tmp_path, task):
    out = tmp_path / "export"
    path = export_task(task, "val", 6, out, seed=2)
    assert path == out / f"{task}-val.jsonl"
    original = make_task_samples(task, "val", 6, seed=2)
    loaded = load_dataset(path, image_size=(8, 8))
    assert len(loaded) == len(original)
    for a, b in zip(original, loaded):
        assert (a.id, a.answer, a.task, a.meta) == (b.id, b.answer, b.task, b.meta)
        assert [(type(p), p.role) for p in a.parts] == [(type(p), p.role) for p in b.parts]
        for p, q in zip(a.parts, b.parts):
            if isinstance(p, TextPart):
                assert p.text == q.text
            else:
                assert np.abs(p.pixels - q.pixels).max() <= 0.5 / 255 + 1e-6
    for png in (out / "images").iterdir():
        with Image.open(png) as im:
            assert im.mode == "L" and im.size == (8, 8)


def test_export_is_atomic_and_refuses_to_clobber(tmp_path):
    out = tmp_path / "out"
    bad = [make_task_samples("t2i", "val", 1)[0], Sample("req", [GenerationRequest(2, 2)])]
    with pytest.raises(ValueError, match="'req' parts\\[0\\]"):
        export_samples(bad, out, "bad")
    assert os.listdir(tmp_path) == []  # neither the output nor a temporary directory
    export_task("t2i", "val", 2, out)
    with pytest.raises(FileExistsError, match="not empty"):
        export_task("i2t_mc", "val", 2, out)
    assert sorted(os.listdir(out)) == ["images", "t2i-val.jsonl"]
    export_task("i2t_mc", "val", 3, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["i2t_mc-val.jsonl", "images"]
    assert len(load_dataset(out / "i2t_mc-val.jsonl")) == 3
    assert sorted(os.listdir(tmp_path)) == ["out"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_task("t2i", "test", 1, empty).is_file()


def test_cli_main(tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["--task", "draw_then_answer", "--split", "train", "--n", "4", "--out", str(out)]
    assert main(argv) == 0
    assert "wrote 4 draw_then_answer samples" in capsys.readouterr().out
    assert len(load_dataset(out / "draw_then_answer-train.jsonl")) == 4
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("uniweave: error: <command line>: --out: ") and "not empty" in err
    with pytest.raises(SystemExit):
        main(["--task", "nope", "--split", "train", "--out", str(out)])
