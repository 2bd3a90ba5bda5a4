"""Config values read with the types they have once resolved.

`run.output_dir` is never null in a validated config (`RunConfig` fills a null with
runs/<run.name>); `data.tasks` is null until a command resolves it (the digits: [t2i];
data.path: the task labels of its train rows, `uniweave.data.rows.resolve_tasks`).
Code that runs after that reads them here, as a `Path` and a list of task names.
"""

from __future__ import annotations

from pathlib import Path

from uniweave.config.schema import DataConfig, UniweaveConfig


def run_dir(cfg: UniweaveConfig) -> Path:
    """The run directory, `run.output_dir`."""
    if cfg.run.output_dir is None:
        raise ValueError("run.output_dir is unset: the config was not validated")
    return Path(cfg.run.output_dir)


def data_tasks(data: DataConfig) -> list[str]:
    """`data.tasks`, resolved."""
    if data.tasks is None:
        raise ValueError(
            "data.tasks is unresolved: read it after the command resolves it from "
            "data.path's rows (uniweave.data.rows.resolve_tasks)"
        )
    return data.tasks
