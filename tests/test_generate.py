"""`uniweave generate` on a freshly initialised tiny model writes a PNG grid and JSON; it
takes an input image (`--image`), scores its samples as `uniweave eval` would (`--task`,
`--answer`) and prints each image sample's PNG path."""

import json
from pathlib import Path

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
    assert [len(s["images"]) for s in summary["samples"]] == [1, 1, 1]
    for k, sample in enumerate(summary["samples"]):  # each sample's image, printed by path
        assert sample["images"] == [str(out / f"sample-{k}-0.png")]
        assert f"prompt/{k}: {out / f'sample-{k}-0.png'} (length_exact)" in proc.stdout
        with Image.open(sample["images"][0]) as own:
            assert own.size == (8 * 16 + 16, 8 * 16 + 16)  # one 8x8 digit x16, 8-pixel margins
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


def test_generate_scores_like_eval_reads_an_image_and_defaults_its_out(tmp_path, small_vq_dir):
    """`--task/--answer` scores each sample with the task's verifier (text_exact here):
    a second run with the same seeds and the first sample's text as the answer scores 1
    exactly on the samples that said it, 0 elsewhere (checked against the texts, not
    the scorer). `--image` puts the image in the prompt: the same seeds answer otherwise.
    Without `--out`, the files go to <run.output_dir>/generations."""
    from uniweave import cli

    run = tmp_path / "run"
    cfg = tiny_config(run, small_vq_dir, reward={"plugins": [{"name": "text_exact"}]})
    config = str(write_config(tmp_path / "g.yaml", cfg))
    base = ["generate", config, "--prompt", "What is 3 + 4?", "--n", "6", "--random-init"]

    def texts(out: Path) -> list[str]:
        return [s["text"] for s in json.loads((out / "generations.json").read_text())["samples"]]

    assert cli.main([*base, "--out", str(tmp_path / "a")]) == 0
    first = texts(tmp_path / "a")
    answer = next(t.strip() for t in first if t.strip())
    assert cli.main([*base, "--out", str(tmp_path / "b"), "--task", "say", "--answer", answer]) == 0
    scored = json.loads((tmp_path / "b" / "generations.json").read_text())["samples"]
    assert [s["text"] for s in scored] == first  # same seeds, same samples
    assert [s["score"] for s in scored] == [float(t.strip() == answer) for t in first]

    digit = np.zeros((8, 8), dtype=np.uint8)
    digit[2:6, 3:5] = 255
    Image.fromarray(digit).save(tmp_path / "one.png")
    assert cli.main([*base, "--image", str(tmp_path / "one.png")]) == 0
    out = run / "generations"  # the default --out
    summary = json.loads((out / "generations.json").read_text())
    assert summary["image"] == str(tmp_path / "one.png")
    assert texts(out) != first  # the image changed what the model was asked


def test_generate_draws_with_janus_pro_s_own_template(tmp_path, capsys):
    """The responses are parsed by the model's template (Janus-Pro's image markers), not
    the tiny model's ChatML: the drawn image is found and written."""
    from uniweave.cli import main
    from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "janus", TinyJanusSpec(initializer_range=0.2),
                                 ["a red apple"])  # fmt: skip
    cfg = {
        "run": {"name": "j", "seed": 5, "output_dir": str(tmp_path / "run"), "device": "cpu"},
        "model": {"kind": "janus_pro", "path": str(ckpt)},
        "data": {"tasks": ["t2i"]},
        "rollout": {"guidance": 5.0, "batch_size": 2},
    }
    config = write_config(tmp_path / "j.yaml", cfg)
    out = tmp_path / "out"
    args = [
        "generate",
        str(config),
        "--prompt",
        "a red apple",
        "--n",
        "2",
        "--draw",
        "--out",
        str(out),
    ]
    assert main(args) == 0, capsys.readouterr().err
    summary = json.loads((out / "generations.json").read_text())
    assert [len(s["images"]) for s in summary["samples"]] == [1, 1]
    for sample in summary["samples"]:
        with Image.open(sample["images"][0]) as img:
            rgb = np.asarray(img)
        assert img.mode == "RGB"  # colour kept, not averaged to grey
        # not upscaled (>= 64 px) or upscaled 16x (a tiny test image), with its margins
        assert rgb.shape[0] == rgb.shape[1] and rgb.shape[0] > 8
        inner = rgb[8:-8, 8:-8].reshape(-1, 3).astype(int)
        assert (inner.max(axis=1) - inner.min(axis=1)).max() > 0, "no colour in the image"
