"""Training prompts for rollout methods (GRPO and OPD): the pools, the per-update
sampler, and the rollout request of one row.

Prompts: P prompts per update from the *train* split of the `data.tasks`. Each task gets
a fixed share of the P prompts (largest-remainder apportionment of `data.task_weights`,
uniform when null); a task's prompts walk a fresh permutation of its pool per epoch
(seeded by `data.seed`, the task and the epoch), so prompts are fresh every update and
none repeats within an epoch. Prompt i of the update gets id `prompt-i` (its dataset id
is kept in meta["source_id"]).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from uniweave.config import ConfigError, UniweaveConfig
from uniweave.config.resolved import data_tasks
from uniweave.config.schema import RolloutConfig
from uniweave.core.sample import Sample
from uniweave.data.digits import make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.data.rows import answer_image_grid
from uniweave.models.base import UnifiedModel
from uniweave.models.build import dataset_rows
from uniweave.rewards import check_answers
from uniweave.rollout import RolloutRequest
from uniweave.rollout.params import SamplingParams


def prompt_pools(cfg: UniweaveConfig, model: UnifiedModel) -> dict[str, list[Sample]]:
    """Training prompts per task: the train-split `data.path` rows of each task
    (`dataset_rows`: images through the model's processor; a row a verifier would score
    without its answer is a DatasetError naming its file:line, `check_answers`), or the built-in digits tasks
    on the train split (`data.train_size` per task, 0 = one per train image)."""
    tasks = list(data_tasks(cfg.data))
    if cfg.data.path:
        rows = dataset_rows(cfg, model, "train")
        check_answers(cfg.reward, rows)
        return {t: [s for s in rows.samples if s.task == t] for t in tasks}
    n = cfg.data.train_size or len(load_split("train"))
    return {t: make_task_samples(t, "train", n, seed=cfg.data.seed) for t in tasks}


def check_exact_length(rollout: RolloutConfig, codec_grid: tuple[int, int]) -> None:
    """ConfigError (`rollout.max_new_tokens`) when `length_semantics: exact` forces images
    of the codec's grid but max_new_tokens is not its H*W (the rollout engine would refuse
    the first such row). `uniweave train` checks it in its preflight, before anything is
    written; the batch sources repeat it."""
    g = codec_grid
    if rollout.length_semantics == "exact" and rollout.max_new_tokens != g[0] * g[1]:
        raise ConfigError(
            f"length_semantics 'exact' forces an image of the codec's {g[0]}x{g[1]} "
            f"grid: max_new_tokens must be {g[0] * g[1]}, got {rollout.max_new_tokens}",
            key="rollout.max_new_tokens",
        )


def apportion(n: int, weights: Sequence[float]) -> list[int]:
    """Split n into integer shares proportional to `weights` (largest remainders; ties
    to the earlier entry); every share is n * w / Σw rounded down or up."""
    w = np.asarray(weights, dtype=np.float64)
    exact = n * w / w.sum()
    shares = np.floor(exact).astype(int)
    order = sorted(range(len(w)), key=lambda k: (-(exact[k] - shares[k]), k))
    for k in order[: n - int(shares.sum())]:
        shares[k] += 1
    return [int(s) for s in shares]


class PromptSampler:
    """Fresh training prompts per update (module docstring)."""

    def __init__(
        self, pools: dict[str, list[Sample]], weights: dict[str, float] | None, seed: int
    ) -> None:
        for task, pool in pools.items():
            if not pool:
                raise ValueError(f"the prompt pool of task {task!r} is empty")
        self.pools = pools
        self.tasks = list(pools)
        self.weights = [float((weights or {}).get(t, 1.0)) for t in self.tasks]
        self.seed = seed
        self._perms: dict[tuple[str, int], np.ndarray] = {}

    def _perm(self, task: str, epoch: int) -> np.ndarray:
        key = (task, epoch)
        if key not in self._perms:
            rng = np.random.default_rng([self.seed, zlib.crc32(task.encode()), epoch])
            self._perms = {k: v for k, v in self._perms.items() if k[0] != task}
            self._perms[key] = rng.permutation(len(self.pools[task]))
        return self._perms[key]

    def prompts(self, update: int, n: int) -> list[Sample]:
        """The n prompts of `update`, ids `prompt-0` .. `prompt-{n-1}`."""
        out: list[Sample] = []
        for task, n_task in zip(self.tasks, apportion(n, self.weights)):
            pool = self.pools[task]
            for j in range(n_task):
                epoch, offset = divmod(update * n_task + j, len(pool))
                s = pool[int(self._perm(task, epoch)[offset])]
                meta = {**s.meta, "source_id": s.id}
                out.append(Sample(f"prompt-{len(out)}", list(s.parts), s.answer, s.task, meta))
        return out


def rollout_request(
    member: Sample, seed: int, params: SamplingParams, codec_grid: tuple[int, int]
) -> RolloutRequest:
    """The request of one row. A row whose whole answer is one image (`answer_image_grid`:
    a target image or a generate_image item, never a task name) is forced into an image of
    that grid (under `length_semantics: exact`, of exactly H*W positions); any other row
    is a text request under `params`."""
    grid = answer_image_grid(member, codec_grid)
    if grid is None:
        return RolloutRequest(member, seed, params)
    if params.length_semantics == "exact" and grid != codec_grid:
        params = replace(params, max_new_tokens=grid[0] * grid[1])
    return RolloutRequest(member, seed, params, image_grid=grid)
