"""The GRPO batch source: prompts -> G rollouts each -> rewards -> advantages.

Update u (0-based) of a run, all deterministic in (config, u) and the parameters at u
(with `algorithm.updates_per_batch` K > 1, read u as the round index u // K, rolled out
at its first update; see `GRPOSource`):

1. Prompts: P = trainer.global_batch_size / G prompts from the *train* split of the
   `data.tasks`. Each task gets a fixed share of the P prompts (largest-remainder
   apportionment of `data.task_weights`, uniform when null); a task's prompts walk a
   fresh permutation of its pool per epoch (seeded by `data.seed`, the task and the
   epoch), so prompts are fresh every update and none repeats within an epoch. Prompt i
   of the update gets id `prompt-i` (its dataset id is kept in meta["source_id"]).
2. Groups: each prompt is forked into G members `prompt-i/m` (`Sample.fork`), rolled out
   with the stateless seed `seed_for(run.seed, u, i, m)`; t2i prompts force an image of
   the codec's grid (with `rollout.length_semantics: exact` such a row ends
   `length_exact` and is never shaped).
3. Rewards: the reward service scores every row (truncation shaping from finish_reason;
   invalid, wrong and truncated rows stay in their group).
4. Advantages: `group_advantages` with the `algorithm` settings (scope group | global,
   over the whole global batch).

Under torchrun the rollout requests are split round-robin across ranks and the
trajectories all-gathered (`all_gather_object`), so every rank holds the same global
batch, scores it (deterministic plugins) and computes the same advantages; the trainer
then trains each rank on its shard. The source caches the latest rollout batch, which the
objective reads by sample id (advantages, sampling records, old log-probs).

Fault point for tests: `UNIRL_FAULT=rollout:<n>` SIGKILLs during the rollout of update n
(1-based, as `after_update:<n>`), after its first decode batch.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from unirl.algorithms.grpo import group_advantages
from unirl.config.algorithms import GRPOConfig
from unirl.core.sample import Sample
from unirl.core.seeding import seed_for
from unirl.models.base import UnifiedModel
from unirl.rewards import RewardError, RewardService
from unirl.rollout import (
    RolloutEngine,
    RolloutRequest,
    RolloutTrajectory,
    SamplingParams,
    SamplingRecord,
    sampling_records,
)
from unirl.train.checkpoint import PREFIX, checkpoint_dir
from unirl.train.distributed import DistInfo
from unirl.train.grpo_metrics import StepStats, finalize_loss_stats, rollout_stats, task_accuracy
from unirl.train.trainer import _inject_fault

ROUNDS = "rollouts"


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
    """Fresh training prompts per update (module docstring, step 1)."""

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


@dataclass
class Rollout:
    """The rollout batch of one round of `updates_per_batch` updates: trajectories in
    group order; per sample id the advantage, the sampling record and (replay anchoring
    with several updates per batch) the old log-probs replayed before the round's first
    step, trimmed to the row's length; `metrics` are the rollout/reward/advantage ones."""

    update: int
    trajectories: list[RolloutTrajectory]
    advantages: dict[str, float]
    records: dict[str, SamplingRecord]
    metrics: dict[str, float]
    old_logp: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class SourceSettings:
    """What the source needs of the config: G, prompts per update, rollout batch size,
    the run seed, optimizer steps per rollout batch, and the sampling parameters of text
    and of forced-image (t2i) rows."""

    group_size: int
    n_prompts: int
    batch_size: int
    run_seed: int
    text_params: SamplingParams
    image_params: SamplingParams
    image_grid: tuple[int, int]
    updates_per_batch: int = 1


class GRPOSource:
    """`BatchSource` of GRPO (module docstring). `stats` collects the objective's sums.

    With `updates_per_batch` K > 1, round r = u // K is rolled out once, at its first
    update rK (prompts and seeds use r), and its later updates reuse it. The round (with
    the old log-probs the objective records at rK) is saved to
    `<run_dir>/rollouts/round-NNNNNN-rankR.pt` after update rK, so a run resumed in the
    middle of a round trains on exactly the same batch and ratio anchor.
    """

    def __init__(
        self,
        model: UnifiedModel,
        prompts: PromptSampler,
        rewards: RewardService,
        algo: GRPOConfig,
        settings: SourceSettings,
        info: DistInfo,
        stats: StepStats,
        run_dir: Path,
    ) -> None:
        self.model = model
        self.engine = RolloutEngine(model, model.tokenizer)
        self.prompt_sampler = prompts
        self.rewards = rewards
        self.algo = algo
        self.s = settings
        self.info = info
        self.stats = stats
        self.run_dir = Path(run_dir)
        self._rollout: Rollout | None = None
        self._train_start = time.perf_counter()

    # -- the trainer's interface ---------------------------------------------------
    def global_batch(self, update: int) -> list[RolloutTrajectory]:
        trajs = self.rollout(update).trajectories
        self._train_start = time.perf_counter()
        return trajs

    def batch_metrics(self, update: int) -> dict[str, float]:
        """Rollout, reward and advantage metrics of `update` with the objective's
        (all-reduced) loss statistics and the train-phase time and throughput."""
        rollout = self.rollout(update)
        train_s = time.perf_counter() - self._train_start
        first = self.first_of_round(update)
        if first and self.s.updates_per_batch > 1:
            self._save(rollout)
        metrics = dict(rollout.metrics)
        if not first:
            metrics.update({"time/rollout_s": 0.0, "time/reward_s": 0.0})
            metrics["rollout/tokens_per_s"] = 0.0
        tokens = sum(len(t) for t in rollout.trajectories)
        sums = self.stats.reduce(update, self.info)
        return {
            **metrics,
            **finalize_loss_stats(sums, self.algo, first),
            "rollout/reused": float(not first),
            "time/train_s": train_s,
            "train/tokens_per_s": tokens / max(train_s, 1e-9),
        }

    # -- rollouts ------------------------------------------------------------------
    def first_of_round(self, update: int) -> bool:
        """Whether `update` rolls out (the first update of its round)."""
        return update % self.s.updates_per_batch == 0

    def rollout(self, update: int) -> Rollout:
        """The (cached) rollout batch `update` trains on."""
        start = update - update % self.s.updates_per_batch
        if self._rollout is None or self._rollout.update != start:
            self._rollout = None
            self._rollout = self._make(start) if update == start else self._load(start, update)
        return self._rollout

    def requests(self, update: int) -> tuple[list[Sample], list[RolloutRequest]]:
        """The G members of every prompt of the round starting at `update`, in group
        order, and their requests (prompts and seeds from the round index)."""
        r = update // self.s.updates_per_batch
        samples, requests = [], []
        for i, prompt in enumerate(self.prompt_sampler.prompts(r, self.s.n_prompts)):
            for m in range(self.s.group_size):
                member = prompt.fork(m)
                seed = seed_for(self.s.run_seed, r, i, m)
                samples.append(member)
                if member.task == "t2i":
                    req = RolloutRequest(
                        member, seed, self.s.image_params, image_grid=self.s.image_grid
                    )
                else:
                    req = RolloutRequest(member, seed, self.s.text_params)
                requests.append(req)
        return samples, requests

    def _generate(self, update: int, requests: list[RolloutRequest]) -> list[RolloutTrajectory]:
        rank, world = self.info.rank, self.info.world_size
        mine = requests[rank::world]
        local: list[RolloutTrajectory] = []
        for start in range(0, len(mine), self.s.batch_size):
            local.extend(self.engine.generate(mine[start : start + self.s.batch_size]))
            _inject_fault("rollout", update + 1)
        if world == 1:
            return local
        gathered: list[list[RolloutTrajectory] | None] = [None] * world
        dist.all_gather_object(gathered, local)
        return [gathered[j % world][j // world] for j in range(len(requests))]

    def _make(self, update: int) -> Rollout:
        t0 = time.perf_counter()
        samples, requests = self.requests(update)
        trajs = self._generate(update, requests)
        t1 = time.perf_counter()
        parsed = [self.model.parse_response(t) for t in trajs]
        try:
            result = self.rewards.score(samples, trajs, parsed)
        except RewardError as err:
            source = {s.group_id: s.meta.get("source_id") for s in samples}
            group = err.sample_ids[0].split("/")[0] if err.sample_ids else ""
            raise RewardError(
                f"update {update + 1}: {err} ({group} is dataset row {source.get(group)!r})",
                err.plugin,
                err.sample_ids,
            ) from err
        a = self.algo
        adv, adv_stats = group_advantages(
            result.total,
            sample_ids=[s.id for s in samples],
            scope=a.scope,
            normalize_by_std=a.normalize_by_std,
            std_ddof=a.std_ddof,
            eps=a.eps,
        )
        t2 = time.perf_counter()
        metrics = {
            **result.metrics(),
            **task_accuracy(result),
            **{f"adv/{k}": v for k, v in adv_stats.items()},
            **rollout_stats(trajs, t1 - t0),
            "time/rollout_s": t1 - t0,
            "time/reward_s": t2 - t1,
        }
        ids = [s.id for s in samples]
        records = dict(zip(ids, sampling_records(trajs)))
        return Rollout(update, trajs, dict(zip(ids, adv.tolist())), records, metrics)

    # -- rounds on disk (updates_per_batch > 1) -----------------------------------------
    def _round_path(self, start: int) -> Path:
        return self.run_dir / ROUNDS / f"round-{start:06d}-rank{self.info.rank}.pt"

    def _save(self, rollout: Rollout) -> None:
        """Write the round atomically, and drop rounds older than every checkpoint's."""
        path = self._round_path(rollout.update)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            torch.save(vars(rollout), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        ckpts = [
            int(p.name.removeprefix(PREFIX))
            for p in checkpoint_dir(self.run_dir).glob(f"{PREFIX}*")
        ]
        K = self.s.updates_per_batch
        oldest = min(ckpts, default=0)
        for old in path.parent.glob(f"round-*-rank{self.info.rank}.pt"):
            if int(old.name.split("-")[1]) < oldest - oldest % K:
                old.unlink()

    def _load(self, start: int, update: int) -> Rollout:
        path = self._round_path(start)
        if not path.is_file():
            raise RuntimeError(
                f"update {update + 1} trains on the rollout batch of update {start + 1} "
                f"(updates_per_batch={self.s.updates_per_batch}), but {path} is missing"
            )
        return Rollout(**torch.load(path, weights_only=False))
