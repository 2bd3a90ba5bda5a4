"""The configured rows of one split, what a row asks the model to produce, and the
checks that tie rows to a tokenizer.

Splits (`split_rows`): the rows of `split` are all rows of `data.<split>_path` when it is
set (val/test; a row whose `split` field names another split is an error), else the
rows of `data.path` whose `split` field is `split` (for train: also the rows without a
split field). Of those, rows whose task is in `data.tasks` are kept; the others are
left out and counted in the log. Rows without a task get `data.default_task`; a row
without either is an error naming its file:line.

`data.tasks: null` with `data.path` (`resolve_tasks`): the tasks are the one `task` label
of the train rows, read when a command starts and stated in its log; rows of several
labels are an error that lists them with their counts (the user picks). The config is
then validated again with that list, so every check that needs the tasks runs.

Whether a row generates an image (`generates_image`) comes from its assistant parts: an
image (SFT target) or a `GenerationRequest` (a prompt-only row), never from its task
name; `answer_image_grid` says whether the whole answer is one image.
"""

from __future__ import annotations

import logging
from collections import Counter

from transformers import PreTrainedTokenizerBase

from uniweave.config import UniweaveConfig, validate_config
from uniweave.config.resolved import data_tasks
from uniweave.config.schema import DataConfig
from uniweave.core.sample import GenerationRequest, ImagePart, Sample, TextPart
from uniweave.core.status import log_once
from uniweave.data.images import ImageProcessor
from uniweave.data.loader import DatasetError, Rows, load_rows

logger = logging.getLogger(__name__)


def split_rows(
    data: DataConfig,
    split: str,
    processor: ImageProcessor | None = None,
    image_grid: tuple[int, int] | None = None,
) -> Rows:
    """The rows of `split` ("train", "val" or "test") of a `data.path` config (module
    docstring). Raises `DatasetError` naming the file:line or the config key at fault."""
    if data.path is None:
        raise ValueError("split_rows reads data.path rows; the digits tasks are built in")
    key = split_key(data, split)
    try:
        return _split_rows(data, split, key, processor, image_grid)
    except DatasetError as err:
        raise err.keyed(key) from None


def resolve_tasks(cfg: UniweaveConfig) -> UniweaveConfig:
    """`cfg` itself when `data.tasks` is set; else `cfg` with `data.tasks` = the one task
    label of `data.path`'s train rows, validated again (module docstring). Raises
    `DatasetError` (keyed `data.tasks`) when the train rows have several labels or none."""
    if cfg.data.tasks is not None:
        return cfg
    path = cfg.data.path
    if path is None:  # the schema fills [t2i] for the digits; never reached from a config
        raise ValueError("resolve_tasks reads data.path rows; the digits tasks are built in")
    try:
        rows = load_rows(path, None, (1, 1), cfg.data.default_task)
    except DatasetError as err:
        raise err.keyed("data.path") from None
    train = [s for s in rows.samples if rows.splits[s.id] in ("train", None)]
    for sample in train:
        if sample.task is None:
            raise DatasetError(
                f"{rows.where[sample.id]}: task: missing; give the row a task or set "
                "data.default_task",
                key="data.path",
            )
    labels = Counter(str(s.task) for s in train)
    if not train:
        raise DatasetError(f"{path}: no train rows to read data.tasks from", key="data.tasks")
    if len(labels) > 1:
        shown = ", ".join(f"{t} ({n})" for t, n in sorted(labels.items()))
        raise DatasetError(
            f"not set, and the train rows of {path} have {len(labels)} tasks: {shown}; "
            f"set data.tasks to those to train on (e.g. set data.tasks=[{','.join(sorted(labels))}])",
            key="data.tasks",
        )
    (task,) = labels
    # a warning, so the last-resort handler shows it: the command chose a config value
    scorers = [
        f"reward.plugins.{k} ({plugin.name})"
        for k, plugin in enumerate(cfg.reward.plugins)
        if plugin.tasks is None
    ]
    scored = f"; {', '.join(scorers)} score it (tasks null: every task)" if scorers else ""
    # once per run, and into train.log when it opens (`log_once`)
    log_once(
        logger,
        logging.WARNING,
        f"data.tasks not set: [{task}], the one task of the {len(train)} train rows of "
        f"{path}{scored}",
    )
    raw = cfg.model_dump(mode="json")
    raw["data"]["tasks"] = [task]
    return validate_config(raw, source=f"data.tasks [{task}] read from {path}")


def split_key(data: DataConfig, split: str) -> str:
    """The config key naming the file that holds `split`'s rows: `data.<split>_path` when
    set (val/test), else `data.path`."""
    dedicated = {"val": data.val_path, "test": data.test_path}.get(split)
    return f"data.{split}_path" if dedicated else "data.path"


def _split_rows(
    data: DataConfig,
    split: str,
    key: str,
    processor: ImageProcessor | None,
    image_grid: tuple[int, int] | None,
) -> Rows:
    dedicated = {"val": data.val_path, "test": data.test_path}.get(split)
    source = dedicated or data.path
    assert source is not None, "dataset rows are read with data.path set"
    rows = load_rows(source, processor, image_grid, data.default_task)
    if dedicated:
        for sid, value in rows.splits.items():
            if value not in (None, split):
                raise DatasetError(f"{rows.where[sid]}: split: '{value}' row in {key} ({split})")
    else:
        wanted = {split, None} if split == "train" else {split}
        rows = rows.select([rows.splits[s.id] in wanted for s in rows.samples])
        if not rows.samples:
            raise DatasetError(
                f"{source}: no rows with split '{split}'; give rows a split field or set "
                f"data.{split}_path"
            )
    for sample in rows.samples:
        if sample.task is None:
            raise DatasetError(
                f"{rows.where[sample.id]}: task: missing; give the row a task or set "
                "data.default_task"
            )
    tasks = data_tasks(data)
    kept = [s.task in tasks for s in rows.samples]
    present = {s.task for s, k in zip(rows.samples, kept) if k}
    missing = [t for t in tasks if t not in present]
    if missing and (split == "train" or not any(kept)):  # refused before any warning
        labels = Counter(s.task for s in rows.samples)
        has = ", ".join(f"{t} ({n})" for t, n in sorted(labels.items()))
        raise DatasetError(
            f"{source}: no {split} rows of task '{missing[0]}' (data.tasks {data.tasks}); "
            f"its {split} rows' tasks: {has}",
            key="data.tasks",
        )
    left_out = Counter(s.task for s, k in zip(rows.samples, kept) if not k)
    if left_out:
        shown = ", ".join(f"{t}: {n}" for t, n in sorted(left_out.items()))
        # once per run: preflight, training and every evaluation read the split again
        message = f"{key} ({split}): left out rows of tasks not in data.tasks ({shown})"
        log_once(logger, logging.WARNING, message)
    rows = rows.select(kept)
    return rows


def has_split(data: DataConfig, split: str) -> bool:
    """Whether `split` has rows of its own: `data.<split>_path` is set, or some
    `data.path` row's split field names it (train always has rows)."""
    if data.path is None:
        raise ValueError("has_split reads data.path rows; the digits tasks are built in")
    if split == "train" or {"val": data.val_path, "test": data.test_path}.get(split):
        return True
    try:
        rows = load_rows(data.path, None, (1, 1), data.default_task)
    except DatasetError as err:
        raise err.keyed("data.path") from None
    return split in rows.splits.values()


def generates_image(sample: Sample) -> bool:
    """Whether the model's answer to `sample` holds an image (module docstring)."""
    return any(
        p.role == "assistant" and isinstance(p, (ImagePart, GenerationRequest))
        for p in sample.parts
    )


def answer_image_grid(sample: Sample, grid: tuple[int, int]) -> tuple[int, int] | None:
    """(H, W) of the image when `sample`'s whole answer is one image (a target image, of
    its codes' grid or else `grid`, or a `GenerationRequest`); None otherwise. Such a row
    is rolled out as forced image-only generation of exactly H*W positions."""
    answer = [p for p in sample.parts if p.role == "assistant"]
    if len(answer) != 1:
        return None
    part = answer[0]
    if isinstance(part, GenerationRequest):
        return (part.height, part.width)
    if isinstance(part, ImagePart):
        return part.grid or (int(grid[0]), int(grid[1]))
    return None


def check_targets(rows: Rows, tokenizer: PreTrainedTokenizerBase) -> None:
    """Every assistant text maps to known ids: a target holding the unknown id would train
    the model to say `<unk>`. DatasetError "FILE:LINE: ..." naming the first such row."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return
    for sample in rows.samples:
        for part in sample.parts:
            if part.role != "assistant" or not isinstance(part, TextPart):
                continue
            ids = tokenizer.encode(part.text, add_special_tokens=False)
            if unk in ids:
                words = _unknown_words(part.text, tokenizer)
                raise DatasetError(
                    f"{rows.where.get(sample.id, sample.id)}: assistant text {part.text[:40]!r} "
                    f"has {ids.count(unk)} token(s) outside the tokenizer's vocabulary "
                    f"({', '.join(map(repr, words[:3]))}); set data.tokenizer=bpe"
                )


def _unknown_words(text: str, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    pre = tokenizer.backend_tokenizer.pre_tokenizer
    pieces = [p for p, _ in pre.pre_tokenize_str(text)] if pre is not None else text.split()
    unk = tokenizer.unk_token_id
    return [p for p in pieces if unk in tokenizer.encode(p, add_special_tokens=False)]
