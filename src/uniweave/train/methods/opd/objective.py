"""OPD on the shared trainer: the frozen teacher, the objective and the job builder.

The batch comes from `OPDSource` (`uniweave.train.methods.opd.source`): distilled rows (each carrying a
`DistillRecord`) and ground-truth rows (no sampling record). For a micro-batch the
objective computes (docs/numerics.md §9):

- distilled rows: one replay of the student (`replay_map`: heads at scored positions
  only, chunk by chunk, recomputed in backward) and, inside each chunk, the teacher's
  distributions at the same positions rebuilt from its body's hidden states (a
  `ReplayPlan` of the teacher's view of the rows: the row itself or its privileged prompt
  + the same response), both at the row's sampling temperatures. Per position
  D_t = `categorical_divergence` (text, VQ; optional top-K union with a tail and the
  retained-mass guard) or `bernoulli_jsd` (BSQ, mean over the L factors); per row
  D_i = `trajectory_first` over its events (`algorithm.events`) of w_{mod(t)}·D_t.
- GT rows: CE_j = mean over the row's target positions of w_{mod(t)}·CE_t (SFT's text /
  VQ cross-entropy, BSQ bit CE summed over the L bits).

    loss = (Σ_{distilled i with ≥ 1 event} D_i + Σ_{GT j} CE_j) / N_global

with N_global the number of contributing rows of the whole global batch: each
trajectory weighs one, whatever its number of events or positions.

The teacher is loaded from `algorithm.teacher.path` (any registered kind), put in eval
mode with `requires_grad` False, and never handed to the optimizer (the trainer only
optimises the student's parameters). Student and teacher must share the action spaces
(`compare_action_spaces`), checked by `uniweave train`'s preflight from the teacher's
tokenizer and codec files before anything is written, and again on the loaded models.
`teacher_identity` (path and the digest of the directory's file hashes, the cached ones
of the run's input fingerprints) is written into every checkpoint; a resume against a
different teacher is refused.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from uniweave.algorithms.necessity import answer_events, fused_views
from uniweave.algorithms.opd import (
    categorical_divergence,
    clip_text_contribution,
    event_index,
    restrict_events,
    trajectory_first,
)
from uniweave.algorithms.sft import text_ce, visual_ce
from uniweave.config import ConfigError, UniweaveConfig
from uniweave.config.algorithms import OPDConfig
from uniweave.config.fingerprint import path_identity
from uniweave.core.distributions import TextCategorical, VisualBits, bernoulli_jsd, bit_pairs
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.forward import forward_interleaved, scored_mask
from uniweave.models.base import UnifiedModel
from uniweave.models.registry import ModelFacts, load_model
from uniweave.replay import DistributionChunk, ReplayPlan, replay_map
from uniweave.train.engine.protocols import Objective
from uniweave.train.methods.opd.source import DistillRecord, teacher_view

KEY = "algorithm.teacher.path"
EVENT_KINDS = ("text", "visual", "window")


def teacher_identity(path: str | Path) -> dict[str, str]:
    """{"path", "digest"}: the resolved directory and the digest of its files' content
    hashes (`uniweave.config.fingerprint.path_identity`; hashes cached by the run's input
    fingerprints, so a resume does not re-read the teacher)."""
    return path_identity(path)


def compare_action_spaces(student: ModelFacts, teacher: ModelFacts) -> None:
    """ConfigError (naming `algorithm.teacher.path`) unless student and teacher share the
    text vocabulary (the same token -> id map), the visual head (VQ / BSQ), the number of
    visual outputs (codes or bits), the codec grid and, where both codecs expose them, its
    tensors (the same code means the same image). The facts come from the models' small
    files (`uniweave train`'s preflight, `inspect_model`) or from built models
    (`check_action_spaces`)."""
    checks = [
        ("visual head", student.visual_head, teacher.visual_head),
        ("visual outputs (codes or bits)", student.n_visual_outputs, teacher.n_visual_outputs),
        ("codec grid", tuple(student.grid), tuple(teacher.grid)),
    ]
    for what, s, t in checks:
        if s != t:
            raise ConfigError(f"the teacher's {what} is {t}, the student's {s}", key=KEY)
    sv, tv = student.vocab, teacher.vocab
    if sv != tv:
        n = "?" if tv is None else len(tv)
        raise ConfigError(
            f"the teacher's text vocabulary ({n} ids) differs from the student's "
            f"({'?' if sv is None else len(sv)} ids): the text action spaces must match",
            key=KEY,
        )
    sc, tc = student.codec_tensors, teacher.codec_tensors
    if sc is not None and tc is not None:
        same = sc.keys() == tc.keys() and all(torch.equal(sc[k], tc[k]) for k in sc)
        if not same:
            raise ConfigError(
                "the teacher's image codec differs from the student's (codes would mean "
                "different images)",
                key=KEY,
            )


def check_action_spaces(student: UnifiedModel, teacher: UnifiedModel) -> None:
    """`compare_action_spaces` of two built models."""
    compare_action_spaces(ModelFacts.of(student), ModelFacts.of(teacher))


def load_teacher(cfg: UniweaveConfig, student: UnifiedModel) -> UnifiedModel:
    """The frozen teacher (module docstring), on the student's device."""
    algo = cfg.algorithm
    assert isinstance(algo, OPDConfig), "load_teacher of an OPD config"
    path = algo.teacher.path
    if path is None:
        raise ConfigError("the teacher needs a path", key=KEY)
    if not Path(path).is_dir():
        raise ConfigError(f"{path} is not a directory", key=KEY)
    teacher = load_model(path)
    check_action_spaces(student, teacher)  # done from the files by the preflight; free here
    teacher = teacher.to(student.device).eval()
    if next(student.parameters()).dtype == torch.float64:  # trainer.precision fp64
        teacher = teacher.to(torch.float64)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def _stack_columns(d) -> torch.Tensor:
    return torch.stack([d.jsd, d.agree.to(d.jsd), d.retained.to(d.jsd), d.fallback.to(d.jsd)], -1)


class OPDObjective(Objective):
    """The OPD loss of a micro-batch (module docstring)."""

    gradient_parts = ("opd", "gt_replay")

    def in_second_part(self, traj: Trajectory) -> bool:
        return not isinstance(traj.sampling, DistillRecord)

    def __init__(self, algo: OPDConfig, teacher: UnifiedModel, identity: dict[str, str]) -> None:
        self.algo = algo
        self.teacher = teacher
        self.identity = identity
        self._carriers: dict[tuple, tuple[torch.Tensor, float, float]] = {}

    @staticmethod
    def _split(batch: TrajectoryBatch) -> tuple[list[int], list[int]]:
        sampling = batch.sampling or [None] * len(batch)
        distil = [i for i, r in enumerate(sampling) if isinstance(r, DistillRecord)]
        return distil, [i for i, r in enumerate(sampling) if not isinstance(r, DistillRecord)]

    def frozen_models(self) -> list[torch.nn.Module]:
        """The teacher: under fsdp2 sharded with the student (each rank holds its shard,
        gathered per forward), never a full copy per rank."""
        return [self.teacher]

    def after_step(self) -> None:
        """The update is done: forget its carriers (the next batch has new rollouts)."""
        self._carriers.clear()

    def _events(self, batch: TrajectoryBatch):
        """The distilled rows' events; with `carriers: necessity` restricted to the
        teacher's carriers (`carrier_mask`)."""
        events = event_index(
            scored_mask(batch), batch.modality, batch.finish_reasons, self.algo.events
        )
        if self.algo.carriers == "necessity":
            events = restrict_events(events, self.carrier_mask(batch))
        return events

    def carrier_mask(self, batch: TrajectoryBatch) -> torch.Tensor:
        """bool [B, T] of distilled rows: the positions whose teacher necessity n_p =
        ℓ_p(C11) − ℓ_p(C10) (the teacher's own view of the row, the event's source block
        blinded for C10; both views in one fused no-grad batch) is ≥
        `carrier_min_necessity`. Computed once per row set and update (`count` and
        `loss` ask for the same rows; `after_step` forgets them)."""
        key = (tuple(batch.sample_ids), tuple(batch.lengths.tolist()))
        if key not in self._carriers:
            records = _sampling(batch)
            views = [teacher_view(t, r) for t, r in zip(batch.unbatch(), records)]
            shift = [len(v) - len(t) for v, t in zip(views, batch.unbatch())]
            tbatch = TrajectoryBatch.collate(views, batch.pad_id).to(batch.token_ids.device)
            fv = fused_views(
                self.teacher, tbatch, answer_events(tbatch), ("11", "10"), self.algo.chunk_size
            )
            keep = fv.necessity() >= self.algo.carrier_min_necessity
            rows = fv.pos_row[keep].cpu()
            cols = fv.pos_col[keep].cpu() - torch.tensor(shift, dtype=torch.long)[rows]
            mask = torch.zeros(batch.token_ids.shape, dtype=torch.bool)
            mask[rows, cols] = True
            self._carriers[key] = (mask, float(keep.sum()), float(len(keep)))
        return self._carriers[key][0].to(batch.token_ids.device)

    def count(self, batch: TrajectoryBatch) -> int:
        distil, gt = self._split(batch)
        n = len(gt)
        if distil:
            n += int((self._events(batch[distil]).n_events > 0).sum())
        return n

    def _weights(self, batch: TrajectoryBatch) -> torch.Tensor:
        w = self.algo.modality_weights
        visual = batch.modality == Modality.VISUAL
        return torch.where(visual, w.visual, w.text).to(torch.float32)

    def _teacher_plan(self, batch: TrajectoryBatch, records: list[DistillRecord]):
        views = [teacher_view(t, r) for t, r in zip(batch.unbatch(), records)]
        shift = torch.tensor(
            [len(v) - len(t) for v, t in zip(views, batch.unbatch())], device=batch.token_ids.device
        )
        tbatch = TrajectoryBatch.collate(views, batch.pad_id).to(batch.token_ids.device)
        trecords = [
            r if r.teacher_prompt is None else _with_prompt_length(r, len(r.teacher_prompt))
            for r in records
        ]
        with torch.no_grad():
            plan = ReplayPlan(self.teacher, tbatch, trecords, chunk_size=self.algo.chunk_size)
        return plan, shift

    def _position_fn(self, plan: ReplayPlan, shift: torch.Tensor):
        a = self.algo

        def fn(chunk: DistributionChunk) -> torch.Tensor:
            with torch.no_grad():  # same rows, positions shifted by the privileged prompt
                tdist = plan.distribution(chunk.index, chunk.rows, chunk.cols + shift[chunk.rows])
            dist = chunk.dist
            if isinstance(dist, VisualBits):
                if not isinstance(tdist, VisualBits):
                    raise TypeError(f"cannot distil VisualBits from {type(tdist).__name__}")
                ps = bit_pairs(dist.logits)
                with torch.no_grad():
                    qs = bit_pairs(tdist.logits)
                jsd = bernoulli_jsd(ps, qs, a.beta)
                agree = ((ps[..., 0] > ps[..., 1]) == (qs[..., 0] > qs[..., 1])).float().mean(-1)
                one = torch.ones_like(jsd)
                return torch.stack([jsd, agree.to(jsd).detach(), one, one * 0], -1)
            if not isinstance(dist, TextCategorical) or not isinstance(tdist, TextCategorical):
                raise TypeError(f"cannot distil {type(dist).__name__} from {type(tdist).__name__}")
            d = categorical_divergence(
                dist.log_probs, tdist.log_probs, a.beta, a.top_k, a.retained_mass_min
            )
            return _stack_columns(d)

        return fn

    def _distil(self, model: UnifiedModel, batch: TrajectoryBatch):
        records = _sampling(batch)
        t0 = time.perf_counter()
        plan, shift = self._teacher_plan(batch, records)
        t_teacher = time.perf_counter() - t0
        out = replay_map(
            model, batch, records, self._position_fn(plan, shift), chunk_size=self.algo.chunk_size
        )
        mask = scored_mask(batch)
        events = self._events(batch)
        jsd = out[..., 0]
        weighted = jsd * self._weights(batch).to(jsd)
        per_row, means = trajectory_first(weighted, events)
        means = means.detach()
        contributing = events.n_events.to(per_row.device) > 0
        visual = batch.modality == Modality.VISUAL
        clip_stats = {}
        if self.algo.text_clip is not None:
            per_row, t_part, scale = clip_text_contribution(
                weighted, visual, events, self.algo.text_clip
            )
            t_part, scale = t_part.detach()[contributing], scale[contributing]
            clip_stats = {
                "text_clipped_rows": float((scale < 1.0).sum()),
                "text_part_sum": float(t_part.sum()),
                "text_scale_sum": float(scale.sum()),
            }
        stats = _position_stats(out.detach(), mask, visual, batch.is_bits)
        for kind in EVENT_KINDS:
            cells = [
                (b, e) for b, ks in enumerate(events.kinds) for e, k in enumerate(ks) if k == kind
            ]
            rows, cols = zip(*cells) if cells else ((), ())
            stats[f"ev_{kind}_sum"] = float(means[list(rows), list(cols)].sum())  # one sync
            stats[f"ev_{kind}_n"] = float(len(cells))
        stats.update(clip_stats)
        if self.algo.carriers == "necessity":
            _, n_car, n_pos = self._carriers[
                (tuple(batch.sample_ids), tuple(batch.lengths.tolist()))
            ]
            stats["carriers"], stats["carrier_positions"] = n_car, n_pos
        stats["n_distilled"] = float(contributing.sum())
        stats["n_no_event"] = float((~contributing).sum())
        stats["teacher_s"] = t_teacher
        return per_row[contributing].sum(), stats

    def _gt(self, model: UnifiedModel, batch: TrajectoryBatch):
        out = forward_interleaved(model, batch)
        w = self.algo.modality_weights
        per_pos = torch.cat([w.text * text_ce(out.text_logits, out.text_targets),
                             w.visual * visual_ce(out.visual_logits, out.visual_targets)])  # fmt: skip
        rows = torch.cat([out.text_index.rows, out.visual_index.rows])
        sums = per_pos.new_zeros(len(batch)).index_add(0, rows, per_pos)
        counts = per_pos.new_zeros(len(batch)).index_add(0, rows, torch.ones_like(per_pos))
        per_row = sums / counts.clamp_min(1.0)
        return per_row.sum(), {
            "gt_ce_sum": float(per_row.detach().sum()),
            "n_gt": float(len(batch)),
        }

    def loss(
        self, model: UnifiedModel, micro: TrajectoryBatch, n_global: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        distil, gt = self._split(micro)
        total = torch.zeros((), device=micro.token_ids.device)
        stats = _empty_stats()
        if distil:
            value, s = self._distil(model, micro[distil].without_training_data())
            total = total + value
            stats.update(s)
        if gt:
            value, s = self._gt(model, micro[gt])
            total = total + value
            stats.update(s)
        return total / max(n_global, 1), stats

    def _clip_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """With `text_clip`: clipped distilled rows, the mean text part of D_i before the
        clip and the mean scale, over distilled rows with events."""
        if self.algo.text_clip is None:
            return {}
        n = max(sums["n_distilled"], 1.0)
        return {
            "opd/text_clipped_rows": sums["text_clipped_rows"],
            "opd/text_part": sums["text_part_sum"] / n,
            "opd/text_clip_scale": sums["text_scale_sum"] / n,
        }

    def _carrier_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """With `carriers: necessity`: the carriers and their share of the teacher-scored
        event positions."""
        if self.algo.carriers != "necessity":
            return {}
        return {
            "opd/carriers": sums["carriers"],
            "opd/carrier_share": sums["carriers"] / max(sums["carrier_positions"], 1.0),
        }

    def finalize(self, sums: dict[str, float], n_global: int) -> dict[str, float]:
        """Means: `opd/jsd_<modality>` over positions, `opd/jsd_event_<kind>` over events,
        top-1 agreement, retained teacher mass and fallback share (categorical positions),
        GT cross-entropy per GT row, teacher scoring time (an update whose rows were all
        dropped by routing has no sums: its means are 0)."""
        sums = {**_empty_stats(), **sums}
        n_pos = max(sums["n_text"] + sums["n_visual"], 1.0)
        n_cat = max(sums["n_categorical"], 1.0)
        out = {
            "opd/jsd_text": sums["jsd_text_sum"] / max(sums["n_text"], 1.0),
            "opd/jsd_visual": sums["jsd_visual_sum"] / max(sums["n_visual"], 1.0),
            "opd/jsd": (sums["jsd_text_sum"] + sums["jsd_visual_sum"]) / n_pos,
            "opd/top1_agreement": sums["agree_sum"] / n_pos,
            "opd/retained_mass": sums["retained_sum"] / n_cat,
            "opd/fallbacks": sums["fallback_sum"],
            "opd/fallback_frac": sums["fallback_sum"] / n_cat,
            "opd/n_distilled_rows": sums["n_distilled"],
            "opd/n_rows_without_event": sums["n_no_event"],
            "opd/n_gt_rows": sums["n_gt"],
            "opd/gt_ce": sums["gt_ce_sum"] / max(sums["n_gt"], 1.0),
            **self._clip_metrics(sums),
            **self._carrier_metrics(sums),
            "time/teacher_s": sums["teacher_s"],
        }
        for kind in EVENT_KINDS:
            if sums[f"ev_{kind}_n"]:
                out[f"opd/jsd_event_{kind}"] = sums[f"ev_{kind}_sum"] / sums[f"ev_{kind}_n"]
        return out


def _with_prompt_length(record: DistillRecord, n: int) -> DistillRecord:
    return replace(record, prompt_length=n)


def _empty_stats() -> dict[str, float]:
    keys = ["jsd_text_sum", "jsd_visual_sum", "n_text", "n_visual", "agree_sum", "retained_sum",
            "fallback_sum", "n_categorical", "n_distilled", "n_no_event", "teacher_s", "gt_ce_sum",
            "n_gt", "text_clipped_rows", "text_part_sum", "text_scale_sum", "carriers",
            "carrier_positions"] + [f"ev_{k}_{s}" for k in EVENT_KINDS for s in ("sum", "n")]  # fmt: skip
    return dict.fromkeys(keys, 0.0)


def _position_stats(
    out: torch.Tensor, mask: torch.Tensor, visual: torch.Tensor, bits: bool
) -> dict[str, float]:
    """Sums over the scored positions; retained mass and fallbacks over the categorical
    ones (text, and VQ visual positions)."""
    text_m, vis_m = mask & ~visual, mask & visual
    jsd, agree, retained, fallback = out.unbind(-1)
    cat = text_m if bits else mask
    return {
        "jsd_text_sum": float(jsd[text_m].sum()),
        "jsd_visual_sum": float(jsd[vis_m].sum()),
        "n_text": float(text_m.sum()),
        "n_visual": float(vis_m.sum()),
        "agree_sum": float(agree[mask].sum()),
        "retained_sum": float(retained[cat].sum()),
        "fallback_sum": float(fallback[cat].sum()),
        "n_categorical": float(cat.sum()),
    }


def _sampling(batch: TrajectoryBatch) -> list[Any]:
    """The rows' sampling records (the OPD source attaches one to every row)."""
    if batch.sampling is None:
        raise ValueError(f"rows {batch.sample_ids[:3]} carry no sampling records")
    return list(batch.sampling)
