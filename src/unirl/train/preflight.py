"""Validate everything a run reads before anything is written (`unirl train`).

`preflight(cfg, algorithms)` runs after the config is validated and before the run
directory is created or opened. It checks, and raises a `ConfigError` (a usage error,
exit 2, one line naming the culprit) on the first problem:

- the algorithm can be trained (`algorithm.name`), the model section fits its kind;
- `run.output_dir` is a directory or does not exist yet;
- `model.path`, `model.codec.path` and OPD's `algorithm.teacher.path`: they exist, and the header of every safetensors
  file under them is read and its size checked against the file (a truncated file names
  its path); no weights are loaded;
- dataset rows (`data.path`, every file and shard, every split; `data.val_path`,
  `data.test_path`) through the same loaders training uses (`unirl.data.rows`), images
  included: the first bad row names its `file:line`; for SFT every training row has an
  assistant turn to learn; with the digits word tokenizer, every target maps to known ids;
- the reward plugins: the reward service is built once from the `reward` section (an
  unknown plugin, option or path names its `reward.plugins.N` key).

Numbers that cannot reach the tensors (`trainer.optimizer.lr=1e39`) and reward mixes
whose weights are all zero are refused earlier, by the config schema.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

from unirl.config import ConfigError, UnirlConfig
from unirl.config.schema import DIGITS_IMAGE_SIZE
from unirl.core.sample import GenerationRequest, Sample
from unirl.data.images import processor_for
from unirl.data.loader import DatasetError, Rows, load_rows
from unirl.data.rows import check_targets, split_rows
from unirl.data.tokenizer import build_tokenizer
from unirl.models import check_model_config
from unirl.rewards.answers import check_dataset_answers
from unirl.rewards.digit_classifier import DigitClassifier
from unirl.rewards.service import build_reward_service

HEADER_BYTES = 8
SHARD_INDEX = ".safetensors.index.json"


class InputError(ConfigError):
    """A file the config names cannot be used, on one line: "FILE[:LINE]: what (KEY in
    SOURCE)", KEY the config key that named the file, SOURCE the config file that set it
    (filled in by the CLI)."""

    def __init__(self, text: str, key: str | None = None) -> None:
        self.text = " ".join(str(text).split())
        super().__init__(self.text, key=key)

    @property
    def message(self) -> str:
        if not self.key:
            return self.text
        return f"{self.text} ({self.key}{f' in {self.source}' if self.source else ''})"


def preflight(cfg: UnirlConfig, algorithms: Collection[str]) -> None:
    """Check everything `cfg` makes a run read (module docstring); writes nothing."""
    if cfg.algorithm.name not in algorithms:
        raise ConfigError(
            f"'{cfg.algorithm.name}' cannot be trained yet",
            key="algorithm.name",
            expected=" | ".join(sorted(algorithms)),
        )
    check_model_config(cfg.model)
    out = Path(cfg.run.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory", key="run.output_dir")
    check_weights(cfg.model.path, "model.path")
    teacher = getattr(cfg.algorithm, "teacher", None)  # OPD
    if teacher is not None:
        check_weights(teacher.path, "algorithm.teacher.path")
    if cfg.model.path is None:  # a model built from the config (tiny, uniar) reads its codec
        check_weights(cfg.model.codec.path, "model.codec.path")
    for k, plugin in enumerate(cfg.reward.plugins):
        check_weights(plugin.path, f"reward.plugins.{k}.path")
    if cfg.data.path is not None:
        check_rows(cfg)
    if cfg.reward.plugins:
        check_rewards(cfg)


def check_safetensors(path: Path, key: str) -> None:
    """Read the header of safetensors file `path` and check the file holds exactly the
    bytes it declares (8-byte header length, JSON header, tensor data)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
        n = int.from_bytes(head, "little") if len(head) == HEADER_BYTES else -1
        if n < 0 or HEADER_BYTES + n > size:
            raise InputError(f"{path}: truncated safetensors file ({size} bytes)", key)
        try:
            header = json.loads(f.read(n))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
            raise InputError(f"{path}: unreadable safetensors header ({err})", key) from None
    if HEADER_BYTES + n + end != size:
        problem = "truncated" if HEADER_BYTES + n + end > size else "oversized"
        raise InputError(
            f"{path}: {problem} safetensors file ({size} bytes; its header says "
            f"{HEADER_BYTES + n + end})",
            key,
        )


def check_weights(path: str | None, key: str) -> None:
    """`path` (a model directory or file named by config key `key`) exists; every
    safetensors file in it has an intact header and size; shard indexes name files that
    exist."""
    if path is None:
        return
    root = Path(path)
    if not root.exists():
        raise InputError(f"{root}: not found", key)
    files = sorted(root.rglob("*.safetensors")) if root.is_dir() else [root]
    for file in files:
        if file.suffix == ".safetensors":
            check_safetensors(file, key)
    for index in sorted(root.rglob(f"*{SHARD_INDEX}")) if root.is_dir() else []:
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise InputError(f"{index}: unreadable shard index ({err})", key) from None
        for shard in sorted(shards):
            if not (index.parent / shard).is_file():
                raise InputError(f"{index}: names shard {shard}, which is missing", key)


def _processor(cfg: UnirlConfig):
    """The tiny model's image processor and grid (greyscale 8x8 digits); other kinds
    ship their image size with the checkpoint, so their images are only read here (sizes
    are checked when the model is built)."""
    if cfg.model.kind != "tiny" or cfg.model.path is not None:
        return None, (1, 1)
    size = (DIGITS_IMAGE_SIZE, DIGITS_IMAGE_SIZE)
    side = DIGITS_IMAGE_SIZE // cfg.model.codec.patch_size // cfg.model.codec.group
    return processor_for("tiny", size, cfg.data.image_resize), (side, side)


def _as_input_error(err: DatasetError, key: str) -> InputError:
    return InputError(str(err), key)


def _has_target(sample: Sample) -> bool:
    return any(p.role == "assistant" and not isinstance(p, GenerationRequest) for p in sample.parts)


def check_rows(cfg: UnirlConfig) -> Rows:
    """Every row of every dataset file the config names; the training rows returned."""
    processor, grid = _processor(cfg)
    data = cfg.data
    try:
        load_rows(data.path, processor, grid, data.default_task)
        train = split_rows(data, "train", processor, grid)
        for split, path in (("val", data.val_path), ("test", data.test_path)):
            if path is not None:
                split_rows(data, split, processor, grid)
        if cfg.algorithm.name == "grpo":  # rows a verifier scores need their answers
            check_dataset_answers(cfg, ("train", "val", "test"))
    except DatasetError as err:
        raise _as_input_error(err, "data.path") from None
    if cfg.algorithm.name == "sft":
        for sample in train.samples:
            if not _has_target(sample):
                raise InputError(
                    f"{train.where.get(sample.id, sample.id)}: messages: no assistant turn "
                    "to learn (SFT trains on the assistant's answer)",
                    "data.path",
                )
    if cfg.model.path is None and cfg.model.kind == "tiny" and not data.uses_bpe:
        try:
            check_targets(train, build_tokenizer())
        except DatasetError as err:
            raise _as_input_error(err, "data.path") from None
    return train


def _never_decode(codes):
    raise RuntimeError("the preflight reward service decodes no images")


def check_rewards(cfg: UnirlConfig) -> None:
    """Build the reward service of the `reward` section once (plugins loading their own
    models from `path` load them; the run's digits classifier, fitted later in the run
    directory, stands in as an unfitted one)."""
    resources = {"digit_classifier": DigitClassifier()}
    build_reward_service(cfg.reward, decode_images=_never_decode, resources=resources)
