"""`uniweave eval CONFIG --geneval METADATA`: GenEval's images drawn by the model under
evaluation into GenEval's folder layout, pinned in generation.json, scored as
`uniweave score` scores them, and resumed by image.

Models: the tiny model (random init, the small VQ codec: 8x8 images) and the tiny random
Janus-Pro (guidance); detector: the tiny random Mask2Former of test_geneval_detectors
(its classes cat, dog, computer mouse). The images mean nothing to a detector; the
pipeline is what is tested.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from model_fixtures import write_tiny_mask2former
from PIL import Image
from trainer_helpers import tiny_config, write_config

from uniweave.cli import main
from uniweave.codecs.base import single_thread
from uniweave.core.seeding import seed_for

ROWS = [
    {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
    {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}],
     "prompt": "a photo of a cat and a dog"},
    {"tag": "counting", "include": [{"class": "dog", "count": 2}],
     "exclude": [{"class": "dog", "count": 3}], "prompt": "a photo of two dogs"},
]  # fmt: skip


@pytest.fixture(scope="module")
def m2f_dir(tmp_path_factory) -> Path:
    return write_tiny_mask2former(tmp_path_factory.mktemp("m2f"))


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def write_metadata(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def samples(out: Path) -> dict[str, int]:
    """Every sample PNG under `out` -> its mtime in ns."""
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in sorted(out.glob("*/samples/*"))}


def test_eval_geneval_draws_the_layout_scores_it_like_score_and_resumes(
    tmp_path, small_vq_dir, m2f_dir, capsys
):
    rollout = {"temperature": 0.9, "top_k": 5, "batch_size": 4}
    cfg = tiny_config(tmp_path / "run", small_vq_dir, run={"seed": 11}, rollout=rollout)
    config = write_config(tmp_path / "c.yaml", cfg)
    metadata = write_metadata(tmp_path / "meta.jsonl", ROWS)
    out = tmp_path / "geneval"
    args = ["eval", str(config), "--random-init", "--geneval", str(metadata),
            "--detector-path", str(m2f_dir), "--images-per-prompt", "3", "--out", str(out)]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert "drew 9 images, kept 0" in captured.err
    assert "Overall score (avg. over tasks):" in captured.out
    for i, row in enumerate(ROWS):  # GenEval's layout
        folder = out / f"{i:05d}"
        assert json.loads((folder / "metadata.jsonl").read_text()) == row
        assert sorted(p.name for p in (folder / "samples").iterdir()) == [
            "0000.png", "0001.png", "0002.png",
        ]  # fmt: skip
        with Image.open(folder / "samples" / "0000.png") as img:
            assert img.mode == "RGB" and img.size == (8, 8)
    record = json.loads((out / "generation.json").read_text())
    assert record["seeds"] == [[seed_for(11, 0, i, m) for m in range(3)] for i in range(3)]
    assert record["sampling"]["temperature"] == 0.9 and record["sampling"]["top_k"] == 5
    assert record["sampling"]["guidance"] == 1.0 and record["sampling"]["greedy"] is False
    assert record["model"]["kind"] == "tiny" and len(record["model"]["weights_sha256"]) == 64
    assert record["images_per_prompt"] == 3 and record["prompts"] == 3
    assert record["grid"] == [4, 4] and record["image_size"] == [8, 8]
    assert record["run_seed"] == 11 and record["metadata"] == str(metadata)
    results = (out / "results.jsonl").read_bytes()
    assert len(results.splitlines()) == 9

    # `uniweave score` on the folder writes the very same results
    scored = tmp_path / "scored"
    assert main(["score", str(out), "--detector-path", str(m2f_dir), "--out", str(scored),
                 "--images-per-prompt", "3"]) == 0  # fmt: skip
    capsys.readouterr()
    assert (scored / "results.jsonl").read_bytes() == results
    assert (scored / "summary.txt").read_text() == (out / "summary.txt").read_text()

    # resume: a complete folder draws nothing; a removed image is drawn again, identical
    before = samples(out)
    removed = out / "00001" / "samples" / "0002.png"
    png = removed.read_bytes()
    assert main(args) == 0
    assert "drew 0 images, kept 9" in capsys.readouterr().err
    assert samples(out) == before
    os.remove(removed)
    assert main(args) == 0
    assert "drew 1 images, kept 8" in capsys.readouterr().err
    assert removed.read_bytes() == png
    after = samples(out)
    assert {k for k in after if after[k] != before[k]} == {"00001/samples/0002.png"}
    assert (out / "results.jsonl").read_bytes() == results

    # other settings on the same folder are refused before drawing
    assert main([*args, "rollout.temperature=0.5"]) == 2
    err = capsys.readouterr().err
    assert "sampling.temperature: held 0.9, this run 0.5" in err and err.count("\n") == 1
    assert samples(out) == after


def test_eval_geneval_refuses_bad_metadata_and_options_before_any_model(
    tmp_path, small_vq_dir, m2f_dir, capsys, monkeypatch
):
    """Each refusal is one line, exit 2, before the model under evaluation is built (a
    build here fails the test) and before anything is written."""
    import uniweave.models.build

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(uniweave.models.build, "build_model", no_model)
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", small_vq_dir))
    out = tmp_path / "geneval"
    base = ["eval", str(config), "--random-init", "--out", str(out)]
    bad_rows = {
        "include[0].count": [ROWS[0], {**ROWS[0], "include": [{"class": "cat", "count": 0}]}],
        "include[0].class": [{**ROWS[0], "include": [{"class": "giraffe", "count": 1}]}],
        "tag": [{**ROWS[0], "tag": "shapes"}],
    }
    for field, rows in bad_rows.items():
        metadata = write_metadata(tmp_path / "meta.jsonl", rows)
        assert main([*base, "--geneval", str(metadata), "--detector-path", str(m2f_dir)]) == 2
        err = capsys.readouterr().err
        assert f"{metadata}:{len(rows)}: {field}" in err and err.count("\n") == 1, err
        assert not out.exists()
    metadata = write_metadata(tmp_path / "meta.jsonl", [ROWS[0], {**ROWS[0], "prompt": "x"}])
    (tmp_path / "meta.jsonl").write_text(metadata.read_text() + "{not json\n")
    assert main([*base, "--geneval", str(metadata), "--detector-path", str(m2f_dir)]) == 2
    assert f"{metadata}:3: row: not valid JSON" in capsys.readouterr().err
    colour = write_metadata(
        tmp_path / "colour.jsonl",
        [{**ROWS[0], "tag": "colors", "include": [{"class": "cat", "count": 1, "color": "red"}]}],
    )
    assert main([*base, "--geneval", str(colour), "--detector-path", str(m2f_dir)]) == 2
    assert "include asks for a colour; pass --clip-path" in capsys.readouterr().err
    # GenEval options without --geneval, and --geneval without a detector
    assert main([*base, "--detector-path", str(m2f_dir)]) == 2
    assert "--out: acts only with --geneval" in capsys.readouterr().err
    assert main(["eval", str(config), "--random-init", "--threshold", "0.5"]) == 2
    assert "--threshold: acts only with --geneval" in capsys.readouterr().err
    good = write_metadata(tmp_path / "good.jsonl", ROWS[:1])
    assert main([*base, "--geneval", str(good)]) == 2
    assert "--detector-path" in capsys.readouterr().err
    # a non-empty folder not drawn by eval --geneval
    out.mkdir()
    (out / "x.txt").write_text("x")
    assert main([*base, "--geneval", str(good), "--detector-path", str(m2f_dir)]) == 2
    assert "holds no generation.json" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_eval_geneval_on_janus_pro_pins_the_guidance(tmp_path, m2f_dir, capsys):
    from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "janus", TinyJanusSpec(initializer_range=0.2),
                                 [r["prompt"] for r in ROWS])  # fmt: skip
    cfg = {
        "run": {"name": "j", "seed": 5, "output_dir": str(tmp_path / "run"), "device": "cpu"},
        "model": {"kind": "janus_pro", "path": str(ckpt)},
        "data": {"tasks": ["t2i"]},
        "rollout": {"guidance": 5.0, "top_k": 50, "batch_size": 4},
    }
    config = write_config(tmp_path / "j.yaml", cfg)
    metadata = write_metadata(tmp_path / "meta.jsonl", ROWS[:2])
    out = tmp_path / "geneval"
    args = ["eval", str(config), "--geneval", str(metadata), "--detector-path", str(m2f_dir),
            "--images-per-prompt", "2", "--out", str(out)]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    record = json.loads((out / "generation.json").read_text())
    assert record["sampling"]["guidance"] == 5.0 and record["model"]["path"] == str(ckpt)
    size = tuple(record["image_size"])
    with Image.open(out / "00001" / "samples" / "0001.png") as img:
        assert img.mode == "RGB" and img.size == (size[1], size[0])
    assert len((out / "results.jsonl").read_text().splitlines()) == 4
