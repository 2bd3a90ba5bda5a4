"""Own datasets: any task label, splits, shards, parquet, colour images, the BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from tolerances import elementwise_bound, sum_bound

from uniweave.config import ConfigError, load_config
from uniweave.config.schema import DataConfig
from uniweave.core.sample import GenerationRequest, ImagePart, TextPart
from uniweave.data.images import GreyscaleProcessor, RGBProcessor, read_rgb
from uniweave.data.loader import DatasetError, load_rows
from uniweave.data.rows import check_targets, generates_image, split_rows
from uniweave.data.template import parse, serialize
from uniweave.data.tokenizer import build_tokenizer, load_or_train_bpe, train_bpe_tokenizer

RED = np.zeros((8, 8, 3), dtype=np.uint8)
RED[..., 0] = 200
RED[2:4, :, 2] = 100


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa(i: int, task: str = "angle_mc", split: str | None = None, image: str | None = None):
    user = [{"type": "text", "text": f"Which angle is larger in figure {i}?"}]
    if image:
        user.insert(0, {"type": "image", "path": image})
    row = {
        "id": f"q{i}",
        "messages": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": f"Angle théta {i}"},
        ],
        "answer": f"Angle théta {i}",
        "task": task,
    }
    if split:
        row["split"] = split
    return row


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_any_task_label_needs_data_path(tmp_path):
    cfg = load_config(write_config(tmp_path, "data: {path: d.jsonl, tasks: [angle_mc]}\n"))
    assert cfg.data.tasks == ["angle_mc"] and cfg.data.uses_bpe
    with pytest.raises(ConfigError, match=r"data\.tasks: 'angle_mc' is not a built-in digits"):
        load_config(write_config(tmp_path, "data: {tasks: [angle_mc]}\n"))


def test_reward_routes_are_checked(tmp_path):
    base = "algorithm: {name: grpo}\ndata: {path: d.jsonl, tasks: [angle_mc, geo]}\n"
    ok = base + "reward: {plugins: [{name: text_exact, tasks: [angle_mc, geo]}]}\n"
    assert load_config(write_config(tmp_path, ok)).reward.plugins[0].tasks == ["angle_mc", "geo"]
    unrouted = base + "reward: {plugins: [{name: text_exact, tasks: [angle_mc]}]}\n"
    with pytest.raises(ConfigError, match="reward.plugins: task 'geo' has no reward route"):
        load_config(write_config(tmp_path, unrouted))
    stray = base + "reward: {plugins: [{name: text_exact, tasks: [angle_mc, geo, nope]}]}\n"
    with pytest.raises(ConfigError, match=r"reward\.plugins\.0\.tasks: task 'nope' is not in"):
        load_config(write_config(tmp_path, stray))


def test_colour_is_kept_and_processors_convert_explicitly(tmp_path):
    Image.fromarray(RED).save(tmp_path / "red.png")
    rgb = read_rgb(tmp_path / "red.png")
    assert rgb.shape == (8, 8, 3)
    # float32 k / 255, the correctly rounded quotient: one rounding of a value <= 1
    pixel = elementwise_bound(1.0, 1, paths=1)
    np.testing.assert_allclose(rgb, RED / 255.0, atol=pixel)
    rows = load_rows(write_rows(tmp_path / "d.jsonl", [qa(0, image="red.png")]))
    np.testing.assert_allclose(rows.samples[0].parts[0].pixels, RED / 255.0, atol=pixel)
    grey = GreyscaleProcessor((8, 8))
    out = grey(rgb, "red.png")
    expected = (RED.astype(np.float64) / 255.0) @ np.array([0.299, 0.587, 0.114])
    # float32 luma against float64: the pixels' rounding, 3 products and 2 additions
    np.testing.assert_allclose(out, expected, atol=elementwise_bound(1.0, 6, paths=1))
    assert (grey.n_images, grey.n_colour) == (1, 1)
    with pytest.raises(ValueError, match=r"'red.png' is 8x8; the model takes 16x16 .*resize"):
        RGBProcessor((16, 16))(rgb, "red.png")
    big = RGBProcessor((16, 16), resize="resize")(rgb, "red.png")
    # a constant channel under float32 bicubic resampling: two passes of weights summing
    # to 1, <= 8 roundings of a value <= 1 (as tests/test_image_modes.py), then numpy's
    # float32 mean of 256 values (sum_bound)
    tol = elementwise_bound(1.0, 8, paths=1) + sum_bound(1.0, big[..., 0].size)
    assert big.shape == (16, 16, 3) and abs(big[..., 0].mean() - 200 / 255) <= tol


def test_wrong_size_under_error_names_file_line(tmp_path):
    Image.fromarray(RED).save(tmp_path / "red.png")
    path = write_rows(tmp_path / "d.jsonl", [qa(0), qa(1, image="red.png")])
    with pytest.raises(DatasetError) as info:
        load_rows(path, RGBProcessor((384, 384)))
    assert str(info.value).startswith(f"{path}:2: messages[0].content[0].path: image 'red.png'")


def test_splits_shards_and_tasks(tmp_path):
    shards = tmp_path / "shards"
    write_rows(shards / "a.jsonl", [qa(0), qa(1, split="val"), qa(2, task="other")])
    write_rows(shards / "b.jsonl", [qa(3, split="test"), qa(4, split="train")])
    data = DataConfig(path=str(shards), tasks=["angle_mc"])
    assert [s.id for s in split_rows(data, "train").samples] == ["q0", "q4"]
    assert [s.id for s in split_rows(data, "val").samples] == ["q1"]
    assert split_rows(data, "test").where["q3"] == f"{shards / 'b.jsonl'}:1"
    val = write_rows(tmp_path / "val.jsonl", [qa(7), qa(8, split="test")])
    with pytest.raises(DatasetError, match=r"val\.jsonl:2: split: 'test' row in data\.val_path"):
        split_rows(DataConfig(path=str(shards), val_path=str(val), tasks=["angle_mc"]), "val")
    untagged = write_rows(tmp_path / "u.jsonl", [{k: v for k, v in qa(0).items() if k != "task"}])
    with pytest.raises(DatasetError, match=r"u\.jsonl:1: task: missing"):
        split_rows(DataConfig(path=str(untagged), tasks=["angle_mc"]), "train")
    rows = split_rows(DataConfig(path=str(untagged), tasks=["x"], default_task="x"), "train")
    assert rows.samples[0].task == "x"
    with pytest.raises(DatasetError, match="no rows with split 'val'"):
        split_rows(DataConfig(path=str(untagged), tasks=["x"], default_task="x"), "val")


def test_parquet_in_hugging_face_layout(tmp_path):
    """The layout `datasets.Dataset.from_list(rows).to_parquet(...)` writes: content items
    as one struct type whose unused fields are null."""
    Image.fromarray(RED).save(tmp_path / "red.png")
    item = pa.struct([("type", pa.string()), ("text", pa.string()), ("path", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.list_(item))])
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("messages", pa.list_(message)),
            ("answer", pa.string()),
            ("task", pa.string()),
            ("split", pa.string()),
        ]
    )
    rows = [
        {
            "id": "p0",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "text": None, "path": "red.png"},
                        {"type": "text", "text": "Colour?", "path": None},
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "red", "path": None}]},
            ],
            "answer": "red",
            "task": "colour",
            "split": None,
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / "train.parquet")
    (sample,) = load_rows(tmp_path / "train.parquet").samples
    assert sample.task == "colour" and sample.parts[0].pixels.shape == (8, 8, 3)
    assert [type(p).__name__ for p in sample.parts] == ["ImagePart", "TextPart", "TextPart"]


def test_generate_image_rows(tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": "a red square"},
            {"role": "assistant", "content": [{"type": "generate_image"}]},
        ],
        "task": "paint",
    }
    path = write_rows(tmp_path / "p.jsonl", [row])
    (sample,) = load_rows(path, image_grid=(4, 4)).samples
    assert sample.parts[-1] == GenerationRequest(4, 4) and generates_image(sample)
    with pytest.raises(DatasetError, match=r"p\.jsonl:1: messages\[1\]\.content\[0\]\.height"):
        load_rows(path)
    assert not generates_image(load_rows(write_rows(tmp_path / "q.jsonl", [qa(0)])).samples[0])


def test_bpe_reads_any_text_and_is_saved(tmp_path):
    texts = ["Which angle is larger? Angle théta", "三角形 ABC"] * 3
    tok = train_bpe_tokenizer(texts, 400)
    assert tok.unk_token_id is None
    sample = load_rows(write_rows(tmp_path / "d.jsonl", [qa(5)])).samples[0]
    traj = serialize(sample, tok)
    assert [p.text for p in parse(traj, tok) if isinstance(p, TextPart)] == [
        "Which angle is larger in figure 5?",
        "Angle théta 5",
    ]
    saved = load_or_train_bpe(tmp_path / "tokenizer", texts, 400)
    again = load_or_train_bpe(tmp_path / "tokenizer", ["unrelated"], 400)
    assert saved.get_vocab() == again.get_vocab() == tok.get_vocab()


def test_unknown_target_is_an_error_naming_file_line(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [qa(0)])
    rows = split_rows(DataConfig(path=str(path), tasks=["angle_mc"]), "train")
    with pytest.raises(DatasetError) as info:
        check_targets(rows, build_tokenizer())
    message = str(info.value)
    assert message.startswith(f"{path}:1: assistant text") and "'théta'" in message
    check_targets(rows, train_bpe_tokenizer(["x"], 300))


def test_image_generation_comes_from_the_row_not_the_task():
    from uniweave.core.sample import ImagePart, Sample
    from uniweave.data.digits import make_task_samples
    from uniweave.data.rows import answer_image_grid

    t2i, draw, mc = (
        make_task_samples(t, "val", 1)[0] for t in ("t2i", "draw_then_answer", "i2t_mc")
    )
    assert generates_image(t2i) and generates_image(draw) and not generates_image(mc)
    assert answer_image_grid(t2i, (4, 4)) == (4, 4)
    assert answer_image_grid(draw, (4, 4)) is None and answer_image_grid(mc, (4, 4)) is None
    renamed = Sample("x", list(t2i.parts), task="anything")
    assert answer_image_grid(renamed, (2, 3)) == (2, 3)
    assert isinstance(renamed.parts[-1], ImagePart)


def _rows_model(tmp_path: Path, extra: str = ""):
    """A tiny model on a colour-square dataset (train rows sq0, sq2, ...; test rows odd)
    plus a `t2i`-labelled text row and a `paint` row that asks for an image."""
    from eval_fixtures import make_dataset, write_config

    from uniweave.models.build import build_model

    data = make_dataset(tmp_path / "data", 6)
    paint = {
        "id": "paint0",
        "messages": [
            {"role": "user", "content": "paint the square"},
            {"role": "assistant", "content": [{"type": "generate_image"}]},
        ],
        "answer": "square",
        "task": "paint",
        "split": "train",
    }
    renamed = {**qa(9, task="t2i", split="train"), "answer": "Angle 9"}
    renamed["messages"][1]["content"] = "Angle 9"
    with data.open("a") as f:
        f.write(json.dumps(paint) + "\n" + json.dumps(renamed) + "\n")
    config = write_config(tmp_path, data, extra)
    text = config.read_text().replace("tasks: [colour_qa]", "tasks: [colour_qa, paint, t2i]")
    config.write_text(
        text.replace(
            "plugins: [{name: text_exact, tasks: [colour_qa]}]", "plugins: [{name: text_exact}]"
        )
    )
    cfg = load_config(config)
    return cfg, build_model(cfg), data


def test_training_reads_the_train_split_through_the_model_processor(tmp_path):
    from uniweave.train.methods.sft.source import sft_trajectories
    from uniweave.train.onpolicy.prompts import prompt_pools

    cfg, model, data = _rows_model(tmp_path)
    trajs = sft_trajectories(cfg, model, "train", 0)
    train = ["sq0", "sq2", "sq4", "paint0", "q9"]
    assert [t.sample_id for t in trajs] == train
    assert [t.sample_id for t in sft_trajectories(cfg, model, "test", 0)] == ["sq1", "sq3", "sq5"]
    pools = prompt_pools(cfg, model)
    assert {t: [s.id for s in p] for t, p in pools.items()} == {
        "colour_qa": ["sq0", "sq2", "sq4"],
        "paint": ["paint0"],
        "t2i": ["q9"],
    }
    png = np.asarray(Image.open(data.parent / "img" / "2.png").convert("RGB"), np.float64) / 255
    luma = png @ np.array([0.299, 0.587, 0.114])
    image = next(p for p in pools["colour_qa"][1].parts if isinstance(p, ImagePart))
    # the tiny model's grey view: float32 luma against float64 (6 roundings of values <= 1)
    np.testing.assert_allclose(image.pixels, luma, atol=elementwise_bound(1.0, 6, paths=1))


def test_grpo_forces_an_image_where_the_row_answers_with_one(tmp_path):
    from uniweave.train.distributed.comm import DistInfo
    from uniweave.train.methods.grpo.job import build_grpo_job

    extra = (
        "algorithm: {name: grpo, group_size: 2}\n"
        "trainer: {global_batch_size: 6, micro_batch_size: 6, total_updates: 1}\n"
    )
    cfg, model, _ = _rows_model(tmp_path, extra)
    source, _ = build_grpo_job(cfg, model, tmp_path / "run", DistInfo())
    samples, requests = source.requests(0)
    grids = {(s.task, r.image_grid) for s, r in zip(samples, requests)}
    assert grids == {("colour_qa", None), ("t2i", None), ("paint", tuple(model.codec.grid))}


def test_a_verifier_needs_the_answer_of_every_row_it_scores(tmp_path):
    from uniweave.rewards import check_answers, check_dataset_answers

    no_answer = {k: v for k, v in qa(1).items() if k != "answer"}
    other = {k: v for k, v in qa(2, task="free").items() if k != "answer"}
    path = write_rows(tmp_path / "d.jsonl", [qa(0), no_answer, other])
    base = f"algorithm: {{name: grpo}}\ndata: {{path: {path}, tasks: [angle_mc, free]}}\n"
    routed = "reward: {plugins: [{name: text_exact, tasks: [angle_mc]}, {name: jigsaw, tasks: [free]}]}\n"
    cfg = load_config(write_config(tmp_path, base + routed))
    rows = split_rows(cfg.data, "train")
    with pytest.raises(DatasetError) as info:
        check_answers(cfg.reward, rows)
    assert str(info.value) == (
        f"{path}:2: answer: missing; reward.plugins.0 (text_exact) compares the responses "
        "of task 'angle_mc' with the row's answer"
    )
    with pytest.raises(DatasetError, match=rf"^{path}:2: answer: missing"):
        check_dataset_answers(cfg)
    check_answers(cfg.reward, rows.select([True, False, True]))  # jigsaw reads meta only
    every = load_config(
        write_config(tmp_path, base + "reward: {plugins: [{name: exact_answer}]}\n")
    )
    with pytest.raises(DatasetError, match=rf"^{path}:3: answer: missing; reward.plugins.0"):
        check_answers(every.reward, rows.select([True, False, True]))
    mc = load_config(write_config(tmp_path, base + "reward: {plugins: [{name: mc_exact}]}\n"))
    with pytest.raises(
        DatasetError, match=rf"^{path}:1: answer: 'Angle théta 0' is not a letter A-D"
    ):
        check_answers(mc.reward, rows)


def test_uniweave_eval_refuses_a_row_without_answer_before_writing(tmp_path):
    import subprocess
    import sys

    from eval_fixtures import make_dataset
    from eval_fixtures import write_config as eval_config

    data = make_dataset(tmp_path / "data", 4)
    lines = data.read_text().splitlines()
    row = json.loads(lines[3])
    del row["answer"]
    data.write_text("\n".join(lines[:3] + [json.dumps(row)]) + "\n")
    out = tmp_path / "out"
    config = eval_config(tmp_path, data, f"evaluation: {{output_dir: {out}}}\n")
    cmd = [sys.executable, "-m", "uniweave", "eval", str(config), "--random-init"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and not out.exists()
    last = done.stderr.strip().splitlines()[-1]
    assert f"{data}:4: answer: missing; reward.plugins.0 (text_exact)" in last


def test_the_no_val_rows_warning_suggests_overrides_the_config_accepts():
    """A recipe that validates (val_size, eval_every, the best checkpoint on a val metric)
    on a dataset without val rows (colour_squares: train and test only) is told to set
    `silencing_overrides`; with exactly those the config loads and evaluates no val split.
    (`data.val_size=0` alone, the old suggestion, is refused: eval_every evaluates nothing.)"""
    from uniweave.config import ConfigError, load_config
    from uniweave.train.run import silencing_overrides

    recipe = "examples/own_data_tiny"
    extra = [
        "data.val_size=12",
        "trainer.eval_every=10",
        "checkpoint.keep_best=val/loss",
        "checkpoint.keep_best_mode=max",
    ]
    cfg = load_config(recipe, extra)
    fix = silencing_overrides(cfg, "val")
    assert fix[0] == "data.val_size=0" and len(fix) == 4
    with pytest.raises(ConfigError, match="trainer.eval_every"):
        load_config(recipe, [*extra, "data.val_size=0"])
    fixed = load_config(recipe, [*extra, *fix])
    assert fixed.data.val_size == 0 and fixed.trainer.eval_every == 0
    assert fixed.checkpoint.keep_best is None
    assert silencing_overrides(cfg, "test") == ["data.test_size=0"]
    load_config(recipe, ["data.test_size=0"])  # nothing else depends on the test split


def test_data_tasks_follow_from_rows_with_one_label(tmp_path, caplog):
    from uniweave.config import validate_config
    from uniweave.data.rows import resolve_tasks

    # the digits default is unchanged: no tasks, no data.path -> [t2i]
    assert validate_config({}).data.tasks == ["t2i"]
    one = write_rows(tmp_path / "one.jsonl", [qa(i) for i in range(3)] + [qa(9, split="test")])
    raw = {"data": {"path": str(one)}, "reward": {"plugins": [{"name": "text_exact"}]}}
    cfg = validate_config(raw)
    assert cfg.data.tasks is None
    with caplog.at_level("WARNING"):
        resolved = resolve_tasks(cfg)
    assert resolved.data.tasks == ["angle_mc"]
    assert (
        f"data.tasks not set: [angle_mc], the one task of the 3 train rows of {one}; "
        "reward.plugins.0 (text_exact) score it (tasks null: every task)" in caplog.text
    )
    assert resolve_tasks(resolved) is resolved
    # the config is validated again with the label: a reward route to another task is caught
    routed = {**raw, "reward": {"plugins": [{"name": "text_exact", "tasks": ["angle"]}]}}
    with pytest.raises(ConfigError, match=r"task 'angle' is not in data.tasks \['angle_mc'\]"):
        resolve_tasks(validate_config(routed))
    # several labels: an error listing them with their train-row counts
    two = write_rows(tmp_path / "two.jsonl", [qa(0), qa(1, task="b"), qa(2, task="b")])
    with pytest.raises(
        DatasetError, match=r"have 2 tasks: angle_mc \(1\), b \(2\); set data.tasks"
    ):
        resolve_tasks(validate_config({**raw, "data": {"path": str(two)}}))


def test_conversion_counts_are_logged_once_per_dataset(tmp_path, caplog):
    """One line per dataset a run reads, whoever reads it and how often."""
    img = tmp_path / "img"
    img.mkdir()
    Image.fromarray(RED).save(img / "r.png")
    rows = write_rows(tmp_path / "rows.jsonl", [qa(0, image="img/r.png"), qa(1)])
    with caplog.at_level("INFO"):
        for _ in range(3):  # training, the baseline and the final evaluation read it again
            load_rows(rows, GreyscaleProcessor((8, 8), "error"), (1, 1))
    said = [r.getMessage() for r in caplog.records if "greyscale" in r.getMessage()]
    assert said == [
        f"{rows}: 1 images for a greyscale 8x8 model: 1 colour images converted to "
        "greyscale (BT.601 luma), 0 resized"
    ]
    # a run reads with one processor, whose counts add up over its reads (preflight read
    # the file, then the training split, once said 1 then 2 images): each read's own counts
    shared = GreyscaleProcessor((8, 8), "error")
    again = write_rows(tmp_path / "again.jsonl", [qa(0, image="img/r.png"), qa(1)])
    with caplog.at_level("INFO"):
        for _ in range(3):
            load_rows(again, shared, (1, 1))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(str(again))]
    assert said == [
        f"{again}: 1 images for a greyscale 8x8 model: 1 colour images converted to "
        "greyscale (BT.601 luma), 0 resized"
    ]
    assert shared.counts() == {"n_images": 3, "n_resized": 0, "n_colour": 3}
