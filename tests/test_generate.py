"""`unirl generate` on a freshly initialised tiny model writes a PNG grid and JSON."""

import json

import numpy as np
from PIL import Image
from trainer_helpers import run_cli, tiny_config, write_config


def test_generate_writes_a_png_a_person_can_open(tmp_path, small_vq_dir):
    codec = small_vq_dir
    cfg = write_config(tmp_path / "g.yaml", tiny_config(tmp_path / "run", codec))
    out = tmp_path / "out"
    proc = run_cli(
        ["generate", str(cfg), "--prompt", "draw the digit 7", "--n", "3", "--out", str(out)]
        + ["--random-init"]
    )
    assert proc.returncode == 0, proc.stderr
    with Image.open(out / "generations.png") as img:
        pixels = np.asarray(img)
    assert img.format == "PNG" and img.mode == "L"
    assert pixels.shape[0] >= 8 * 16 and pixels.shape[1] >= 3 * 8 * 16  # 3 upscaled digits
    assert pixels.std() > 0
    summary = json.loads((out / "generations.json").read_text())
    assert [s["finish_reason"] for s in summary["samples"]] == ["length_exact"] * 3
    assert [s["images"] for s in summary["samples"]] == [1, 1, 1]
    assert not (tmp_path / "run").exists()  # generating does not create a run directory


def test_generate_text_prompt_and_bad_n(tmp_path, small_vq_dir):
    codec = small_vq_dir
    cfg = write_config(tmp_path / "g.yaml", tiny_config(tmp_path / "run", codec))
    out = tmp_path / "out"
    proc = run_cli(
        ["generate", str(cfg), "--prompt", "What is 3 + 4?", "--n", "2", "--out", str(out)]
        + ["--random-init"]
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "generations.json").read_text())
    assert len(summary["samples"]) == 2
    bad = run_cli(["generate", str(cfg), "--prompt", "x", "--n", "0", "--out", str(out)])
    assert bad.returncode == 2 and "--n" in bad.stderr and bad.stderr.count("\n") == 1
