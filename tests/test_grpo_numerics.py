"""GRPO numerics against hand-computed values and independent reference implementations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tolerances import assert_within, elementwise_bound, fp64_bound, magnitude

from uniweave.algorithms.grpo import (
    LossCounts,
    aggregate,
    clipped_surrogate,
    clipped_surrogate_factors,
    group_advantages,
    jsd_penalty,
    k3_mismatch,
    kl_penalty,
    kl_penalty_factors,
)
from uniweave.core.distributions import TextCategorical, VisualBits

EPS = 1e-6

# ---------------------------------------------------------------- advantages

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0])  # 2 groups of 4


def advantage_bound(n: int, std: float) -> float:
    """float32 advantages (r - mean) / (std + eps) of n rewards against float64: the mean
    (n - 1 additions, a division) and the subtraction round at the rewards' scale, then
    divided by std; the std (n squares and additions, a division, a sqrt), + eps and the
    final division are relative errors of the advantage: 2n + 8 roundings at the scale
    max(|r|) / std, which bounds |advantage| too (elementwise_bound, paths=1)."""
    return elementwise_bound(float(REWARDS.abs().max()) / std, 2 * n + 8, paths=1)


def test_group_scope_sample_std() -> None:
    adv, stats = group_advantages(REWARDS, 4, scope="group", std_ddof=1, eps=EPS)
    # group 1: mean 0.5, sample std sqrt(4 * 0.25 / 3); group 2: mean 0.75, sample std 1.5
    s1, s2 = math.sqrt(1 / 3), 1.5
    expected = [
        0.5 / (s1 + EPS),
        -0.5 / (s1 + EPS),
        -0.5 / (s1 + EPS),
        0.5 / (s1 + EPS),
        -0.75 / (s2 + EPS),
        -0.75 / (s2 + EPS),
        -0.75 / (s2 + EPS),
        2.25 / (s2 + EPS),
    ]
    err = (adv.double() - torch.tensor(expected, dtype=torch.float64)).abs()
    assert_within(err, advantage_bound(4, min(s1, s2)), "group advantages")
    assert adv.dtype == torch.float32
    assert stats["frac_zero_std_groups"] == 0.0 and stats["n_groups"] == 2


def test_group_scope_population_std_and_eps() -> None:
    eps = 0.1
    adv, _ = group_advantages(REWARDS, 4, std_ddof=0, eps=eps)
    # population std: group 1 = 0.5, group 2 = sqrt((3 * 0.75^2 + 2.25^2) / 4)
    s2 = math.sqrt((3 * 0.5625 + 5.0625) / 4)
    assert adv[0].item() == pytest.approx(0.5 / (0.5 + eps), rel=1e-6)
    assert adv[1].item() == pytest.approx(-0.5 / (0.5 + eps), rel=1e-6)
    assert adv[7].item() == pytest.approx(2.25 / (s2 + eps), rel=1e-6)


def test_global_scope_both_ddofs() -> None:
    mean = 5.0 / 8
    sq = 2 * (1 - mean) ** 2 + 5 * mean**2 + (3 - mean) ** 2
    for ddof, std in ((0, math.sqrt(sq / 8)), (1, math.sqrt(sq / 7))):
        adv, _ = group_advantages(REWARDS, 4, scope="global", std_ddof=ddof, eps=EPS)
        expected = (REWARDS.double() - mean) / (std + EPS)
        assert_within((adv.double() - expected).abs(), advantage_bound(8, std), f"ddof {ddof}")


def test_normalize_by_std_false() -> None:
    adv, _ = group_advantages(REWARDS, 4, normalize_by_std=False)
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25])
    adv, _ = group_advantages(REWARDS, 4, scope="global", normalize_by_std=False)
    assert adv.tolist() == pytest.approx((REWARDS - 5.0 / 8).tolist())


def test_zero_std_groups_get_exactly_zero() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 0.7, 0.7, 0.7])
    adv, stats = group_advantages(rewards, 3, eps=0.0)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0] and adv[6:].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(adv).all() and adv[3].item() > 0
    assert stats["frac_zero_std_groups"] == pytest.approx(2 / 3)
    # global scope: a constant group keeps r - mean; an all-constant batch is exactly 0
    adv_g, stats_g = group_advantages(rewards, 3, scope="global")
    assert adv_g[0].item() != 0.0 and stats_g["frac_zero_std_groups"] == pytest.approx(2 / 3)
    adv_c, _ = group_advantages(torch.full((6,), 0.3), 3, scope="global", eps=0.0)
    assert adv_c.tolist() == [0.0] * 6


def test_variance_decomposition() -> None:
    _, stats = group_advantages(REWARDS, 4)
    # group means 0.5 and 0.75 -> between = 0.015625; within = mean(0.25, 1.6875)
    assert stats["var_between"] == pytest.approx(0.015625)
    assert stats["var_within"] == pytest.approx((0.25 + 1.6875) / 2)
    assert stats["var_between"] + stats["var_within"] == pytest.approx(stats["var_total"])
    assert stats["between_share"] + stats["within_share"] == pytest.approx(1.0)


def test_advantage_input_errors() -> None:
    with pytest.raises(ValueError, match=r"rewards\[2\] is nan \(sample 'p/2'\)"):
        group_advantages(
            torch.tensor([0.0, 1.0, float("nan"), 1.0]), sample_ids=["p/0", "p/1", "p/2", "p/3"]
        )
    with pytest.raises(ValueError, match=r"rewards\[1\] is inf"):
        group_advantages(torch.tensor([0.0, float("inf")]), 2)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="not contiguous"):
        group_advantages(torch.zeros(4), sample_ids=["a/0", "b/0", "a/1", "b/1"])
    adv, stats = group_advantages(REWARDS, sample_ids=[f"g{k // 4}/{k % 4}" for k in range(8)])
    assert stats["group_size"] == 4 and adv.shape == (8,)


# ---------------------------------------------------------------- clipped surrogate


def reference_surrogate(logp, old, adv, lo, hi, dual=None):
    """Explicit branches: which bound binds depends on the sign of A."""
    r = np.exp(logp - old)
    loss = np.where(adv >= 0, np.where(r > 1 + hi, -(1 + hi) * adv, -r * adv), 0.0)
    loss = np.where(adv < 0, np.where(r < 1 - lo, -(1 - lo) * adv, -r * adv), loss)
    clipped = ((adv > 0) & (r > 1 + hi)) | ((adv < 0) & (r < 1 - lo))
    dual_hit = np.zeros_like(clipped)
    if dual is not None:
        dual_hit = (adv < 0) & (r > dual)
        loss = np.where(dual_hit, -dual * adv, loss)
    grad = np.where(clipped | dual_hit, 0.0, -r * adv)  # d loss / d logp
    return loss, clipped, dual_hit, grad


@pytest.mark.parametrize("dual", [None, 3.0])
def test_clipped_surrogate_matches_reference(dual: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    old = torch.randn(400, generator=g, dtype=torch.float64)
    logp = old + 1.5 * torch.randn(400, generator=g, dtype=torch.float64)  # ratios in ~[0.01, 90]
    adv = torch.randn(400, generator=g, dtype=torch.float64)
    lo, hi = 0.2, 0.28
    r = torch.exp(logp - old)
    assert (r > 1 + hi).any() and (r < 1 - lo).any() and (r > 3).any()
    assert (adv > 0).any() and (adv < 0).any()
    logp.requires_grad_(True)
    out = clipped_surrogate(logp, old, adv, lo, hi, dual)
    out.loss.sum().backward()
    ref, ref_clip, ref_dual, ref_grad = reference_surrogate(
        logp.detach().numpy(), old.numpy(), adv.numpy(), lo, hi, dual
    )
    # float64 against numpy's float64 of the same formula: <= 10 roundings in series (exp
    # at libm's ulp, the products; the clamps are exact), each relative to the value
    # bound: 10 x 2^-53 ~ 1e-15 relative, rtol 1e-12 leaves 1e3; atol floors exact zeros
    np.testing.assert_allclose(out.loss.detach().numpy(), ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(out.clipped.numpy(), ref_clip)
    np.testing.assert_array_equal(out.dual_clipped.numpy(), ref_dual)
    # bound: as the value's: the same formula's gradient, ~10 float64 roundings in series
    np.testing.assert_allclose(logp.grad.numpy(), ref_grad, rtol=1e-12, atol=1e-12)
    assert out.clip_fraction() == pytest.approx(ref_clip.mean())
    if dual is not None:
        assert ref_dual.any()
        neg = adv < 0
        assert (out.loss.detach()[neg] <= -dual * adv[neg] + 1e-12).all()


def test_clipped_surrogate_broadcasts_sequence_advantages() -> None:
    logp = torch.log(torch.tensor([[1.5, 1.0, 0.5], [1.5, 1.0, 0.5]]))
    adv = torch.tensor([[1.0], [-1.0]])
    out = clipped_surrogate(logp, torch.zeros(2, 3), adv, 0.2, 0.2)
    assert torch.allclose(out.loss, torch.tensor([[-1.2, -1.0, -0.5], [1.5, 1.0, 0.8]]))
    assert out.clipped.tolist() == [[True, False, False], [False, False, True]]
    mask = torch.tensor([[True, True, False], [True, True, True]])
    assert out.clip_fraction(mask) == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="broadcast"):
        clipped_surrogate(torch.zeros(2), torch.zeros(2), torch.zeros(3))


def test_per_factor_clipping_on_bits() -> None:
    # one position, L = 4 factors with ratios 1.0, 1.5, 0.9, 0.5
    ratios = torch.tensor([[1.0, 1.5, 0.9, 0.5]])
    old = torch.log(torch.tensor([[0.5, 0.4, 0.6, 0.8]]))
    logp = old + torch.log(ratios)
    pos = clipped_surrogate_factors(logp, old, torch.tensor([1.0]), 0.2, 0.2)
    assert pos.clipped.tolist() == [[False, True, False, False]]  # only 1.5 > 1.2
    assert pos.loss.item() == pytest.approx(-(1.0 + 1.2 + 0.9 + 0.5) / 4)
    assert pos.clip_fraction() == pytest.approx(0.25)
    neg = clipped_surrogate_factors(logp, old, torch.tensor([-2.0]), 0.2, 0.2)
    assert neg.clipped.tolist() == [[False, False, False, True]]  # only 0.5 < 0.8
    assert neg.loss.item() == pytest.approx(2.0 * (1.0 + 1.5 + 0.9 + 0.8) / 4)
    # the product ratio 0.675 would clip the whole position (A > 0: not clipped; A < 0: clipped)
    joint = clipped_surrogate(logp.sum(-1), old.sum(-1), torch.tensor([-2.0]), 0.2, 0.2)
    assert joint.clipped.tolist() == [True]


def test_per_factor_matches_reference_on_random_bits() -> None:
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(5, 7, 16, generator=g, dtype=torch.float64) * 2
    logp = old + 0.6 * torch.randn(5, 7, 16, generator=g, dtype=torch.float64)
    adv = torch.randn(5, 1, generator=g, dtype=torch.float64)  # one per sequence
    out = clipped_surrogate_factors(logp, old, adv, 0.2, 0.3, dual_clip=2.0)
    a = np.broadcast_to(adv.numpy()[:, :, None], logp.shape)
    ref, ref_clip, _, _ = reference_surrogate(logp.numpy(), old.numpy(), a, 0.2, 0.3, 2.0)
    np.testing.assert_allclose(out.loss.numpy(), ref.mean(-1), rtol=1e-12)
    assert out.loss.shape == (5, 7) and out.clipped.shape == (5, 7, 16)
    assert out.clip_fraction() == pytest.approx(ref_clip.mean())
    assert 0 < out.clip_fraction() < 1


# ---------------------------------------------------------------- aggregation

LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, float("nan"), 7.0]])
MASK = torch.tensor([[True, True, True, False], [True, False, False, True]])


def test_aggregation_modes_by_hand() -> None:
    counts = LossCounts.from_mask(MASK)
    assert counts == LossCounts(5, 2)
    total = 1 + 2 + 3 + 4 + 7
    assert aggregate(LOSS, MASK, "token_mean", counts).item() == pytest.approx(total / 5)
    assert aggregate(LOSS, MASK, "seq_mean_token_mean", counts).item() == pytest.approx(
        (6 / 3 + 11 / 2) / 2
    )
    got = aggregate(LOSS, MASK, "seq_mean_token_sum_norm", counts, horizon=10)
    assert got.item() == pytest.approx(total / (2 * 10))


def test_flat_input_matches_padded() -> None:
    flat = LOSS[MASK]
    seq = torch.tensor([0, 0, 0, 1, 1])
    counts = LossCounts.from_mask(torch.ones(5, dtype=torch.bool), seq)
    assert counts == LossCounts(5, 2)
    counts = LossCounts.from_mask(MASK)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        a = aggregate(LOSS, MASK, mode, counts, horizon=8)
        b = aggregate(flat, None, mode, counts, horizon=8, seq_index=seq)
        assert a.item() == pytest.approx(b.item())


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batching_with_global_counts_is_invariant(mode: str) -> None:
    g = torch.Generator().manual_seed(2)
    loss = torch.randn(6, 9, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(6, 9, generator=g) < 0.6
    mask[:, 0] = True
    mask[3] = False  # a row without scored positions
    whole = aggregate(loss, mask, mode, LossCounts.from_mask(mask), horizon=9)
    halves = (slice(0, 2), slice(2, 6))
    counts = LossCounts.from_mask(mask[halves[0]]) + LossCounts.from_mask(mask[halves[1]])
    split = sum(aggregate(loss[s], mask[s], mode, counts, horizon=9) for s in halves)
    assert split.item() == pytest.approx(whole.item(), rel=1e-12)
    grad_whole = torch.autograd.grad(whole, loss)[0]
    grad_split = torch.autograd.grad(split, loss)[0]
    assert torch.allclose(grad_whole, grad_split)
    local = sum(
        aggregate(loss[s], mask[s], mode, LossCounts.from_mask(mask[s]), horizon=9) for s in halves
    )
    assert local.item() != pytest.approx(whole.item())  # local counts change the objective


def test_aggregate_errors() -> None:
    with pytest.raises(ValueError, match="horizon"):
        aggregate(LOSS, MASK, "seq_mean_token_sum_norm", LossCounts(5, 2))
    with pytest.raises(ValueError, match="no scored positions"):
        aggregate(LOSS, MASK, "token_mean", LossCounts(0, 0))
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(LOSS, MASK, "sum", LossCounts(5, 2))


# ---------------------------------------------------------------- KL / JSD


def test_k_estimators_match_formulas() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5, -0.1], dtype=torch.float64)
    d = (ref - logp).numpy()
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1").numpy(), -d)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k2").numpy(), 0.5 * d**2)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3").numpy(), np.exp(d) - d - 1)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_penalty(a, b, "k3") >= 0).all()
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(a, b, "k4")


def test_k1_k3_expectations_equal_kl() -> None:
    """Over actions drawn from the policy, E[k1] = E[k3] = KL(policy || reference) exactly."""
    g = torch.Generator().manual_seed(4)
    logp = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    ref = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    p = logp.exp()
    kl = float((p * (logp - ref)).sum())
    assert float((p * kl_penalty(logp, ref, "k1")).sum()) == pytest.approx(kl)
    assert float((p * kl_penalty(logp, ref, "k3")).sum()) == pytest.approx(kl)


def test_kl_factors_is_mean_over_factors() -> None:
    logp = torch.tensor([[-0.1, -2.0, -0.7]])
    ref = torch.tensor([[-0.3, -0.2, -0.7]])
    d = ref - logp
    expected = (torch.exp(d) - d - 1).mean(-1)
    assert torch.allclose(kl_penalty_factors(logp, ref, "k3"), expected)


def np_jsd(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    m = 0.5 * (p + q)
    return 0.5 * (p * np.log(p / m)).sum(-1) + 0.5 * (q * np.log(q / m)).sum(-1)


def test_categorical_jsd_matches_formula() -> None:
    g = torch.Generator().manual_seed(5)
    z, zr = torch.randn(4, 11, generator=g, dtype=torch.float64), torch.randn(4, 11, generator=g)
    got = jsd_penalty(TextCategorical(z, temperature=0.7), TextCategorical(zr.double(), 0.7))
    p = torch.softmax(z / 0.7, -1).numpy()
    q = torch.softmax(zr.double() / 0.7, -1).numpy()
    np.testing.assert_allclose(got.numpy(), np_jsd(p, q), rtol=1e-10)
    assert (got >= 0).all() and (got <= math.log(2) + 1e-12).all()


def test_bits_jsd_is_factor_mean_of_bernoulli_jsd() -> None:
    g = torch.Generator().manual_seed(6)
    z, zr = torch.randn(3, 8, generator=g, dtype=torch.float64), torch.randn(3, 8, generator=g)
    got = jsd_penalty(VisualBits(z), VisualBits(zr.double()))
    p1, q1 = torch.sigmoid(z).numpy(), torch.sigmoid(zr.double()).numpy()
    per_factor = np_jsd(np.stack([p1, 1 - p1], -1), np.stack([q1, 1 - q1], -1))
    np.testing.assert_allclose(got.numpy(), per_factor.mean(-1), rtol=1e-10)
    with pytest.raises(TypeError, match="action spaces"):
        jsd_penalty(VisualBits(z), TextCategorical(z))


def test_k3_mismatch() -> None:
    rollout = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -9.0]])
    replay = torch.tensor([[-1.2, -1.0, 0.0], [-0.5, -0.4, 5.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    d = (replay - rollout)[mask]
    assert k3_mismatch(rollout, replay, mask).item() == pytest.approx(
        float((torch.exp(d) - d - 1).mean())
    )
    assert k3_mismatch(rollout, rollout, mask).item() == 0.0
    assert k3_mismatch(rollout, replay, torch.zeros_like(mask)).item() == 0.0


def test_blockwise_jsd_and_entropy_match_the_dense_formulas(monkeypatch):
    """The blockwise reductions GRPO uses (`generalized_jsd` at beta 1/2 with its analytic
    backward, `blockwise_entropy`; a few rows at a time) equal the dense generalised JSD
    (autograd gradient) and the entropy, with truncated (top-k, -inf) supports on both
    sides."""
    from uniweave.core import distributions
    from uniweave.core.distributions import (
        blockwise_entropy,
        entropy_from_logp,
        generalized_jsd,
        jsd_from_logp,
    )

    monkeypatch.setattr(distributions, "BLOCK_ELEMENTS", 3 * 50)  # 3 rows per block
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 50, generator=gen, dtype=torch.float64)
    logp_dense = TextCategorical(logits, temperature=0.8, top_k=20).log_probs
    logq = TextCategorical(torch.randn(10, 50, generator=gen, dtype=torch.float64), top_k=30)
    weights = torch.rand(10, generator=gen, dtype=torch.float64)

    def value_and_grad(fn):
        x = logits.clone().requires_grad_(True)
        lp = TextCategorical(x, temperature=0.8, top_k=20).log_probs
        out = fn(lp, logq.log_probs)
        (out * weights).sum().backward()
        return out.detach(), x.grad

    got, got_grad = value_and_grad(lambda p, q: generalized_jsd(p, q, 0.5))
    want, want_grad = value_and_grad(lambda p, q: jsd_from_logp(p, q, 0.5))
    assert torch.isinf(logp_dense).any() and torch.isfinite(got).all()
    # float64, blockwise against dense (fp64_bound): the sums over the 50 classes in both
    # the value and the mixture, and ~10 elementwise roundings (logs, exps, products)
    roundings = 2 * logits.shape[-1] + 10
    assert_within((got - want).abs(), fp64_bound(1.0, roundings), "blockwise jsd")
    assert (got > 0).all()
    tol = fp64_bound(magnitude(want_grad), roundings)
    assert_within((got_grad - want_grad).abs(), tol, "blockwise jsd gradient")
    assert torch.allclose(blockwise_entropy(logp_dense), entropy_from_logp(logp_dense))
