"""The GRPO batch source: prompts -> G rollouts each -> rewards -> advantages.

Update u (0-based) of a run, all deterministic in (config, u) and the parameters at u:

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
then trains each rank on its shard. The source caches the latest update's rollout, which
the objective reads by sample id (advantages, sampling records).

Fault point for tests: `UNIRL_FAULT=rollout:<n>` SIGKILLs during the rollout of update n
(1-based, as `after_update:<n>`), after its first decode batch.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from unirl.algorithms.grpo import group_advantages
from unirl.config.algorithms import GRPOConfig
from unirl.core.sample import Sample
from unirl.core.seeding import seed_for
from unirl.core.types import Owner
from unirl.models.base import UnifiedModel
from unirl.rewards import RewardError, RewardResult, RewardService, parse_response
from unirl.rollout import (
    RolloutEngine,
    RolloutRequest,
    RolloutTrajectory,
    SamplingParams,
    SamplingRecord,
    sampling_records,
)
from unirl.train.distributed import DistInfo, all_reduce_sum
from unirl.train.trainer import _inject_fault


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
    """One update's rollout: trajectories in group order, and per sample id the
    advantage and the sampling record; `metrics` are the rollout/reward/advantage ones."""

    update: int
    trajectories: list[RolloutTrajectory]
    advantages: dict[str, float]
    records: dict[str, SamplingRecord]
    metrics: dict[str, float]
    finished_at: float = field(default_factory=time.perf_counter)


class StepStats:
    """Per-update metric sums written by the objective, reduced over ranks on read."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = sorted(keys)
        self._sums: dict[int, dict[str, float]] = {}

    def add(self, update: int, values: dict[str, float]) -> None:
        sums = self._sums.setdefault(update, dict.fromkeys(self.keys, 0.0))
        for key, value in values.items():
            sums[key] += float(value)

    def reduce(self, update: int, info: DistInfo) -> dict[str, float]:
        """The sums of `update` over every rank (a collective: call on all ranks)."""
        sums = self._sums.pop(update, dict.fromkeys(self.keys, 0.0))
        flat = torch.tensor([sums[k] for k in self.keys], dtype=torch.float64)
        flat = all_reduce_sum(flat, info)
        return dict(zip(self.keys, flat.tolist()))


@dataclass(frozen=True)
class SourceSettings:
    """What the source needs of the config: G, prompts per update, rollout batch size,
    the run seed, and the sampling parameters of text and of forced-image (t2i) rows."""

    group_size: int
    n_prompts: int
    batch_size: int
    run_seed: int
    text_params: SamplingParams
    image_params: SamplingParams
    image_grid: tuple[int, int]


class GRPOSource:
    """`BatchSource` of GRPO (module docstring). `stats` collects the objective's sums."""

    def __init__(
        self,
        model: UnifiedModel,
        prompts: PromptSampler,
        rewards: RewardService,
        algo: GRPOConfig,
        settings: SourceSettings,
        info: DistInfo,
        stats: StepStats,
    ) -> None:
        self.model = model
        self.engine = RolloutEngine(model, model.tokenizer)
        self.prompt_sampler = prompts
        self.rewards = rewards
        self.algo = algo
        self.s = settings
        self.info = info
        self.stats = stats
        self._rollout: Rollout | None = None

    # -- the trainer's interface ---------------------------------------------------
    def global_batch(self, update: int) -> list[RolloutTrajectory]:
        return self.rollout(update).trajectories

    def batch_metrics(self, update: int) -> dict[str, float]:
        """Rollout, reward and advantage metrics of `update` with the objective's
        (all-reduced) loss statistics and the train-phase time and throughput."""
        rollout = self.rollout(update)
        train_s = time.perf_counter() - rollout.finished_at
        tokens = sum(len(t) for t in rollout.trajectories)
        return {
            **rollout.metrics,
            **finalize_loss_stats(self.stats.reduce(update, self.info), self.algo),
            "time/train_s": train_s,
            "train/tokens_per_s": tokens / max(train_s, 1e-9),
        }

    # -- rollouts ------------------------------------------------------------------
    def rollout(self, update: int) -> Rollout:
        """The (cached) rollout of `update`."""
        if self._rollout is None or self._rollout.update != update:
            self._rollout = None
            self._rollout = self._make(update)
        return self._rollout

    def requests(self, update: int) -> tuple[list[Sample], list[RolloutRequest]]:
        """The G members of every prompt of `update`, in group order, and their requests."""
        samples, requests = [], []
        for i, prompt in enumerate(self.prompt_sampler.prompts(update, self.s.n_prompts)):
            for m in range(self.s.group_size):
                member = prompt.fork(m)
                seed = seed_for(self.s.run_seed, update, i, m)
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
        parsed = [parse_response(t, self.model.tokenizer) for t in trajs]
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


def task_accuracy(result: RewardResult) -> dict[str, float]:
    """`task/<task>/accuracy`: share of the task's rows that every plugin scoring them
    passes (score >= 0.5: a verifier's 1, or p(target) >= 0.5 for the classifier) and
    that truncation shaping did not overwrite."""
    n = len(result.tasks)
    ok = ~result.overwritten.clone()
    for key, scores in result.per_plugin.items():
        ok &= ~result.applied[key] | (scores >= 0.5)
    out = {}
    for task in sorted({t for t in result.tasks if t is not None}):
        rows = torch.tensor([result.tasks[i] == task for i in range(n)])
        out[f"task/{task}/accuracy"] = float(ok[rows].double().mean())
    return out


def rollout_stats(trajs: Sequence[RolloutTrajectory], seconds: float) -> dict[str, float]:
    """Response lengths (sampled positions per row), finish-reason shares and rollout
    throughput (sampled positions per second)."""
    lengths = torch.tensor([int((t.owner == Owner.POLICY).sum()) for t in trajs], dtype=torch.float64)
    reasons = Counter(t.finish_reason for t in trajs)
    out = {
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/n_rows": float(len(trajs)),
        "rollout/tokens_per_s": float(lengths.sum()) / max(seconds, 1e-9),
    }
    for reason in ("eos", "cap", "context", "cycle", "length_exact", "invalid"):
        out[f"rollout/finish_{reason}_frac"] = reasons.get(reason, 0) / len(trajs)
    return out


LOSS_STAT_KEYS = (
    "n_positions",
    "n_text",
    "n_visual",
    "pg_loss",
    "kl_loss",
    "kl_sum",
    "entropy_text_sum",
    "entropy_visual_sum",
    "ratio_sum",
    "clipped",
    "dual_clipped",
    "k3_sum",
)


def finalize_loss_stats(sums: dict[str, float], algo: GRPOConfig) -> dict[str, float]:
    """Means of the objective's reduced sums (`policy/*`). Under old_logp_source replay
    with one update per batch the ratio is 1 and the clip fraction 0 by construction:
    `policy/ratio_is_one_by_construction` says so."""
    n = max(sums["n_positions"], 1.0)
    by_construction = algo.old_logp_source == "replay" and algo.updates_per_batch == 1
    return {
        "policy/pg_loss": sums["pg_loss"],
        "policy/kl_loss": sums["kl_loss"],
        "policy/kl_ref_mean": sums["kl_sum"] / n,
        "policy/entropy_text": sums["entropy_text_sum"] / max(sums["n_text"], 1.0),
        "policy/entropy_visual": sums["entropy_visual_sum"] / max(sums["n_visual"], 1.0),
        "policy/ratio_mean": sums["ratio_sum"] / n,
        "policy/clip_frac": sums["clipped"] / n,
        "policy/dual_clip_frac": sums["dual_clipped"] / n,
        "policy/ratio_is_one_by_construction": float(by_construction),
        "policy/k3_rollout_vs_replay": sums["k3_sum"] / n,
    }
