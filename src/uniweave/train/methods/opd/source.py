"""The OPD batch source: fresh prompts -> one student trajectory each -> verification ->
routing -> (ground-truth replay rows).

Update u (0-based), deterministic in (config, u) and the student's parameters at u:

1. Prompts: P = trainer.global_batch_size prompts from the train split of the
   `data.tasks` (`PromptSampler`, as GRPO: fresh every update, none repeated in an epoch).
2. Rollout: one trajectory per prompt from the current student (`RolloutService`), seed
   `seed_for(run.seed, u, i, 0)`, at `rollout.temperature` / `rollout.bit_temperature`
   (`algorithm.student_sampling: greedy` takes the mode); a row whose answer is one image
   is forced into an image of that grid (`rollout_request`).
3. Verification (with reward plugins): each row is scored once by the reward service's
   verifiers; a row is correct when every plugin scoring it passes and it did not end
   truncated (cap / context / cycle: capped rows count as wrong). A failing verifier
   stops the update with an error naming the dataset row (`uniweave.train.onpolicy.rounds`,
   the rollout round GRPO and OPD share).
4. Routing (`algorithm.routing`): `all` distils every row; `correct_only` only the correct
   rows (wrong rows are dropped); `privileged_correction` distils correct rows against the
   plain teacher and wrong rows against the privileged one. With `teacher.privilege:
   answer` every distilled row of `all` / `correct_only` uses the privileged teacher too.
   A distilled row carries a `DistillRecord` (its `SamplingRecord` plus the privileged
   teacher's prompt, or None for the plain teacher): the batch is self-describing, the
   objective never reads the source.
5. GT replay (`algorithm.gt_replay`, budget B): `uniform` adds B train rows drawn
   uniformly (with replacement across tasks' pools, seeded by (run.seed, u)); `failure`
   adds the ground truth of up to B prompts whose row failed (wrong or capped; a seeded
   uniform subset when more failed). GT rows are the full serialised samples (prompt +
   reference answer) with no sampling record: the objective trains them with the SFT
   cross-entropy.

With `rollout.workers` > 0 (one training process) step 2 runs on Ray actors
(`uniweave.train.onpolicy.workers`): before rolling out update u the driver pushes the
student's current trainable weights as version u, the actors decode whole engine
batches of the same requests (same per-row seeds), so the trajectories are the
in-process ones bitwise; with `reward.workers` > 0 step 3's verifiers run on Ray actors.
Routing, GT replay and the teacher's scoring stay in the trainer.

Fault point for tests: `UNIWEAVE_FAULT=rollout:<n>` SIGKILLs during update n's rollout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from uniweave.config import UniweaveConfig
from uniweave.config.algorithms import OPDConfig
from uniweave.core.sample import Sample, TextPart
from uniweave.core.seeding import seed_for
from uniweave.core.trajectory import Trajectory
from uniweave.models.base import UnifiedModel
from uniweave.rewards import RewardService
from uniweave.rollout import RolloutTrajectory, SamplingRecord
from uniweave.rollout.config import sampling_params
from uniweave.rollout.request import prompt_length_of
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.onpolicy.prompts import PromptSampler, rollout_request
from uniweave.train.onpolicy.rounds import RolloutSource
from uniweave.train.onpolicy.stats import rollout_stats, row_passes, task_accuracy
from uniweave.train.onpolicy.workers import RewardWorkers, Workers

GT_STREAM = 0x6774  # seed_for member slot of the GT-replay draws ("gt")


@dataclass(frozen=True)
class DistillRecord(SamplingRecord):
    """A distilled row's sampling record plus the teacher's view: `teacher_prompt` is the
    privileged teacher's prompt (the scored positions follow it one to one), or None for
    the plain teacher (it reads the row as the student did)."""

    teacher_prompt: Trajectory | None = None


def privileged_sample(sample: Sample) -> Sample:
    """`sample`'s prompt with its reference answer appended as a user text part (what a
    `privilege: answer` teacher sees); ValueError for a row without an answer."""
    if sample.answer is None:
        raise ValueError(f"row {sample.id!r} has no answer for the privileged teacher")
    parts = [*sample.prompt_parts, TextPart(f"answer {sample.answer}")]
    return Sample(sample.id, parts, None, sample.task, dict(sample.meta))


def teacher_view(traj: Trajectory, record: DistillRecord) -> Trajectory:
    """The trajectory the teacher scores: the row itself, or its privileged prompt
    followed by the row's response positions (shifted by the prompt-length difference;
    the privileged prompt holds the same images as the row's, plus text)."""
    head = record.teacher_prompt
    if head is None:
        return replace(traj, rollout_logp=None, rollout_logp_factors=None, sampling=None)
    n = prompt_length_of(traj, record)
    return Trajectory(
        token_ids=torch.cat([head.token_ids, traj.token_ids[n:]]),
        modality=torch.cat([head.modality, traj.modality[n:]]),
        owner=torch.cat([head.owner, traj.owner[n:]]),
        visual_codes=torch.cat([head.visual_codes, traj.visual_codes[n:]]),
        image_grids=[*head.image_grids, *traj.image_grids[len(head.image_grids) :]],
        sample_id=traj.sample_id,
        finish_reason=traj.finish_reason,
        length_semantics=traj.length_semantics,
        images=list(head.images),
    )


@dataclass
class OPDBatch:
    """Update u's rows: distilled rollouts then GT rows, and the batch metrics."""

    update: int
    rows: list[Trajectory]
    metrics: dict[str, float]
    sampled: list[RolloutTrajectory]
    record: dict


class OPDSource(RolloutSource):
    """`BatchSource` of OPD (module docstring)."""

    def __init__(
        self,
        model: UnifiedModel,
        teacher: UnifiedModel,
        prompts: PromptSampler,
        rewards: RewardService | RewardWorkers | None,
        cfg: UniweaveConfig,
        info: DistInfo,
        workers: Workers | None = None,
    ) -> None:
        """`workers`: the Ray pools (their reward pool, if any, is `rewards`)."""
        super().__init__(model, rewards, cfg, info, workers)
        self.teacher = teacher
        algo = cfg.algorithm
        assert isinstance(algo, OPDConfig), "OPDSource of an OPD config"
        self.algo = algo
        self.prompt_sampler = prompts
        greedy = self.algo.student_sampling == "greedy"
        self.params = sampling_params(cfg.rollout, greedy=greedy)
        self.n_prompts = cfg.trainer.global_batch_size
        self.run_seed = cfg.run.seed
        self.pass_threshold = cfg.evaluation.pass_threshold

    # -- the trainer's interface ---------------------------------------------------
    def global_batch(self, update: int) -> list[Trajectory]:
        return self._make_cached(update).rows

    def batch_metrics(self, update: int) -> dict[str, float]:
        return dict(self._make_cached(update).metrics)

    def rollout_record(self, update: int) -> tuple[list[RolloutTrajectory], dict]:
        """`update`'s student trajectories (every sampled row, dropped ones too) and the
        record of each row's verification and route, and of the GT replay selection
        (`checkpoint.save_rollouts`)."""
        batch = self._make_cached(update)
        return batch.sampled, batch.record

    def _make_cached(self, update: int) -> OPDBatch:
        return self.cached(update, lambda: self._make(update))

    # -- one update ------------------------------------------------------------------
    def _make(self, update: int) -> OPDBatch:
        t0 = time.perf_counter()
        samples = self.prompt_sampler.prompts(update, self.n_prompts)
        requests = [
            rollout_request(s, seed_for(self.run_seed, update, i, 0), self.params, self.grid)
            for i, s in enumerate(samples)
        ]
        indices, local = self.roll_out(update, requests)
        t1 = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.rewards is not None:
            trajs, result = self.score(update, samples, local, indices)
            correct = (row_passes(result, self.pass_threshold) & ~result.truncated).tolist()
            metrics.update({**result.metrics(), **task_accuracy(result, self.pass_threshold)})
        else:
            trajs = self.gather(samples, local, indices)
            correct = [None] * len(trajs)
        t2 = time.perf_counter()
        rows, counts, routes = self._route(samples, trajs, correct)
        gt, chosen = self._gt_rows(update, samples, trajs, correct)
        metrics.update(rollout_stats(trajs, t1 - t0))
        n_ok = sum(1 for c in correct if c)
        metrics.update(
            {
                **{f"route/{k}": float(v) for k, v in counts.items()},
                "route/correct_frac": n_ok / len(trajs) if self.rewards is not None else -1.0,
                "replay/n_gt_rows": float(len(gt)),
                "time/rollout_s": t1 - t0,
                "time/verify_s": t2 - t1,
            }
        )
        rewards = result.total.tolist() if self.rewards is not None else [None] * len(trajs)
        record = {
            "method": "opd",
            "rows": [
                {
                    "id": s.id,
                    "source_id": s.meta.get("source_id"),
                    "task": s.task,
                    "reward": reward,
                    "correct": ok,
                    "route": route,
                    "finish_reason": t.finish_reason,
                }
                for s, t, reward, ok, route in zip(samples, trajs, rewards, correct, routes)
            ],
            "gt_replay": {"mode": self.algo.gt_replay.mode, "rows": chosen},
        }
        return OPDBatch(update, rows + gt, metrics, trajs, record)

    def _route(
        self, samples: list[Sample], trajs: list[RolloutTrajectory], correct: list[bool | None]
    ) -> tuple[list[Trajectory], dict[str, int], list[str]]:
        """The distilled rows with their `DistillRecord`s, the routing counts, and each
        sampled row's route (plain | privileged | dropped)."""
        a = self.algo
        counts = {"n_plain": 0, "n_privileged": 0, "n_dropped": 0}
        rows: list[Trajectory] = []
        routes: list[str] = []
        for sample, traj, ok in zip(samples, trajs, correct):
            if a.routing == "correct_only" and not ok:
                counts["n_dropped"] += 1
                routes.append("dropped")
                continue
            privileged = a.teacher.privilege != "none"
            if a.routing == "privileged_correction":
                privileged = not ok
            head = None
            if privileged:
                head = self.teacher.prompt_trajectory(privileged_sample(sample))
            counts["n_privileged" if privileged else "n_plain"] += 1
            routes.append("privileged" if privileged else "plain")
            record = DistillRecord(**vars(traj.sampling), teacher_prompt=head)
            rows.append(
                replace(traj, rollout_logp=None, rollout_logp_factors=None, sampling=record)
            )
        return rows, counts, routes

    def _gt_rows(
        self,
        update: int,
        samples: list[Sample],
        trajs: list[RolloutTrajectory],
        correct: list[bool | None],
    ) -> tuple[list[Trajectory], list[dict]]:
        """GT-replay rows of the update (module docstring, step 5) and which dataset rows
        they are (row id `gt-k`, the sample's id and dataset row)."""
        mode, budget = self.algo.gt_replay.mode, self.algo.gt_replay.budget
        if mode == "none":
            return [], []
        rng = np.random.default_rng([self.run_seed, update, GT_STREAM])
        if mode == "uniform":
            pool = [s for t in self.prompt_sampler.tasks for s in self.prompt_sampler.pools[t]]
            chosen = [pool[int(k)] for k in rng.integers(0, len(pool), budget)]
        else:
            failed = [s for s, ok in zip(samples, correct) if not ok]
            if len(failed) > budget:
                failed = [failed[int(k)] for k in sorted(rng.choice(len(failed), budget, False))]
            chosen = failed
        out, which = [], []
        for k, s in enumerate(chosen):
            traj = self.model.prompt_trajectory(s, add_generation_prompt=False)
            out.append(replace(traj, sample_id=f"gt-{k}"))
            which.append({"id": f"gt-{k}", "sample_id": s.id, "source_id": s.meta.get("source_id")})
        return out, which
