"""GRPO numerics as pure functions (formulas in docs/numerics.md §4-7).

- `group_advantages`: A_i = (r_i − mean) / (std + ε) over the prompt group or the batch.
- `clipped_surrogate` / `clipped_surrogate_factors`: the PPO clipped loss per position,
  per factor for BSQ bits (a position's loss is the mean over its L factors).
- `aggregate` with `LossCounts`: token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
  normalised by counts of the *global* batch, so micro-batching never changes the objective.
- `aligned_surrogate` / `aligned_surrogate_factors`: the clipped loss on the replay ratio,
  weighted by the sampler correction, so its value is aligned to the sampler (§5a).
- `kl_penalty` / `kl_penalty_factors` (k1, k2, k3 on sampled actions), `jsd_penalty`
  (full-distribution symmetric JSD), `k3_mismatch` (rollout-vs-replay drift metric).
- Mismatch guards and diagnostics (§7a): `mismatch_delta`, `replay_bound_keep`,
  `percentile_keep` with the global `nearest_rank` threshold, `sequence_k3`.

Sign convention: every loss here is minimised; a positive advantage lowers the loss as
the action's probability rises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from uniweave.core.distributions import TextCategorical, VisualBits
from uniweave.core.sample import validate_groups

Scope = Literal["group", "global"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLKind = Literal["k1", "k2", "k3"]

LOG_RATIO_CLAMP = 20.0
"""|log ρ| and |δ| in k3 are clamped to this before exp, so values stay finite (as verl)."""


def _group_size(n: int, group_size: int | None, sample_ids: Sequence[str] | None) -> int:
    if (group_size is None) == (sample_ids is None):
        raise ValueError("group_advantages: pass exactly one of group_size or sample_ids")
    if sample_ids is not None:
        if len(sample_ids) != n:
            raise ValueError(f"group_advantages: {len(sample_ids)} sample ids for {n} rewards")
        return validate_groups(sample_ids)[1]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if n == 0 or n % group_size:
        raise ValueError(f"{n} rewards do not form groups of {group_size} contiguous members")
    return group_size


def group_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    sample_ids: Sequence[str] | None = None,
    scope: Scope = "group",
    normalize_by_std: bool = True,
    std_ddof: int = 1,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO advantages [N] and diagnostics for rewards [N] in contiguous groups of G.

    Groups are contiguous blocks of G rows (as `Sample.fork` / `validate_groups` make
    them); give G as `group_size`, or `sample_ids` to derive and check it.

        scope "group":  A_i = (r_i − mean_g r) / (std_g r + ε)
        scope "global": A_i = (r_i − mean r) / (std r + ε), over all N rows
        normalize_by_std False: A_i = r_i − mean (Dr.GRPO / DAPO)

    std uses `std_ddof` (1: sample std, verl/TRL, the default; 0: population std).
    A group whose rewards are all equal (std 0) is counted in `frac_zero_std_groups`;
    under scope "group" its advantages are exactly 0. Under scope "global" each row keeps
    r_i − mean (that is what the global baseline means), and a batch whose rewards are all
    equal gets exactly 0 everywhere. Scope "global" uses the rows it is given: under DDP
    the caller must all-gather the rewards of every rank first, or the baseline is one
    shard's. Non-finite rewards raise ValueError naming the row.

    Stats (floats): n_groups, group_size, frac_zero_std_groups, reward_mean, reward_std,
    advantage_mean, advantage_std (population), and the decomposition of the population
    reward variance var_total = var_between (variance of the group means) + var_within
    (mean within-group variance), with between_share / within_share (0 when var_total = 0).
    Under scope "global" the between share is advantage the policy cannot act on.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [N], got {type(rewards).__name__}")
    if scope not in ("group", "global"):
        raise ValueError(f"scope must be 'group' or 'global', got {scope!r}")
    if std_ddof not in (0, 1):
        raise ValueError(f"std_ddof must be 0 or 1, got {std_ddof!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    n = int(rewards.shape[0])
    G = _group_size(n, group_size, sample_ids)
    r64 = rewards.detach().double()
    bad = (~torch.isfinite(r64)).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        who = f" (sample {sample_ids[i]!r})" if sample_ids is not None else ""
        raise ValueError(f"rewards[{i}] is {float(r64[i])}{who}: rewards must be finite")
    if normalize_by_std and std_ddof == 1 and (G if scope == "group" else n) < 2:
        raise ValueError("std with ddof=1 needs at least 2 rewards per baseline")
    r = r64.reshape(n // G, G)
    zero_std = r.amax(1) == r.amin(1)
    if scope == "group":
        mean = r.mean(1, keepdim=True)
        std = r.std(1, correction=std_ddof, keepdim=True) if normalize_by_std else None
        flat_zero = zero_std.unsqueeze(1).expand_as(r)
    else:
        mean = r.mean()
        std = r.std(correction=std_ddof) if normalize_by_std else None
        flat_zero = torch.full_like(r, bool(zero_std.all()), dtype=torch.bool)
    adv = r - mean
    if std is not None:
        adv = adv / (std + eps)
    adv = torch.where(flat_zero, torch.zeros_like(adv), adv).reshape(n)
    group_means = r.mean(1)
    var_total = float(r64.var(correction=0))
    var_between = float(group_means.var(correction=0))
    var_within = float(r.var(1, correction=0).mean())
    stats = {
        "n_groups": float(n // G),
        "group_size": float(G),
        "frac_zero_std_groups": float(zero_std.double().mean()),
        "reward_mean": float(r64.mean()),
        "reward_std": math.sqrt(var_total),
        "advantage_mean": float(adv.mean()),
        "advantage_std": float(adv.std(correction=0)),
        "var_total": var_total,
        "var_between": var_between,
        "var_within": var_within,
        "between_share": var_between / var_total if var_total > 0 else 0.0,
        "within_share": var_within / var_total if var_total > 0 else 0.0,
    }
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv.to(dtype=out_dtype, device=rewards.device), stats


class Surrogate(NamedTuple):
    """Output of the clipped surrogate.

    loss: per element (per position; for factors the mean over L), to be aggregated.
    clipped: the clipped branch is strictly active (per element, or per factor [.., L]).
    dual_clipped: the dual-clip cap is active (A < 0 and ρ·|A| > c·|A|).
    ratio: ρ (per element or per factor).
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor
    ratio: torch.Tensor

    def clip_fraction(self, mask: torch.Tensor | None = None) -> float:
        """Share of (positions or factors) where the clipped branch is active.

        `mask` covers the batch dims of `loss`; for factors it is broadcast over L.
        """
        clipped = self.clipped
        if mask is None:
            return float(clipped.double().mean()) if clipped.numel() else 0.0
        m = mask.bool()
        if clipped.dim() == m.dim() + 1:
            m = m.unsqueeze(-1).expand_as(clipped)
        total = int(m.sum())
        return float((clipped & m).sum()) / total if total else 0.0


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (verl uses 3), got {dual_clip!r}")


def _surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> Surrogate:
    _check_clip(clip_low, clip_high, dual_clip)
    if logp.shape != old_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} differ")
    adv = torch.as_tensor(adv, device=logp.device)
    try:
        shape = torch.broadcast_shapes(adv.shape, logp.shape)
    except RuntimeError:
        shape = None
    if shape != logp.shape:
        raise ValueError(
            f"advantages {tuple(adv.shape)} do not broadcast to logp {tuple(logp.shape)}"
        )
    log_ratio = (logp - old_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = adv.detach().to(ratio.dtype)
    unclipped = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip is None:
        dual = torch.zeros_like(clipped)
    else:
        cap = -adv * dual_clip
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    return Surrogate(loss, clipped, dual, ratio.detach())


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> Surrogate:
    """PPO clipped surrogate per element (verl `compute_policy_loss` semantics).

        ρ = exp(ℓ − ℓ°),  L = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)
        dual clip c (A < 0 only): L = min(L, −c·A)

    i.e. for A > 0 the loss stops improving once ρ > 1 + ε_high; for A < 0 it stops once
    ρ < 1 − ε_low. The dual clip is verl's `clip_ratio_c`: for A < 0, −c·A = c·|A| > 0 caps
    the loss from above, so once ρ > c the loss is the constant c·|A| (zero gradient) and
    an action whose probability grew a lot cannot blow the loss up. `advantages`
    broadcast to `logp`'s shape (e.g. [B, 1] against [B, T]). ℓ° and A are constants
    (detached); log ρ is clamped to ±20 before exp. `clipped` is True where the clipped
    term is the one selected, −clip(ρ)·A > −ρ·A strictly (never where A = 0), as verl's
    `pg_clipfrac`; `dual_clipped` where the cap is active (verl's `pg_clipfrac_lower`).
    """
    return _surrogate(logp, old_logp, advantages, clip_low, clip_high, dual_clip)


def clipped_surrogate_factors(
    logp_factors: torch.Tensor,
    old_logp_factors: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> Surrogate:
    """The clipped surrogate per Bernoulli factor for BSQ bits (docs/numerics.md §5).

    Inputs [..., L] per-factor log-probs of the sampled bits; `advantages` broadcast to
    the batch shape [...] (one advantage per position). For each factor f,
    ρ_f = exp(ℓ_f − ℓ°_f) and L_f = −min(ρ_f·A, clip(ρ_f, 1 − ε_low, 1 + ε_high)·A) (and
    the dual clip, as in `clipped_surrogate`); the position's loss is (1/L) Σ_f L_f, so a
    visual position weighs like one token whatever L is. `clipped`, `dual_clipped` and
    `ratio` are per factor [..., L]; `clip_fraction` is then a share of factors.
    """
    if logp_factors.dim() == 0:
        raise ValueError("logp_factors needs a last (factor) dimension")
    adv = torch.as_tensor(advantages, device=logp_factors.device).unsqueeze(-1)
    out = _surrogate(logp_factors, old_logp_factors, adv, clip_low, clip_high, dual_clip)
    return out._replace(loss=out.loss.mean(-1))


class AlignedSurrogate(NamedTuple):
    """Output of the aligned surrogate (docs/numerics.md §5a).

    loss: per element, sg(w)·L(r) (per position; for factors the mean over L of w_f·L_f).
    clipped, dual_clipped: as `Surrogate`, on the trust-region ratio r.
    ratio: r = exp(ℓ − ℓ°), the replay ratio the clip acts on (per element or factor).
    weight: w = exp(ℓ° − ℓˢ), the sampler correction (per element or factor, detached).
    base_loss: L(r), the unweighted clipped loss per element (the standard surrogate with
    the replay as its old log-prob; per position for factors).
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor
    ratio: torch.Tensor
    weight: torch.Tensor
    base_loss: torch.Tensor


def _aligned(
    logp: torch.Tensor,
    replay_old_logp: torch.Tensor,
    sampled_logp: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> AlignedSurrogate:
    if sampled_logp.shape != logp.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)} and sampled_logp {tuple(sampled_logp.shape)} differ"
        )
    base = _surrogate(logp, replay_old_logp, adv, clip_low, clip_high, dual_clip)
    gap = replay_old_logp.detach() - sampled_logp.detach().to(replay_old_logp)
    weight = torch.exp(gap.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).to(base.loss.dtype)
    return AlignedSurrogate(
        weight * base.loss, base.clipped, base.dual_clipped, base.ratio, weight, base.loss
    )


def aligned_surrogate(
    logp: torch.Tensor,
    replay_old_logp: torch.Tensor,
    sampled_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> AlignedSurrogate:
    """The sampler-aligned score-function surrogate per element (docs/numerics.md §5a).

    With ℓ this forward, ℓ° the replay at the sampling parameters (detached) and ℓˢ the
    sampler's log-prob of the same action:

        r = exp(ℓ − ℓ°)                     trust-region ratio, trainer numerics only
        w = exp(ℓ° − ℓˢ)                    sampler correction, a constant
        L = sg(w) · max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))   [dual clip on L(r)]

    Unclipped, L = −A·ρ̃ with ρ̃ = exp(ℓ − sg(ℓ) + sg(ℓ − ℓˢ)) in value and gradient: the
    value is −A·exp(ℓ − ℓˢ) (the ratio to the sampler's old log-prob), the gradient
    −A·exp(ℓ − ℓˢ)·∇ℓ. Both log-ratios are clamped to ±20 before exp. With ℓˢ = ℓ°
    (sampler = replay) w = 1 exactly and L is `clipped_surrogate(logp, replay_old_logp,
    ...)` bit for bit."""
    return _aligned(logp, replay_old_logp, sampled_logp, advantages, clip_low, clip_high, dual_clip)


def aligned_surrogate_factors(
    logp_factors: torch.Tensor,
    replay_old_factors: torch.Tensor,
    sampled_factors: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> AlignedSurrogate:
    """`aligned_surrogate` per Bernoulli factor for BSQ bits: r_f, w_f and L_f per factor,
    the position's loss the mean over its L factors (as `clipped_surrogate_factors`);
    `loss` and `base_loss` per position, the rest per factor [..., L]."""
    if logp_factors.dim() == 0:
        raise ValueError("logp_factors needs a last (factor) dimension")
    adv = torch.as_tensor(advantages, device=logp_factors.device).unsqueeze(-1)
    out = _aligned(
        logp_factors, replay_old_factors, sampled_factors, adv, clip_low, clip_high, dual_clip
    )
    return out._replace(loss=out.loss.mean(-1), base_loss=out.base_loss.mean(-1))


@dataclass(frozen=True)
class LossCounts:
    """Counts of the *global* batch (all micro-batches and ranks) that normalise the loss.

    n_tokens: scored (masked) positions; n_seqs: sequences with at least one scored
    position. Build one per micro-batch with `from_mask`, add them up (`+`) over the
    micro-batches, and all-reduce (sum) the two integers over ranks before `aggregate`.
    """

    n_tokens: int
    n_seqs: int

    @classmethod
    def from_mask(cls, mask: torch.Tensor, seq_index: torch.Tensor | None = None) -> LossCounts:
        """Counts of one micro-batch: mask [B, T], or flat mask [N] with `seq_index` [N]."""
        m = mask.bool()
        if m.dim() == 2:
            return cls(int(m.sum()), int(m.any(1).sum()))
        if seq_index is None:
            raise ValueError("LossCounts.from_mask: a flat mask needs seq_index")
        return cls(int(m.sum()), int(torch.unique(seq_index[m]).numel()))

    def __add__(self, other: LossCounts) -> LossCounts:
        return LossCounts(self.n_tokens + other.n_tokens, self.n_seqs + other.n_seqs)


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor | None,
    mode: Aggregation,
    counts: LossCounts,
    horizon: int | None = None,
    seq_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-batch's contribution to the global objective (a 0-dim tensor).

    `loss` is per position, [B, T] with `mask` [B, T], or flat [N] with `seq_index` [N]
    (the sequence of each element) and an optional `mask` [N]. With global `counts`:

        token_mean:              Σ L·m / n_tokens
        seq_mean_token_mean:     Σ_i (Σ_t L·m / Σ_t m) / n_seqs
        seq_mean_token_sum_norm: Σ L·m / (n_seqs · H)        (Dr.GRPO, H = `horizon`)

    Summing the returned values over micro-batches (and ranks) gives exactly the loss of
    the whole batch, however it is split, provided a sequence is not split across
    micro-batches. Under DDP, whose backward averages gradients over the world size W,
    multiply by W (or all-reduce with SUM). Masked-out elements never reach the sum (NaN
    there is harmless); a sequence with no scored position contributes 0.
    """
    if mode not in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        raise ValueError(f"unknown aggregation mode {mode!r}")
    if loss.dim() not in (1, 2):
        raise ValueError(f"loss must be [B, T] or flat [N], got shape {tuple(loss.shape)}")
    m = torch.ones_like(loss, dtype=torch.bool) if mask is None else mask.bool()
    if m.shape != loss.shape:
        raise ValueError(f"mask {tuple(m.shape)} does not match loss {tuple(loss.shape)}")
    masked = torch.where(m, loss, torch.zeros_like(loss))
    if mode == "token_mean":
        if counts.n_tokens <= 0:
            raise ValueError("aggregate: the global batch has no scored positions")
        return masked.sum() / counts.n_tokens
    if counts.n_seqs <= 0:
        raise ValueError("aggregate: the global batch has no sequences with scored positions")
    if mode == "seq_mean_token_sum_norm":
        if horizon is None or horizon <= 0:
            raise ValueError(f"seq_mean_token_sum_norm needs a horizon > 0, got {horizon!r}")
        return masked.sum() / (counts.n_seqs * horizon)
    if loss.dim() == 2:
        sums, lengths = masked.sum(1), m.sum(1)
    else:
        if seq_index is None or seq_index.shape != loss.shape:
            raise ValueError("seq_mean_token_mean on a flat loss needs seq_index of its shape")
        n_rows = int(seq_index.max()) + 1 if seq_index.numel() else 0
        sums = masked.new_zeros(n_rows).index_add(0, seq_index, masked)
        lengths = torch.zeros(n_rows, dtype=torch.long, device=loss.device)
        lengths = lengths.index_add(0, seq_index, m.long())
    per_seq = sums / lengths.clamp_min(1).to(sums.dtype)
    return per_seq.sum() / counts.n_seqs


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-element KL estimator on sampled actions, δ = ℓʳ − ℓ (reference detached).

        k1 = −δ = ℓ − ℓʳ;  k2 = ½·δ²;  k3 = exp(δ) − δ − 1  (≥ 0; δ clamped to ±20)

    Under actions drawn from the policy, E[k1] = E[k3] = KL(π ‖ π_ref).
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    delta = ref_logp.detach() - logp
    if kind == "k1":
        return -delta
    if kind == "k2":
        return 0.5 * delta.square()
    if kind == "k3":
        d = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"kl kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def kl_penalty_factors(
    logp_factors: torch.Tensor, ref_logp_factors: torch.Tensor, kind: KLKind
) -> torch.Tensor:
    """BSQ: `kl_penalty` per Bernoulli factor [..., L], then the mean over the L factors.

    Averaging (not summing) keeps a visual position's weight that of one token, like the
    per-factor clip and the factor-averaged JSD.
    """
    return kl_penalty(logp_factors, ref_logp_factors, kind).mean(-1)


def jsd_penalty(
    policy: TextCategorical | VisualBits, reference: TextCategorical | VisualBits
) -> torch.Tensor:
    """Full-distribution symmetric JSD per position [...] to the frozen reference.

        JSD(p ‖ q) = ½·KL(p ‖ m) + ½·KL(q ‖ m),  m = ½(p + q)

    Categorical (text, VQ): over the vocabulary of the processed distributions. BSQ bits:
    the Bernoulli JSD per factor, averaged over the L factors (`VisualBits.jsd`). Both
    distributions must be built with the rollout's temperature / truncation / guidance.
    The reference should hold no gradient (build it from detached logits).
    """
    if isinstance(policy, VisualBits) and isinstance(reference, VisualBits):
        return policy.jsd(reference, beta=0.5)
    if isinstance(policy, TextCategorical) and isinstance(reference, TextCategorical):
        return policy.jsd(reference, beta=0.5)
    raise TypeError(
        f"policy {type(policy).__name__} and reference {type(reference).__name__} "
        "are different action spaces"
    )


def k3_mismatch(
    rollout_logp: torch.Tensor, replay_logp: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Rollout-vs-replay drift: mean over masked positions of k3 with δ = ℓ_replay − ℓ_rollout.

        K3 = mean_t [exp(δ_t) − δ_t − 1]   (≥ 0; estimates KL(π_rollout ‖ π_replay))

    Actions were sampled by the rollout, so this is the unbiased k3 estimator of the KL
    from the sampler's distribution to the trainer's. 0-dim tensor, no gradient; 0 when
    the mask is empty.
    """
    k3 = kl_penalty(rollout_logp.detach(), replay_logp.detach(), "k3")
    m = torch.ones_like(k3, dtype=torch.bool) if mask is None else mask.bool()
    n = int(m.sum())
    if n == 0:
        return k3.new_zeros(())
    return torch.where(m, k3, torch.zeros_like(k3)).sum() / n


# ---------------------------------------------------------------- mismatch (§7a)


def mismatch_delta(
    replay_logp: torch.Tensor, sampled_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Δ = ℓ° − ℓˢ (replay minus sampler) per position in float64, 0 off `mask`, no
    gradient. Both arguments are position-level log-probs [B, T] (BSQ: sums over factors)."""
    delta = replay_logp.detach().double() - sampled_logp.detach().double()
    return torch.where(mask.bool(), delta, torch.zeros_like(delta))


def nearest_rank(values: torch.Tensor, percentile: float) -> float:
    """The p-th percentile of `values` by nearest rank (the inverse empirical CDF, numpy's
    method "inverted_cdf"): the k-th smallest value, k = ⌈n·p/100⌉ (at least 1), i.e. the
    smallest v with at least p% of the values ≤ v. NaN for an empty tensor."""
    if not 0.0 < percentile <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
    flat = values.detach().double().flatten()
    n = int(flat.numel())
    if n == 0:
        return math.nan
    k = min(max(math.ceil(n * (percentile / 100.0)), 1), n)
    return float(torch.kthvalue(flat, k).values)


def replay_bound_keep(delta: torch.Tensor, mask: torch.Tensor, bound: float) -> torch.Tensor:
    """bool [B]: the rows the per-trajectory replay bound keeps. A row's replay/sampler
    ratio is the geometric mean over its scored actions, W = exp(mean_t Δ_t); the row is
    kept when 1/C ≤ W ≤ C, i.e. |mean_t Δ_t| ≤ log C. Rows without scored positions are
    kept (they contribute nothing)."""
    if not bound > 1.0:
        raise ValueError(f"replay bound must be > 1, got {bound!r}")
    m = mask.bool()
    n = m.sum(-1)
    mean = torch.where(m, delta.double(), torch.zeros_like(delta, dtype=torch.float64)).sum(-1)
    mean = mean / n.clamp(min=1)
    return (mean.abs() <= math.log(bound)) | (n == 0)


def percentile_keep(delta: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """bool like `mask`: the scored actions whose |Δ| ≤ `threshold` (the global
    `nearest_rank` of the batch's |Δ|); an action strictly above it is masked."""
    return mask.bool() & (delta.double().abs() <= threshold)


def sequence_k3(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 [B]: k3 of each row's sequence log-ratio δ = Σ_t Δ_t (clamped to ±20),
    exp(δ) − δ − 1: over rows drawn by the sampler its mean estimates the sequence-level
    KL(π_sampler ‖ π_replay). 0 for rows without scored positions."""
    d = torch.where(mask.bool(), delta.double(), torch.zeros_like(delta, dtype=torch.float64))
    d = d.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1
