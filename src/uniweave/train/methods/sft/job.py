"""The SFT job: the training rows walked by a dataset cursor, cross-entropy (+ optional
Information Gain) as the objective."""

from __future__ import annotations

from pathlib import Path

from uniweave.config import ConfigError, UniweaveConfig
from uniweave.config.algorithms import SFTConfig
from uniweave.data.digits_images import load_split
from uniweave.models.base import UnifiedModel
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.protocols import BatchSource, Objective
from uniweave.train.methods.sft.objective import SFTObjective
from uniweave.train.methods.sft.source import DatasetSource, sft_trajectories


def build_sft_job(
    cfg: UniweaveConfig, model: UnifiedModel, run_dir: Path, info: DistInfo
) -> tuple[BatchSource, Objective]:
    """SFT: the serialised training rows walked by a dataset cursor; cross-entropy loss."""
    n_train = cfg.data.train_size
    if not n_train and not cfg.data.path:  # a dataset's own rows need no digits count
        n_train = len(load_split("train"))
    trajs = sft_trajectories(cfg, model, "train", n_train)
    source = DatasetSource(
        trajs, cfg.trainer.global_batch_size, cfg.data.seed, cfg.data.shuffle, cfg.run.seed
    )
    algo = cfg.algorithm
    assert isinstance(algo, SFTConfig), "build_sft_job of an SFT config"
    objective = SFTObjective(algo, model)
    if algo.soft_bsq.weight > 0:
        try:
            objective.projection(model)
        except ValueError as err:
            raise ConfigError(str(err), key="algorithm.soft_bsq.weight") from None
    return source, objective
