"""MetricsLogger: `logging.every`, `logging.jsonl`, TensorBoard, rollout samples and W&B
(offline), each read back from what the sink wrote."""

from __future__ import annotations

import glob
import io
import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from uniweave.config import LoggingConfig
from uniweave.train.engine.metrics import METRICS, MetricsLogger, read_metrics, truncate_metrics

BLOCK = 32768  # the W&B transaction log is a LevelDB-style log of 32 KiB blocks
FULL, LAST = 1, 4


def tb_events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(
        str(run_dir / "tensorboard"), size_guidance={"images": 0, "tensors": 0, "scalars": 0}
    )
    acc.Reload()
    return acc


def wandb_records(run_dir: Path, wait_s: float = 60.0) -> list:
    """The protobuf records of the offline W&B run under `run_dir` (its .wandb log file:
    a 7-byte file header, then records split into 7-byte-headed chunks per block).

    wandb's writer is a separate process: on a loaded machine the file was once still
    empty when `finish()` had returned (seen 3 times on 2 busy cores, never alone), so the
    file is re-read until it holds the run's `exit` record, for up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        records = _read_wandb_records(run_dir)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def _read_wandb_records(run_dir: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    raw = Path(path).read_bytes()
    assert raw[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(raw):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        _crc, n, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if n == 0 and kind == 0:
            break
        pending += raw[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def metric_stream(n: int) -> list[dict[str, float]]:
    return [{"loss": 1.0 / u, "lr": 0.1 * u, "note": "x"} for u in range(1, n + 1)]


def test_every_writes_due_and_forced_updates_with_their_own_values(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(every=3, wandb=False))
    stream = metric_stream(7)
    written = [logger.log(u, m, force=u == 7) for u, m in enumerate(stream, 1)]
    logger.close()
    assert written == [False, False, True, False, False, True, True]
    records = read_metrics(tmp_path / METRICS)
    assert [r["update"] for r in records] == [3, 6, 7]
    for r in records:
        assert r == {"update": r["update"], **stream[r["update"] - 1]}
    loss = tb_events(tmp_path).Scalars("loss")
    assert [(e.step, e.value) for e in loss] == [
        (u, pytest.approx(stream[u - 1]["loss"])) for u in (3, 6, 7)
    ]


def test_jsonl_off_writes_no_metrics_file_but_tensorboard_still_logs(tmp_path):
    truncate_metrics(tmp_path / METRICS, -1)  # a fresh start with no file creates none
    logger = MetricsLogger(tmp_path, LoggingConfig(jsonl=False))
    for u, m in enumerate(metric_stream(2), 1):
        logger.log(u, m)
    logger.close()
    assert not (tmp_path / METRICS).exists()
    assert [e.step for e in tb_events(tmp_path).Scalars("lr")] == [1, 2]


def samples(rng: np.random.Generator) -> list[dict]:
    return [
        {"prompt": "draw the digit 7", "response": "<image>", "reward": 0.75,
         "image": rng.random((8, 8))},
        {"prompt": "which digit?", "response": "B", "reward": None,
         "image": rng.random((4, 6, 3))},
        {"prompt": "hello", "response": "hi", "reward": 1.0, "image": None},
    ]  # fmt: skip


def test_samples_go_to_tensorboard_every_samples_every_updates(tmp_path):
    rows = samples(np.random.default_rng(0))
    logger = MetricsLogger(tmp_path, LoggingConfig(samples_every=2, jsonl=False))
    assert not logger.log_samples(1, rows)
    assert logger.log_samples(2, rows)
    with pytest.raises(ValueError, match=r"values must lie in \[0, 1\]"):
        logger.log_samples(4, [{**rows[0], "image": rows[0]["image"] + 1.0}])
    with pytest.raises(ValueError, match="missing keys"):
        logger.log_samples(4, [{"prompt": "p"}])
    logger.close()
    acc = tb_events(tmp_path)
    for i, row in enumerate(rows[:2]):
        (event,) = acc.Images(f"samples/{i}")
        assert event.step == 2
        decoded = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)))
        expected = np.round(row["image"] * 255).astype(np.uint8)
        if expected.ndim == 2:  # TensorBoard stores a grey image as three equal channels
            expected = np.repeat(expected[..., None], 3, axis=2)
        assert np.array_equal(decoded, expected)
    assert "samples/2" not in acc.Tags()["images"]
    texts = {
        tag: acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
        for tag in acc.Tags()["tensors"]
    }
    assert len(texts) == 3
    text = texts["samples/1/text_summary"]
    assert "which digit?" in text and "B" in text and "none" in text


def test_samples_every_zero_is_off(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(samples_every=0, jsonl=False))
    assert not any(logger.log_samples(u, samples(np.random.default_rng(0))) for u in range(5))
    logger.close()
    assert tb_events(tmp_path).Tags()["images"] == []


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    import wandb  # noqa: F401 - the Makefile installs the wandb extra: this test always runs

    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        (tmp_path / var).mkdir()
        monkeypatch.setenv(var, str(tmp_path / var))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


def test_wandb_offline_run_holds_the_logged_metrics_config_and_samples(tmp_path, wandb_offline):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = {"run": {"name": "knob-run"}, "trainer": {"total_updates": 5}}
    logging = LoggingConfig(wandb=True, tensorboard=False, jsonl=False, every=2, samples_every=4)
    logger = MetricsLogger(run_dir, logging, config)
    rows = samples(np.random.default_rng(1))
    for u, m in enumerate(metric_stream(5), 1):
        logger.log(u, m, force=u == 5)
        logger.log_samples(u, rows)
    logger.close()

    records = wandb_records(run_dir)
    kinds = [r.WhichOneof("record_type") for r in records]
    runs = [r.run for r, k in zip(records, kinds) if k == "run"]
    assert len(runs) == 1, kinds
    run = runs[0]
    assert run.display_name == "knob-run" and run.project == "uniweave"
    assert run.run_id == (run_dir / "wandb_run_id").read_text().strip()
    updates = [r.config.update for r, k in zip(records, kinds) if k == "config"]
    logged_config = {
        item.key: json.loads(item.value_json)
        for items in [run.config.update, *updates]
        for item in items
    }
    assert logged_config["run"] == config["run"] and logged_config["trainer"] == config["trainer"]
    history = [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r, k in zip(records, kinds)
        if k == "history"
    ]
    assert [h["_step"] for h in history] == [2, 4, 5]
    stream = metric_stream(5)
    for h in history:
        assert h["loss"] == pytest.approx(stream[h["_step"] - 1]["loss"])
        assert "note" not in h  # only numbers go to W&B; metrics.jsonl keeps everything
    (with_samples,) = [h for h in history if "samples/path" in h]
    assert with_samples["_step"] == 4 and with_samples["samples/nrows"] == 3
    table = json.loads((next(run_dir.glob("wandb/offline-run-*")) / "files" /
                        with_samples["samples/path"]).read_text())  # fmt: skip
    assert table["columns"] == ["update", "prompt", "response", "reward", "image"]
    assert [row[:4] for row in table["data"]] == [
        [4, s["prompt"], s["response"], s["reward"]] for s in rows
    ]
    staged = [
        Path(entry.local_path)
        for r, k in zip(records, kinds)
        if k == "artifact"
        for entry in r.artifact.manifest.contents
        if entry.path.endswith(".png")
    ]
    decoded = sorted(np.asarray(Image.open(p)).tobytes() for p in staged)
    expected = sorted(np.round(s["image"] * 255).astype(np.uint8).tobytes() for s in rows[:2])
    assert decoded == expected
