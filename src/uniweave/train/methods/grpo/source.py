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
   with the stateless seed `seed_for(run.seed, u, i, m)`; a prompt whose whole answer is
   one image (`answer_image_grid`, read from the row, never from its task name) forces
   an image of that grid (with `rollout.length_semantics: exact` such a row ends
   `length_exact` and is never shaped).
3. Rewards: the reward service scores every row (truncation shaping from finish_reason;
   invalid, wrong and truncated rows stay in their group). The groups' diversity
   (`uniweave.train.onpolicy.diversity`: code distance and Vendi score of image samples,
   distinct answers of text samples) is logged as `diversity/<task>/...`; when a reward
   reads images, the off-target statistics of the images drawn (`images/...`,
   `uniweave.rewards.image_stats`, measured by the reward service on its decoded pixels).
4. Advantages: `group_advantages` with the `algorithm` settings (scope group | global,
   over the whole global batch).

With `algorithm.mismatch.percentile` and one update per batch the rows are anchored the
same way (a no-grad replay at training geometry before the update, not written to disk):
the guard's global threshold is computed from it before the first micro-batch.

Under torchrun the rollout requests are split round-robin across ranks
(`uniweave.rollout.RolloutService`); each rank scores the rows it sampled and the
trajectories and scores are all-gathered (`uniweave.train.onpolicy.scoring.score_sharded`), so every rank
holds the same global batch and computes the same advantages; the trainer then trains
each rank on its shard. Every row carries what the objective needs — its advantage,
sampling record, seed and (several updates per round) anchor log-probs — so the
objective never reads the source.

With `rollout.workers` / `reward.workers` > 0 (one process only) the rollouts and the
scoring run on Ray actors (`uniweave.train.onpolicy.workers`): the driver pushes the policy's weights
as version u before rolling out update u, and the trajectories and rewards are those
of the in-process services.

Fault point for tests: `UNIWEAVE_FAULT=rollout:<n>` SIGKILLs during the rollout of update n
(1-based, as `after_update:<n>`), after its first decode batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from uniweave.algorithms.grpo import group_advantages
from uniweave.algorithms.necessity import rollout_necessity, shaped_rewards
from uniweave.config import UniweaveConfig
from uniweave.config.algorithms import GRPOConfig
from uniweave.core.atomic import atomic_write
from uniweave.core.sample import ImagePart, Sample, TextPart
from uniweave.core.seeding import seed_for
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.models.base import UnifiedModel
from uniweave.rewards import RewardService
from uniweave.rollout import RolloutRequest, RolloutTrajectory
from uniweave.rollout.config import sampling_params
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.onpolicy.diversity import diversity_metrics
from uniweave.train.onpolicy.prompts import PromptSampler, check_exact_length, rollout_request
from uniweave.train.onpolicy.rounds import RolloutSource
from uniweave.train.onpolicy.stats import rollout_stats, task_accuracy
from uniweave.train.onpolicy.workers import RewardWorkers, Workers
from uniweave.train.state.checkpoint import PREFIX, checkpoint_dir

ROUNDS = "rollouts"


@dataclass
class Rollout:
    """The rollout batch of one round of `updates_per_batch` updates: the prompts' group
    members and their trajectories in group order (each trajectory carries its
    advantage, sampling record, seed and, when the round has several updates, its
    anchor log-probs), the rows' rewards, and the rollout/reward/advantage `metrics`."""

    update: int
    samples: list[Sample]
    trajectories: list[RolloutTrajectory]
    rewards: list[float]
    metrics: dict[str, float]


class GRPOSource(RolloutSource):
    """`BatchSource` of GRPO (module docstring), built from the run config (`rollout`,
    `algorithm`, `trainer.global_batch_size`, `run.seed`).

    With `updates_per_batch` K > 1, round r = u // K is rolled out once, at its first
    update rK (prompts and seeds use r), and its later updates reuse it. At rK, before the
    update, `anchor` sets each row's old log-probs (a no-grad replay at training
    geometry) and the round is written atomically to
    `<run_dir>/rollouts/round-NNNNNN-rankR.pt`, so a run resumed in the middle of a round
    trains on exactly the same batch and ratio anchor.
    """

    logs_samples = True

    def __init__(
        self,
        model: UnifiedModel,
        prompts: PromptSampler,
        rewards: RewardService | RewardWorkers,
        cfg: UniweaveConfig,
        info: DistInfo,
        run_dir: Path,
        anchor: Callable[[list[RolloutTrajectory]], None] | None = None,
        workers: Workers | None = None,
    ) -> None:
        """`workers`: the Ray pools (their reward pool, if any, is `rewards`)."""
        r, algo = cfg.rollout, cfg.algorithm
        assert isinstance(algo, GRPOConfig), "GRPOSource of a GRPO config"
        # done by the preflight of `uniweave train`; free here
        check_exact_length(r, tuple(model.codec.grid))
        anchored = algo.updates_per_batch > 1 or algo.mismatch.percentile is not None
        if anchored and anchor is None:
            raise ValueError(
                "updates_per_batch > 1 and mismatch.percentile need an anchor (old log-prob replay)"
            )
        super().__init__(model, rewards, cfg, info, workers)
        self.prompt_sampler = prompts
        self.algo = algo
        self.params = sampling_params(r)
        self.group_size = algo.group_size
        self.n_prompts = cfg.trainer.global_batch_size // algo.group_size
        self.run_seed = cfg.run.seed
        self.pass_threshold = cfg.evaluation.pass_threshold
        self.info = info
        self.run_dir = Path(run_dir)
        self.anchor = anchor

    # -- the trainer's interface ---------------------------------------------------
    def global_batch(self, update: int) -> list[RolloutTrajectory]:
        return self.rollout(update).trajectories

    def batch_metrics(self, update: int) -> dict[str, float]:
        """Rollout, reward and advantage metrics of `update`'s batch (rollout and reward
        times and throughput are 0 on the updates that reuse a round)."""
        metrics = dict(self.rollout(update).metrics)
        first = self.first_of_round(update)
        if not first:
            metrics.update({"time/rollout_s": 0.0, "time/reward_s": 0.0})
            metrics["rollout/tokens_per_s"] = 0.0
        metrics["rollout/reused"] = float(not first)
        return metrics

    def samples(self, update: int, n: int) -> list[dict]:
        """Up to n rows of `update`'s batch, one per prompt: prompt text, response text,
        reward and the response's first image decoded (None without one)."""
        rollout = self.rollout(update)
        out = []
        for i in range(0, len(rollout.trajectories), self.group_size)[:n]:
            parts = self.model.parse_response(rollout.trajectories[i]) or []
            images = [p.codes for p in parts if isinstance(p, ImagePart) and p.codes is not None]
            out.append(
                {
                    "prompt": _text(rollout.samples[i].prompt_parts),
                    "response": _text(parts),
                    "reward": rollout.rewards[i],
                    "image": self.model.codec.decode(images[0][None])[0] if images else None,
                }
            )
        return out

    def rollout_record(self, update: int) -> tuple[list[RolloutTrajectory], dict]:
        """`update`'s trajectories and per-row record (`checkpoint.save_rollouts`): group
        member id, dataset row, reward, advantage, finish reason; whether the update
        reused its round's batch (`updates_per_batch` > 1)."""
        rollout = self.rollout(update)
        rows = [
            {
                "id": sample.id,
                "source_id": sample.meta.get("source_id"),
                "task": sample.task,
                "reward": reward,
                "advantage": traj.advantage,
                "finish_reason": traj.finish_reason,
            }
            for sample, traj, reward in zip(rollout.samples, rollout.trajectories, rollout.rewards)
        ]
        round_info = {"first_update": rollout.update + 1, "reused": not self.first_of_round(update)}
        return rollout.trajectories, {"method": "grpo", "round": round_info, "rows": rows}

    # -- rollouts ------------------------------------------------------------------
    def first_of_round(self, update: int) -> bool:
        """Whether `update` rolls out (the first update of its round)."""
        return update % self.algo.updates_per_batch == 0

    def rollout(self, update: int) -> Rollout:
        """The (cached) rollout batch `update` trains on."""
        start = update - update % self.algo.updates_per_batch
        return self.cached(
            start, lambda: self._make(start) if update == start else self._load(start, update)
        )

    def requests(self, update: int) -> tuple[list[Sample], list[RolloutRequest]]:
        """The G members of every prompt of the round starting at `update`, in group
        order, and their requests (prompts and seeds from the round index)."""
        r = update // self.algo.updates_per_batch
        samples, requests = [], []
        for i, prompt in enumerate(self.prompt_sampler.prompts(r, self.n_prompts)):
            for m in range(self.group_size):
                member = prompt.fork(m)
                seed = seed_for(self.run_seed, r, i, m)
                samples.append(member)
                requests.append(self._request(member, seed))
        return samples, requests

    def _request(self, member: Sample, seed: int) -> RolloutRequest:
        return rollout_request(member, seed, self.params, self.grid)

    def _make(self, update: int) -> Rollout:
        t0 = time.perf_counter()
        samples, requests = self.requests(update)
        indices, local = self.roll_out(update, requests)
        t1 = time.perf_counter()
        trajs, result = self.score(update, samples, local, indices)
        a = self.algo
        total = result.total
        ig_stats: dict[str, float] = {}
        if a.information_gain.weight > 0:
            total, ig_stats = self._information_gain(trajs, result.total, result.tasks)
        adv, adv_stats = group_advantages(
            total,
            sample_ids=[s.id for s in samples],
            scope=a.scope,
            normalize_by_std=a.normalize_by_std,
            std_ddof=a.std_ddof,
            eps=a.eps,
        )
        for traj, value in zip(trajs, adv.tolist()):
            traj.advantage = value
        responses = [self.model.parse_response(t) for t in trajs]
        t2 = time.perf_counter()
        metrics = {
            **result.metrics(),
            **diversity_metrics(samples, responses, result.features),
            **task_accuracy(result, self.pass_threshold),
            **{f"adv/{k}": v for k, v in adv_stats.items()},
            **ig_stats,
            **rollout_stats(trajs, t1 - t0),
            "time/rollout_s": t1 - t0,
            "time/reward_s": t2 - t1,
        }
        rollout = Rollout(update, samples, trajs, result.total.tolist(), metrics)
        if self.anchor is not None:
            self.anchor(trajs)
            if self.algo.updates_per_batch > 1:
                self._save(rollout)
        return rollout

    def _information_gain(
        self, trajs: list[RolloutTrajectory], rewards: torch.Tensor, tasks: list
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """RL IG (docs/numerics.md §3a): the behaviour policy's necessity N_i of each
        row's answer block (fused 11/10 views, no grad, eval mode), the shaped rewards
        r + λ·clip(N, −c, c), and per task `ig/<task>/necessity` (mean N over rows with an
        answer block), `ig/<task>/independent_share` (share with N ≤ 0),
        `ig/<task>/shaping` (mean λ·clip(N)), `ig/<task>/rows`, and `ig/view_calls`."""
        ig = self.algo.information_gain
        batch = TrajectoryBatch.collate(trajs, self.model.special_ids.pad).to(self.model.device)
        necessity, has, calls = rollout_necessity(self.model, batch, ig.chunk_size)
        shaped = shaped_rewards(rewards, necessity, ig.weight, ig.clip)
        stats: dict[str, float] = {"ig/view_calls": float(calls)}
        for task in sorted({t for t in tasks if t is not None}):
            sel = torch.tensor([t == task for t in tasks]) & has
            n = int(sel.sum())
            stats[f"ig/{task}/rows"] = float(n)
            if n:
                stats[f"ig/{task}/necessity"] = float(necessity[sel].mean())
                stats[f"ig/{task}/independent_share"] = float((necessity[sel] <= 0).double().mean())
                delta = (shaped - rewards).double().cpu()[sel]
                stats[f"ig/{task}/shaping"] = float(delta.mean())
        return shaped, stats

    # -- rounds on disk (updates_per_batch > 1) -----------------------------------------
    def _round_path(self, start: int) -> Path:
        return self.run_dir / ROUNDS / f"round-{start:06d}-rank{self.info.rank}.pt"

    def _save(self, rollout: Rollout) -> None:
        """Write the round atomically, and drop rounds older than every checkpoint's."""
        path = self._round_path(rollout.update)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, "wb") as f:
            torch.save(vars(rollout), f)
        ckpts = [
            int(p.name.removeprefix(PREFIX))
            for p in checkpoint_dir(self.run_dir).glob(f"{PREFIX}*")
        ]
        K = self.algo.updates_per_batch
        oldest = min(ckpts, default=0)
        for old in path.parent.glob(f"round-*-rank{self.info.rank}.pt"):
            if int(old.name.split("-")[1]) < oldest - oldest % K:
                old.unlink()

    def _load(self, start: int, update: int) -> Rollout:
        path = self._round_path(start)
        if not path.is_file():
            raise RuntimeError(
                f"update {update + 1} trains on the rollout batch of update {start + 1} "
                f"(updates_per_batch={self.algo.updates_per_batch}), but {path} is missing"
            )
        return Rollout(**torch.load(path, weights_only=False))


def _text(parts) -> str:
    """The text of the text parts, joined by spaces."""
    return " ".join(p.text for p in parts if isinstance(p, TextPart))
