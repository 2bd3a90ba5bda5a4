"""Rollout-training mismatch (issue 33, GRPO part; docs/numerics.md §5a, §7a): the aligned
surrogate against an independent computation, the replay-bound and percentile guards
against numpy references on a batch split over micro-batches and over two gloo ranks,
the separated diagnostics, the knobs' effect on the loss and the config refusals.

Tolerances. The pure-function tests take float32 inputs and compare with float64
references: the surrogate is a handful of float32 operations (two subtractions, two exps,
a clamp, two products) on log-ratios |x| ≤ 3, each rounding by at most 2^-24 ≈ 6e-8
relative, so the value and gradient agree to ≲ 8 · 6e-8 ≈ 5e-7 relative: rtol 1e-6.
The objective tests compare a loss summed over micro-batches with the unsplit one (float32
sums in another order: 1e-6, docs/numerics.md §15); which actions a guard masks is
compared exactly.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from mismatch_ranks import rank_worker
from pydantic import ValidationError
from rollout_fixtures import mixed_requests, mixed_samples, tiny_model
from tolerances import (
    assert_within,
    elementwise_bound,
    gradient_reductions,
    logprob_bound,
    magnitude,
    reduction_bound,
    tiny_decoder_reductions,
)

from uniweave.algorithms.grpo import (
    aligned_surrogate,
    aligned_surrogate_factors,
    clipped_surrogate,
    clipped_surrogate_factors,
    mismatch_delta,
    nearest_rank,
    percentile_keep,
    replay_bound_keep,
    sequence_k3,
)
from uniweave.config import validate_config
from uniweave.config.algorithms import GRPOConfig
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.forward import scored_mask
from uniweave.replay import replay_logprobs
from uniweave.rollout import RolloutEngine, SamplingParams
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.methods.grpo.mismatch import global_threshold
from uniweave.train.methods.grpo.objective import GRPOObjective

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on 1 thread


# ---------------------------------------------------------------- aligned surrogate


def fixed_logps(shape, seed: int = 0):
    """ℓ (this forward), ℓ° (replay at θ_old), ℓˢ (sampler) and A, float32; the policy moved
    (ℓ − ℓ° up to ±0.6, both clip sides) and the sampler disagrees (Δ up to ±0.5)."""
    g = torch.Generator().manual_seed(seed)
    replay_old = -torch.rand(shape, generator=g) * 3
    logp = replay_old + 0.3 * torch.randn(shape, generator=g)
    sampled = replay_old - 0.25 * torch.randn(shape, generator=g)
    adv = torch.randn(shape[:1] + (1,) * (len(shape) - 1), generator=g)
    return logp, replay_old, sampled, adv


def reference_aligned(logp, old, sampled, adv, lo, hi, dual):
    """float64, written from the formula: where the clip is inactive the loss is −A·ρ̃ with
    ρ̃ = exp(ℓ − sg ℓ + sg(ℓ − ℓˢ)) (autograd through ρ̃), elsewhere the constant
    −A·w·clip(r) or the dual cap −c·A·w; returns (loss, d loss / d ℓ)."""
    x = logp.double().clone().requires_grad_(True)
    old, sampled, a = old.double(), sampled.double(), adv.double().expand_as(x)
    rho = torch.exp(x - x.detach() + (x - sampled).detach())
    r = torch.exp(x.detach() - old)
    w = torch.exp(old - sampled)
    clipped = ((a > 0) & (r > 1 + hi)) | ((a < 0) & (r < 1 - lo))
    loss = torch.where(clipped, -a * w * r.clamp(1 - lo, 1 + hi), -a * rho)
    if dual is not None:
        capped = (a < 0) & (r > dual)
        loss = torch.where(capped, -dual * a * w, loss)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    return loss.detach(), grad, clipped


SURROGATE_OPS = 10
"""Roundings of a float32 surrogate term against the float64 formula: the log-ratio's
subtraction (1), exp (2: libm's ulp), that argument's rounding carried by exp at
|log-ratio| <= 2 (2), the weight's subtraction and exp (3), the products with A and w (2);
the clamp and the where are exact. Its gradient: the same chain through exp's backward."""


@pytest.mark.parametrize("dual", [None, 1.3])
def test_aligned_surrogate_value_and_gradient_equal_the_formula(dual):
    logp, old, sampled, adv = fixed_logps((6, 40))
    lo, hi = 0.2, 0.25
    x = logp.clone().requires_grad_(True)
    out = aligned_surrogate(x, old, sampled, adv, lo, hi, dual)
    out.loss.sum().backward()
    want, want_grad, clipped = reference_aligned(logp, old, sampled, adv, lo, hi, dual)
    assert clipped.any() and (~clipped).any()
    # float32 elementwise chains on float32 inputs against float64 (elementwise_bound,
    # paths=1, per element): SURROGATE_OPS roundings at the value's own scale
    tol = elementwise_bound(want, SURROGATE_OPS, paths=1)
    assert_within((out.loss.detach().double() - want).abs(), tol, "aligned value")
    tol = elementwise_bound(want_grad, SURROGATE_OPS, paths=1)
    assert_within((x.grad.double() - want_grad).abs(), tol, "aligned gradient")
    assert torch.equal(out.clipped, clipped)
    # the value is aligned to the sampler: unclipped, −A·exp(ℓ − ℓˢ), not −A·exp(ℓ − ℓ°)
    free = ~clipped & ~out.dual_clipped
    sampled_ratio = torch.exp(logp.double() - sampled.double())
    np.testing.assert_allclose(
        out.loss.detach().double()[free], (-adv.double() * sampled_ratio)[free], rtol=1e-6
    )
    np.testing.assert_allclose(
        out.weight.double(), torch.exp(old.double() - sampled.double()), rtol=1e-6
    )


def test_aligned_equals_standard_bit_for_bit_when_sampler_is_replay():
    logp, old, _, adv = fixed_logps((5, 30), seed=1)
    x1, x2 = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    a = aligned_surrogate(x1, old, old.clone(), adv, 0.2, 0.2, 2.0)
    s = clipped_surrogate(x2, old, adv, 0.2, 0.2, 2.0)
    a.loss.sum().backward()
    s.loss.sum().backward()
    assert torch.equal(a.loss, s.loss) and torch.equal(x1.grad, x2.grad)
    assert torch.equal(a.weight, torch.ones_like(a.weight))
    f = torch.randn(5, 30, 4, generator=torch.Generator().manual_seed(2)) * 0.1 - 0.7
    af = aligned_surrogate_factors(f + 0.05, f, f.clone(), adv)
    sf = clipped_surrogate_factors(f + 0.05, f, adv)
    assert torch.equal(af.loss, sf.loss)


def test_aligned_factors_are_the_factor_mean_of_the_formula():
    logp, old, sampled, adv = fixed_logps((4, 9, 6), seed=3)
    x = logp.clone().requires_grad_(True)
    out = aligned_surrogate_factors(x, old, sampled, adv[:, :, 0], 0.2, 0.2)
    out.loss.sum().backward()
    want, want_grad, _ = reference_aligned(logp, old, sampled, adv, 0.2, 0.2, None)
    assert out.loss.shape == (4, 9) and out.weight.shape == (4, 9, 6)
    # the per-term chain, then the mean over the 6 factors: 5 additions and a division
    # (relative to the terms' scale, which the mean of |terms| bounds)
    tol = elementwise_bound(want.abs().mean(-1), SURROGATE_OPS + 6, paths=1)
    assert_within((out.loss.detach().double() - want.mean(-1)).abs(), tol, "factor mean")
    tol = elementwise_bound(want_grad / 6, SURROGATE_OPS + 1, paths=1)
    assert_within((x.grad.double() - want_grad / 6).abs(), tol, "factor gradient")


def test_on_policy_aligned_gradient_is_the_score_function():
    """One update per batch with sampler = replay: ℓ° = ℓˢ = sg(ℓ), and the summed aligned
    loss has the gradient of −Σ_t A·ℓ_t = −A·∇log π(τ) (REINFORCE) with respect to the
    logits every position's log-prob comes from."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 7, 11, generator=g, dtype=torch.float64, requires_grad=True)
    actions = torch.randint(0, 11, (3, 7), generator=g)
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64)

    def logp_of(z):
        return torch.log_softmax(z, -1).gather(-1, actions[..., None])[..., 0]

    ell = logp_of(logits)
    out = aligned_surrogate(ell, ell.detach(), ell.detach().clone(), adv)
    (grad,) = torch.autograd.grad(out.loss.sum(), logits)
    (score,) = torch.autograd.grad((-adv * logp_of(logits)).sum(), logits)
    # rho = exp(l - sg l + sg(l - l)) = exp(0) = 1 exactly, so d loss / d l = -A, the
    # score path's, and both go back through the same log_softmax: the same bits
    assert torch.equal(grad, score)
    assert torch.equal(out.loss.detach(), (-adv).expand(3, 7))


# ---------------------------------------------------------------- guards (pure)


def np_percentile_mask(abs_delta: np.ndarray, p: float) -> tuple[float, np.ndarray]:
    q = float(np.percentile(abs_delta, p, method="inverted_cdf"))
    return q, abs_delta > q


def test_nearest_rank_is_numpys_inverted_cdf():
    g = torch.Generator().manual_seed(5)
    for n in (1, 2, 7, 10, 100, 1001):
        x = torch.rand(n, generator=g, dtype=torch.float64)
        x[: n // 3] = 0.0  # ties
        for p in (0.1, 10.0, 33.3, 50.0, 70.0, 90.0, 99.0, 99.9, 100.0):
            want = float(np.percentile(x.numpy(), p, method="inverted_cdf"))
            assert nearest_rank(x, p) == want, (n, p)
    assert math.isnan(nearest_rank(torch.zeros(0), 50.0))


def test_guards_mask_what_numpy_masks_however_the_batch_is_split():
    g = torch.Generator().manual_seed(6)
    B, T = 12, 20
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[3] = False  # a row with no scored action
    scale = torch.linspace(0.01, 0.6, B)[:, None]  # rows drift more and more
    replay = -torch.rand(B, T, generator=g) * 2
    sampled = replay - scale * torch.randn(B, T, generator=g) - scale * 0.5
    delta = mismatch_delta(replay, sampled, mask)
    d, m = delta.numpy(), mask.numpy()
    # replay bound: rows whose |mean Δ| over scored actions exceeds log C
    C = 1.2
    row_mean = np.array([d[i][m[i]].mean() if m[i].any() else 0.0 for i in range(B)])
    want_rows = np.abs(row_mean) <= math.log(C)
    assert not want_rows.all() and want_rows.any()
    assert np.array_equal(replay_bound_keep(delta, mask, C).numpy(), want_rows)
    # percentile over the whole population, applied per micro-batch
    p = 80.0
    q, above = np_percentile_mask(np.abs(d[m]), p)
    want_keep = np.zeros_like(m)
    want_keep[m] = ~above
    for split in ([slice(0, B)], [slice(0, 5), slice(5, B)], [slice(i, i + 1) for i in range(B)]):
        local = [delta[s][mask[s]].abs() for s in split]
        thr = global_threshold(local, p, DistInfo())
        assert thr == q
        got = torch.cat([percentile_keep(delta[s], mask[s], thr) for s in split])
        assert np.array_equal(got.numpy(), want_keep)
    assert 0 < above.sum() <= math.ceil(0.2 * m.sum())
    # the max of per-row quantiles is another threshold (what the guard must not do)
    per_row = max(np.percentile(np.abs(d[i][m[i]]), p) for i in range(B) if m[i].any())
    assert per_row != q
    # sequence k3 is k3 of the summed row log-ratio
    seq = np.array([d[i][m[i]].sum() for i in range(B)])
    np.testing.assert_allclose(sequence_k3(delta, mask).numpy(), np.exp(seq) - seq - 1)


# ---------------------------------------------------------------- the objective


@pytest.fixture(scope="module")
def rollout():
    """A tiny VQ model's rollouts (text and 4x4 images, 8 rows) with advantages, the replay
    ℓ° as the rows' anchor, and a sampler that disagrees with it: ℓˢ = ℓ° − noise whose
    scale grows with the row (a bf16-like gap, large enough for every guard to act)."""
    model = tiny_model("vq")
    text = SamplingParams(max_new_tokens=8, temperature=1.0)
    image = SamplingParams(max_new_tokens=16, length_semantics="exact")
    trajs = RolloutEngine(model).generate(mixed_requests(mixed_samples(2), text, image))
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    with torch.no_grad():
        replay = replay_logprobs(model, batch, batch.sampling).logp
    g = torch.Generator().manual_seed(8)
    out = []
    for i, t in enumerate(trajs):
        n = len(t)
        scored = t.rollout_logp != 0
        noise = (0.02 + 0.1 * i) * torch.randn(n, generator=g) + 0.03 * i
        sampled = torch.where(scored, replay[i, :n] - noise, t.rollout_logp)
        adv = float(torch.randn((), generator=g))
        out.append(replace(t, rollout_logp=sampled, old_logp=replay[i, :n].clone(), advantage=adv))
    return model.train(), out


def run_objective(model, trajs, algo: GRPOConfig, splits):
    """Loss and metric sums over the micro-batches `splits` (lists of row indices), with
    one begin_update; the loss sum, its gradient, the finalised metrics and the kept mask."""
    obj = GRPOObjective(algo, None)
    micros = [TrajectoryBatch.collate([trajs[i] for i in s], model.special_ids.pad) for s in splits]
    n_global = sum(obj.count(m) for m in micros)
    obj.begin_update(0, micros, DistInfo())
    model.zero_grad()
    total, sums = 0.0, {}
    for m in micros:
        loss, stats = obj.loss(model, m, n_global)
        loss.backward()
        total += float(loss.detach())
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return total, grads, obj.finalize(sums, n_global)


def objective_bound(model, trajs, loss: float) -> float:
    """The float32 objective's loss against `whole_batch_reference`, or over another
    micro-batch split: a token's term A w r moves by |A w r| times its log-prob's error
    (two float32 forwards: logprob_bound) and the surrogate's float32 chain (SURROGATE_OPS,
    both paths), bounded at the largest term; then the mean over the scored tokens."""
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    mask = scored_mask(batch)
    with torch.no_grad():
        ell = replay_logprobs(model, batch, batch.sampling).logp
    old, sampled = batch.old_logp, batch.rollout_logp
    ratios = torch.exp((ell - old).abs() + (old - sampled).abs())
    term = float((batch.advantages.abs()[:, None] * ratios)[mask].max())
    n = tiny_decoder_reductions(model.config, batch.token_ids.shape[1])
    per_term = logprob_bound(ell[mask], n) + elementwise_bound(1.0, SURROGATE_OPS)
    return term * per_term + reduction_bound(loss, int(mask.sum()))


def whole_batch_reference(model, trajs, algo: GRPOConfig):
    """Independent: replay the unsplit batch, the standard per-token loss with ℓ° = anchor
    (or w·L for aligned), the numpy masks of both guards, Σ kept / n_scored."""
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    mask = scored_mask(batch).numpy()
    with torch.no_grad():
        ell = replay_logprobs(model, batch, batch.sampling).logp.double().numpy()
    old = batch.old_logp.double().numpy()
    sampled = batch.rollout_logp.double().numpy()
    adv = batch.advantages.double().numpy()[:, None]
    r = np.exp(ell - old)
    per = np.maximum(-adv * r, -adv * np.clip(r, 1 - algo.clip_low, 1 + algo.clip_high))
    if algo.surrogate == "aligned":
        per = per * np.exp(old - sampled)
    d = np.where(mask, old - sampled, 0.0)
    keep = mask.copy()
    if algo.mismatch.replay_bound is not None:
        means = np.array([d[i][mask[i]].mean() if mask[i].any() else 0 for i in range(len(d))])
        keep &= (np.abs(means) <= math.log(algo.mismatch.replay_bound))[:, None]
    if algo.mismatch.percentile is not None:
        _, above = np_percentile_mask(np.abs(d[mask]), algo.mismatch.percentile)
        pct = np.zeros_like(mask)
        pct[mask] = ~above
        keep &= pct
    return float(per[keep].sum() / mask.sum()), int((mask & ~keep).sum()), d[mask]


GUARDED = [
    ("standard", None, None),
    ("standard", 1.1, None),
    ("standard", None, 70.0),
    ("aligned", 1.1, 70.0),
]


@pytest.mark.parametrize(("surrogate", "bound", "pct"), GUARDED)
def test_objective_guards_equal_the_reference_split_or_not(rollout, surrogate, bound, pct):
    model, trajs = rollout
    algo = GRPOConfig(
        kl={"type": "none"},
        surrogate=surrogate,
        mismatch={"replay_bound": bound, "percentile": pct},
    )
    want, masked, pop = whole_batch_reference(model, trajs, algo)
    whole, g_whole, m_whole = run_objective(model, trajs, algo, [list(range(8))])
    split, g_split, m_split = run_objective(model, trajs, algo, [[0, 1, 2], [3, 4, 5, 6, 7]])
    tol = objective_bound(model, trajs, want)
    assert_within(abs(whole - want), tol, "whole vs reference")
    assert_within(abs(split - whole), tol, "split vs whole")
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    n = gradient_reductions(
        tiny_decoder_reductions(model.config, batch.token_ids.shape[1]),
        int(batch.attention_mask.sum()),
    )
    assert_within((g_split - g_whole).abs(), reduction_bound(magnitude(g_whole), n), "grad")
    if bound or pct:
        assert masked > 0
        assert m_whole["mismatch/masked_actions"] == m_split["mismatch/masked_actions"] == masked
        assert m_whole["mismatch/masked_share"] == pytest.approx(masked / pop.size)
    else:
        assert "mismatch/masked_actions" not in m_whole
    for k in (50, 90, 99, 100):
        name = f"mismatch/abs_dlogp_{'max' if k == 100 else f'p{k}'}"
        want_q = float(np.percentile(np.abs(pop), k, method="inverted_cdf"))
        assert m_whole[name] == m_split[name] == pytest.approx(want_q, rel=1e-12)
    assert m_whole["mismatch/k3"] == pytest.approx(np.mean(np.exp(pop) - pop - 1), rel=1e-9)
    if pct:
        thr = float(np.percentile(np.abs(pop), pct, method="inverted_cdf"))
        assert m_whole["mismatch/percentile_threshold"] == pytest.approx(thr, rel=1e-12)


def test_each_knob_changes_the_loss_by_its_formula(rollout):
    """aligned multiplies each kept token's loss by w = exp(ℓ° − ℓˢ); the replay bound drops
    the rows outside [1/C, C] and the percentile the actions above the global threshold —
    each against the unguarded standard loss of the same rows."""
    model, trajs = rollout
    base = GRPOConfig(kl={"type": "none"})
    plain, _, _ = run_objective(model, trajs, base, [list(range(8))])
    for change in (
        {"surrogate": "aligned"},
        {"mismatch": {"replay_bound": 1.1}},
        {"mismatch": {"percentile": 70.0}},
    ):
        algo = GRPOConfig(kl={"type": "none"}, **change)
        got, _, metrics = run_objective(model, trajs, algo, [list(range(8))])
        want, _, pop = whole_batch_reference(model, trajs, algo)
        assert got != pytest.approx(plain, rel=1e-3), change
        assert_within(abs(got - want), objective_bound(model, trajs, want), str(change))
    gap = metrics["mismatch/logp_replay_mean"] - metrics["mismatch/logp_sampled_mean"]
    assert gap == pytest.approx(pop.mean(), rel=1e-9)


def test_guards_over_two_gloo_ranks_equal_one_process(rollout, tmp_path):
    """Two processes (gloo), each with two micro-batches of its round-robin shard of the
    rollout's Δ: the percentile threshold, the kept actions (both guards) and the
    diagnostics' quantiles equal numpy's on the unsplit batch, which the one-process
    objective matches too (`test_objective_guards_equal_the_reference_split_or_not`)."""
    model, trajs = rollout
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    mask = scored_mask(batch)
    delta = mismatch_delta(batch.old_logp, batch.rollout_logp, mask)
    p, bound = 70.0, 1.1
    data = {"delta": delta, "mask": mask, "percentile": p, "bound": bound}
    torch.save(data, tmp_path / "population.pt")
    mp.start_processes(
        rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    d, m = delta.numpy(), mask.numpy()
    q, above = np_percentile_mask(np.abs(d[m]), p)
    want = np.zeros_like(m)
    want[m] = ~above
    rows = np.array([np.abs(d[i][m[i]]).mean() for i in range(len(d)) if m[i].any()])
    means = np.array([d[i][m[i]].mean() if m[i].any() else 0.0 for i in range(len(d))])
    want &= (np.abs(means) <= math.log(bound))[:, None]
    assert 0 < (m & ~want).sum() < m.sum()
    algo = GRPOConfig(kl={"type": "none"}, mismatch={"percentile": p, "replay_bound": bound})
    _, _, one = run_objective(model, trajs, algo, [list(range(8))])
    assert one["mismatch/masked_actions"] == (m & ~want).sum()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["threshold"] == q == one["mismatch/percentile_threshold"]
        assert np.array_equal(got["keep"].numpy(), want[rank::2])
        for name, pop in (("abs_dlogp", np.abs(d[m])), ("row_abs_dlogp", rows)):
            for k in (50, 90, 99, 100):
                key = f"mismatch/{name}_" + ("max" if k == 100 else f"p{k}")
                if key in got["quantiles"]:
                    want_q = float(np.percentile(pop, k, method="inverted_cdf"))
                    assert got["quantiles"][key] == want_q == one[key], key


def test_bsq_objective_runs_all_knobs():
    """BSQ rows: the aligned surrogate per factor, the guards per position (Δ = the sum over
    factors); with sampler = replay the aligned loss is the standard one."""
    model = tiny_model("bsq")
    image = SamplingParams(max_new_tokens=16, length_semantics="exact")
    text = SamplingParams(max_new_tokens=4)
    samples = [s for s in mixed_samples(1) if s.task == "t2i"] * 2
    trajs = RolloutEngine(model).generate(mixed_requests(samples, text, image))
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    with torch.no_grad():
        rep = replay_logprobs(model, batch, batch.sampling)
    trajs = [
        replace(t, old_logp=rep.logp[i, : len(t)], old_logp_factors=rep.logp_factors[i, : len(t)],
                rollout_logp=rep.logp[i, : len(t)].clone(),
                rollout_logp_factors=rep.logp_factors[i, : len(t)].clone(), advantage=1.0 - i)
        for i, t in enumerate(trajs)
    ]  # fmt: skip
    model.train()
    std, _, _ = run_objective(model, trajs, GRPOConfig(kl={"type": "none"}), [[0, 1]])
    ali, _, m = run_objective(
        model, trajs, GRPOConfig(kl={"type": "none"}, surrogate="aligned"), [[0, 1]]
    )
    assert ali == std and m["policy/aligned_weight_mean"] == 1.0
    visual = (batch.modality == Modality.VISUAL) & scored_mask(batch)
    assert visual.any()
    algo = GRPOConfig(kl={"type": "none"}, surrogate="aligned", mismatch={"percentile": 50.0})
    shifted = []
    for k, t in enumerate(trajs):
        vis = (t.modality == Modality.VISUAL) & (t.rollout_logp != 0)
        factors = t.rollout_logp_factors - 0.01 * (k + 1) * vis[:, None]
        logp = torch.where(vis, factors.sum(-1), t.rollout_logp)
        shifted.append(replace(t, rollout_logp_factors=factors, rollout_logp=logp))
    got, _, m = run_objective(model, shifted, algo, [[0], [1]])
    assert math.isfinite(got) and got != std and m["mismatch/percentile_masked_actions"] > 0


# ---------------------------------------------------------------- config


def test_config_fields_and_refusals():
    algo = GRPOConfig()
    assert algo.surrogate == "standard" and algo.mismatch.replay_bound is None
    assert algo.mismatch.percentile is None
    for bad in ({"replay_bound": 1.0}, {"replay_bound": 0.5}, {"percentile": 0.0},
                {"percentile": 100.0}, {"percentile": -1.0}):  # fmt: skip
        with pytest.raises(ValidationError):
            GRPOConfig(mismatch=bad)
    run = {"algorithm": {"name": "grpo", "surrogate": "aligned", "old_logp_source": "rollout"},
           "reward": {"plugins": [{"name": "mc_exact"}]}}  # fmt: skip
    with pytest.raises(Exception, match="old_logp_source.*acts only with surrogate 'standard'"):
        validate_config(run)
    run["algorithm"]["old_logp_source"] = "replay"
    assert validate_config(run).algorithm.surrogate == "aligned"
    # the guards act in every combination, also REINFORCE (replay, one update per batch)
    GRPOConfig(mismatch={"replay_bound": 2.0, "percentile": 99.0}, old_logp_source="rollout")
    GRPOConfig(mismatch={"percentile": 99.0}, updates_per_batch=3)
