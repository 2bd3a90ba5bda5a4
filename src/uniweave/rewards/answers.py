"""Dataset rows against the verifiers that read them.

A plugin that compares a response with the row's `answer` (`RewardPlugin.requires_answer`:
mc_exact, text_exact, exact_answer) needs every row it scores (its `tasks`; null = every
row) to carry one, and one it can verify (`RewardPlugin.answer_problem`, e.g. mc_exact's
letter A-D). `check_answers` finds the first row that does not, as a one-line
`DatasetError` "FILE:LINE: answer: ..."; `check_dataset_answers` runs it on a config's
data.path splits before anything is written (the GRPO job builder, `uniweave eval`, and the
training preflight call it).
"""

from __future__ import annotations

from collections.abc import Sequence

from uniweave.config.schema import RewardConfig, UniweaveConfig
from uniweave.data.loader import DatasetError, Rows
from uniweave.data.rows import has_split, split_key, split_rows
from uniweave.rewards.plugins import find_plugin_class


def check_answers(reward: RewardConfig, rows: Rows) -> None:
    """DatasetError naming the first row of `rows` a configured plugin would score against
    an answer the row lacks or the plugin cannot verify (module docstring)."""
    for k, plugin in enumerate(reward.plugins):
        cls = find_plugin_class(plugin.name)
        if cls is None or not cls.requires_answer:
            continue
        tasks = None if plugin.tasks is None else set(plugin.tasks)
        for sample in rows.samples:
            if tasks is not None and sample.task not in tasks:
                continue
            where = rows.where.get(sample.id, sample.id)
            if sample.answer is None:
                raise DatasetError(
                    f"{where}: answer: missing; reward.plugins.{k} ({plugin.name}) compares "
                    f"the responses of task '{sample.task}' with the row's answer"
                )
            problem = cls.answer_problem(sample.answer)
            if problem is not None:
                raise DatasetError(
                    f"{where}: answer: {problem} (reward.plugins.{k}: {plugin.name})"
                )


def check_dataset_answers(cfg: UniweaveConfig, splits: Sequence[str] = ("train",)) -> None:
    """`check_answers` on the data.path rows of each of `splits` that has rows (the rows'
    text and answers only: no model, no image processing); nothing for the digits tasks,
    whose rows always carry their answers."""
    if cfg.data.path is None or not cfg.reward.plugins:
        return
    for split in splits:
        if has_split(cfg.data, split):
            try:
                check_answers(cfg.reward, split_rows(cfg.data, split, image_grid=(1, 1)))
            except DatasetError as err:  # a row's answer: the key naming its file
                raise err.keyed(split_key(cfg.data, split)) from None
