"""Per-prompt diversity of GRPO's G samples, logged each rollout as `diversity/<task>/...`.

For each group (the G rollouts of one prompt), then averaged over the task's groups:

- Image responses (a group whose members' responses hold an image; each member's first
  image with codes counts, members without one are left out, a group needs 2):
  - `code_distance`: the mean over member pairs i < j of the share of code-grid positions
    where their codes differ (VQ: the code index; BSQ: the position's bit vector, any bit
    differing). 0 when all G images are the same code grid, 1 when no position agrees.
    Pairs of different grid shapes are left out.
  - `vendi`: the Vendi score (Friedman & Dieng, 2023) of the members' scorer features
    (`RewardResult.features`: the digit classifier's hidden activations or CLIP's image
    embeddings, the first plugin that has them; rows without are left out):
    K_ij = cos(f_i, f_j), λ = eigenvalues of K / n, vendi = exp(-Σ λ log λ) (0 log 0 = 0,
    tiny negative eigenvalues from rounding clipped to 0). 1 when every sample has the
    same feature direction, n when the n directions are orthogonal.
- Text responses (a group with no image in any response): `distinct_answers`, the number
  of distinct response texts (stripped, runs of whitespace as one space; an unparsable
  row is one answer of its own kind), and `distinct_frac` = distinct / G.

`n_groups` metrics (`diversity/<task>/image_groups`, `.../text_groups`) say how many
groups a mean is over; a task without such groups logs none of its metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from uniweave.core.sample import ImagePart, Part, Sample, TextPart

UNPARSED = "\x00unparsed"


def code_distance(codes: Sequence[torch.Tensor]) -> float | None:
    """Mean pairwise share of differing grid positions of `codes` (each VQ long [gh, gw] or
    BSQ float [gh, gw, L]); None without a pair of equal grid shapes."""
    total, pairs = 0.0, 0
    for i in range(len(codes)):
        for j in range(i + 1, len(codes)):
            a, b = codes[i], codes[j]
            if a.shape != b.shape:
                continue
            differ = a != b
            if differ.dim() == 3:
                differ = differ.any(dim=-1)
            total += float(differ.double().mean())
            pairs += 1
    return total / pairs if pairs else None


def vendi_score(features: torch.Tensor | np.ndarray) -> float:
    """exp(entropy of the eigenvalues of K / n), K the cosine-similarity kernel of the n
    rows of `features` [n, d] (module docstring); float64 throughout."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"vendi_score needs features [n, d] with n >= 1, got {list(x.shape)}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if not np.all(norms > 0):
        raise ValueError("vendi_score: a feature vector is zero (its cosine is undefined)")
    unit = x / norms
    lam = np.linalg.eigvalsh(unit @ unit.T / x.shape[0]).clip(min=0.0)
    lam = lam[lam > 0]
    return float(math.exp(-float(np.sum(lam * np.log(lam)))))


def answer_text(parts: Sequence[Part] | None) -> str:
    """The normalised text of a response (module docstring); UNPARSED for None."""
    if parts is None:
        return UNPARSED
    text = "".join(p.text for p in parts if isinstance(p, TextPart))
    return " ".join(text.split())


def first_codes(parts: Sequence[Part] | None) -> torch.Tensor | None:
    """The codes of the first image of a response that has codes, else None."""
    for part in parts or []:
        if isinstance(part, ImagePart) and part.codes is not None:
            return part.codes
    return None


def diversity_metrics(
    samples: Sequence[Sample],
    responses: Sequence[Sequence[Part] | None],
    features: torch.Tensor | None = None,
) -> dict[str, float]:
    """`diversity/<task>/<metric>` means over the groups of each task (module docstring).
    Row i is samples[i] (its group and task) and its parsed response; `features` [N, d]
    the scorer's features (NaN rows: none) or None."""
    if len(samples) != len(responses) or (features is not None and len(features) != len(samples)):
        raise ValueError("diversity_metrics: samples, responses and features differ in length")
    groups: dict[str, list[int]] = {}
    for i, sample in enumerate(samples):
        groups.setdefault(sample.group_id, []).append(i)
    found: dict[str, dict[str, list[float]]] = {}
    for rows in groups.values():
        task = samples[rows[0]].task or "all"
        values = found.setdefault(task, {})
        has_image = [any(isinstance(p, ImagePart) for p in responses[i] or []) for i in rows]
        if any(has_image):
            codes = [c for c in (first_codes(responses[i]) for i in rows) if c is not None]
            distance = code_distance(codes)
            if distance is None:
                continue
            values.setdefault("image_groups", []).append(1.0)
            values.setdefault("code_distance", []).append(distance)
            if features is not None:
                f = features[rows]
                f = f[~torch.isnan(f).any(dim=1)]
                f = f[f.norm(dim=1) > 0]
                if len(f) >= 2:
                    values.setdefault("vendi", []).append(vendi_score(f))
        else:
            distinct = len({answer_text(responses[i]) for i in rows})
            values.setdefault("text_groups", []).append(1.0)
            values.setdefault("distinct_answers", []).append(float(distinct))
            values.setdefault("distinct_frac", []).append(distinct / len(rows))
    out = {}
    for task, metrics in sorted(found.items()):
        for name, vals in metrics.items():
            agg = float(len(vals)) if name.endswith("_groups") else float(np.mean(vals))
            out[f"diversity/{task}/{name}"] = agg
    return out
