"""Does the interleaved task's answer depend on the image the model drew?

For each rollout of a `draw_then_answer` row (the trajectory the evaluation scored,
`uniweave.eval.runner`) the response is cut right after the drawn image's `<|vision_end|>`;
the final answer is then decoded greedily again, teacher-forced over that prefix, twice:

- `unmasked`: with the plain attention mask (under greedy evaluation it reproduces the
  engine's answer: a check);
- `masked`: with the drawn image's visual positions removed from the attention mask, so
  no later position (and no layer) can attend to their keys (the tiny model's mixers
  zero them too).

Both answers are scored by the task's own verifier (`ExactAnswer`) on the trajectory
prefix + decoded answer. Metrics: `draw_then_answer/exact_match_unmasked`,
`.../exact_match_masked_image` and `.../masked_drop` (unmasked - masked). If the answer is
read from the drawn image, masking it drops accuracy toward chance (0.1). The runner
stores each rollout's two scores in its record (`masked`), so the metrics are part of
every evaluation of the task (validation, the final test evaluation, `uniweave eval`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from uniweave.core.sample import Sample
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.core.types import Modality, Owner
from uniweave.models.base import UnifiedModel
from uniweave.rewards.plugins import ExactAnswer, build_responses, parse_response

TASK = "draw_then_answer"
MAX_ANSWER_TOKENS = 4


def cut_after_drawn_image(traj: Trajectory, vision_end: int) -> tuple[Trajectory, int] | None:
    """(prefix through the drawn image's `<|vision_end|>`, index of its first visual
    position); None when the response holds no complete image."""
    drawn = (traj.owner == Owner.POLICY) & (traj.modality == Modality.VISUAL)
    cols = torch.nonzero(drawn).flatten()
    if len(cols) == 0:
        return None
    last = int(cols[-1])
    if last + 1 >= len(traj) or int(traj.token_ids[last + 1]) != vision_end:
        return None
    first = last + 1 - len(cols)
    if not bool(drawn[first : last + 1].all()):
        return None  # several images: not the task's format
    return _slice(traj, last + 2), first


def _slice(traj: Trajectory, end: int) -> Trajectory:
    codes = traj.visual_codes[:end]
    return Trajectory(
        token_ids=traj.token_ids[:end],
        modality=traj.modality[:end],
        owner=traj.owner[:end],
        visual_codes=codes,
        image_grids=list(traj.image_grids),
        sample_id=traj.sample_id,
    )


def _append_text(traj: Trajectory, token: int) -> Trajectory:
    codes = traj.visual_codes
    pad = torch.full((1, *codes.shape[1:]), -1 if codes.dim() == 1 else 0, dtype=codes.dtype)
    return replace(
        traj,
        token_ids=torch.cat([traj.token_ids, torch.tensor([token])]),
        modality=torch.cat([traj.modality, torch.tensor([int(Modality.TEXT)])]),
        owner=torch.cat([traj.owner, torch.tensor([int(Owner.POLICY)])]),
        visual_codes=torch.cat([codes, pad]),
    )


@torch.no_grad()
def last_hidden(
    model: UnifiedModel,
    rows: list[Trajectory],
    drawn_at: list[int],
    n_visual: int,
    mask_image: bool,
) -> torch.Tensor:
    """[B, d] hidden state at each row's last position; with `mask_image`, row r's
    positions [drawn_at[r], drawn_at[r] + n_visual) are out of the attention mask (every
    position keeps its position id: the model's inputs are prepared unmasked)."""
    batch = TrajectoryBatch.collate(rows, model.special_ids.pad, validate=False)
    inputs = model.prepare(batch)
    mask = inputs.attention_mask.clone()
    if mask_image:
        for r, first in enumerate(drawn_at):
            mask[r, first : first + n_visual] = False
    hidden = model.hidden(replace(inputs, attention_mask=mask)).hidden
    return hidden[torch.arange(len(rows)), batch.lengths.to(model.device) - 1]


@torch.no_grad()
def _decode_answers(
    model: UnifiedModel,
    prefixes: list[Trajectory],
    drawn_at: list[int],
    n_visual: int,
    mask_image: bool,
) -> list[Trajectory]:
    """Greedy text continuation of every prefix until `<|im_end|>` (or the cap), with the
    drawn image's [drawn_at, drawn_at + n_visual) positions masked when `mask_image`."""
    eos = model.special_ids.eos
    rows, done = list(prefixes), [False] * len(prefixes)
    for _ in range(MAX_ANSWER_TOKENS):
        last = last_hidden(model, rows, drawn_at, n_visual, mask_image)
        tokens = model.text_logits(last).argmax(-1).tolist()
        for r, tok in enumerate(tokens):
            if not done[r]:
                rows[r] = _append_text(rows[r], int(tok))
                done[r] = int(tok) == eos
        if all(done):
            break
    return rows


@torch.no_grad()
def masked_answer_scores(
    model: UnifiedModel,
    samples: Sequence[Sample],
    trajectories: Sequence[Trajectory],
    batch_size: int = 64,
) -> dict[str, list[float]]:
    """Per row, the `ExactAnswer` score of the answer decoded `unmasked` and with the
    drawn image `masked_image` (module docstring); 0 for a row without a complete drawn
    image. `trajectories[i]` is the evaluation's rollout of `samples[i]`."""
    if len(trajectories) != len(samples):
        raise ValueError(f"{len(trajectories)} trajectories for {len(samples)} samples")
    if any(s.task != TASK for s in samples):
        raise ValueError(f"the masked-answer evaluation scores {TASK} samples only")
    grid = tuple(model.codec.grid)
    vision_end = model.special_ids.vision_end
    cuts = [cut_after_drawn_image(t.to("cpu"), vision_end) for t in trajectories]
    keep = [i for i, c in enumerate(cuts) if c is not None]
    plugin, n_visual = ExactAnswer(), grid[0] * grid[1]
    out = {}
    for name, masked in (("unmasked", False), ("masked_image", True)):
        scores = [0.0] * len(samples)
        for start in range(0, len(keep), batch_size):
            idx = keep[start : start + batch_size]
            kept = [c for c in (cuts[i] for i in idx) if c is not None]  # idx ⊆ keep
            rows = _decode_answers(
                model, [c[0] for c in kept], [c[1] for c in kept], n_visual, masked
            )
            parsed = [parse_response(t, model.tokenizer) for t in rows]
            responses, _ = build_responses(parsed, None)
            for i, s in zip(idx, plugin.score([samples[i] for i in idx], responses)):
                scores[i] = s
        out[name] = scores
    return out


def masked_metrics(unmasked: Sequence[float], masked: Sequence[float]) -> dict[str, float]:
    """The task's metrics (module docstring, without the task prefix) from per-row scores."""
    n = max(len(unmasked), 1)
    out = {"exact_match_unmasked": sum(unmasked) / n, "exact_match_masked_image": sum(masked) / n}
    out["masked_drop"] = out["exact_match_unmasked"] - out["exact_match_masked_image"]
    return out


def evaluate_masked_answer(
    model: UnifiedModel,
    samples: Sequence[Sample],
    trajectories: Sequence[Trajectory],
    batch_size: int = 64,
) -> dict[str, float]:
    """`draw_then_answer/exact_match_unmasked`, `.../exact_match_masked_image` and
    `.../masked_drop` of `samples` from their evaluation rollouts `trajectories`."""
    scores = masked_answer_scores(model, samples, trajectories, batch_size)
    metrics = masked_metrics(scores["unmasked"], scores["masked_image"])
    return {f"{TASK}/{k}": v for k, v in metrics.items()}
