from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributions import Bernoulli, Categorical, kl_divergence

from uniweave.core import TextCategorical, VisualBits, VisualCategorical, generator_for

SHAPES = [(7,), (3, 11), (2, 4, 5)]
TEMPS = [1.0, 0.7, 2.5]


def _logits(shape, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def _np_process(logits: np.ndarray, tau: float, k: int, p: float) -> np.ndarray:
    """Independent row-by-row top-k / top-p (keep-ties) reference, returns log-probs."""
    flat = logits.reshape(-1, logits.shape[-1]) / tau
    out = np.full_like(flat, -np.inf)
    for r, z in enumerate(flat):
        keep = np.ones(z.shape, bool)
        if 0 < k < z.size:
            keep &= z >= np.sort(z)[::-1][k - 1]
        pr = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        pr /= pr.sum()
        if p < 1.0:
            order = np.argsort(-pr, kind="stable")
            cum, last = 0.0, None
            for j in order:
                last = pr[j]
                cum += pr[j]
                if cum >= p:
                    break
            keep &= pr >= last
        pr = np.where(keep, pr, 0.0)
        pr /= pr.sum()
        with np.errstate(divide="ignore"):
            out[r] = np.log(pr)
    return out.reshape(logits.shape)


def _np_kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
    return terms.sum(-1)


def _np_jsd(ps: np.ndarray, pt: np.ndarray, beta: float) -> np.ndarray:
    """Generalised JSD straight from the definition (TRL GKD, docs/numerics.md §9)."""
    if beta == 0.0:
        return _np_kl(pt, ps)
    if beta == 1.0:
        return _np_kl(ps, pt)
    m = (1 - beta) * ps + beta * pt
    return beta * _np_kl(pt, m) + (1 - beta) * _np_kl(ps, m)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tau", TEMPS)
def test_categorical_matches_torch(shape, tau):
    a, b = _logits(shape, 0), _logits(shape, 1)
    d, e = TextCategorical(a, temperature=tau), TextCategorical(b, temperature=tau)
    ref_d, ref_e = Categorical(logits=a / tau), Categorical(logits=b / tau)
    actions = torch.randint(0, shape[-1], shape[:-1])
    torch.testing.assert_close(d.log_prob(actions), ref_d.log_prob(actions))
    torch.testing.assert_close(d.entropy(), ref_d.entropy())
    torch.testing.assert_close(d.kl(e), kl_divergence(ref_d, ref_e))
    torch.testing.assert_close(d.probs, ref_d.probs)
    assert torch.equal(d.mode(), a.argmax(-1))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k, p", [(3, 1.0), (0, 0.6), (4, 0.8), (1, 1.0), (0, 0.05)])
def test_topk_topp_match_reference_and_torch_on_processed(shape, k, p):
    a = _logits(shape, 2)
    d = TextCategorical(a, temperature=0.8, top_k=k, top_p=p)
    ref = _np_process(a.numpy(), 0.8, k, p)
    # float64 vs numpy: scaling, sort / mask, an 11-term logsumexp, a subtraction: ~20
    # roundings of log-probs <= ~15 in magnitude
    # bound: 20 x 2^-53 x 15 ~ 3e-14 worst case, under atol 1e-12 (rtol 1e-10 at -inf)
    np.testing.assert_allclose(d.log_probs.numpy(), ref, rtol=1e-10, atol=1e-12)
    assert (torch.isfinite(d.log_probs).sum(-1) >= 1).all()
    # entropy / kl on the processed distribution equal torch's on the same logits
    other = TextCategorical(_logits(shape, 3), temperature=0.8)
    ref_d = Categorical(logits=torch.from_numpy(ref))
    torch.testing.assert_close(d.entropy(), ref_d.entropy())
    torch.testing.assert_close(
        d.kl(other), kl_divergence(ref_d, Categorical(logits=other.log_probs))
    )
    assert not torch.isnan(d.entropy()).any()


def _kept(logits, **kw) -> list[int]:
    d = TextCategorical(torch.tensor(logits, dtype=torch.float64).log(), **kw)
    return torch.isfinite(d.log_probs).nonzero().flatten().tolist()


def test_topk_topp_hand_checked():
    probs = [0.5, 0.2, 0.15, 0.1, 0.05]
    assert _kept(probs, top_k=2) == [0, 1]
    assert _kept(probs, top_p=0.8) == [0, 1, 2]  # 0.7 < 0.8 <= 0.85
    assert _kept(probs, top_p=0.7) == [0, 1]  # mass exactly reaches p
    assert _kept(probs, top_p=1e-6) == [0]  # top-1 always kept
    # top-p applies to the renormalised top-k result: 0.5/0.7 = 0.714 >= 0.7 keeps one
    assert _kept(probs, top_k=2, top_p=0.7) == [0]
    # temperature first: tau = 0.5 squares probs -> [.25,.04,.0225,.01,.0025]/.325; top-1 = .769
    assert _kept(probs, temperature=0.5, top_p=0.75) == [0]
    assert _kept(probs, temperature=1.0, top_p=0.75) == [0, 1, 2]
    d = TextCategorical(torch.tensor(probs).log(), top_k=3)
    torch.testing.assert_close(d.probs, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)


def test_ties_keep_every_tied_entry():
    assert _kept([0.3, 0.3, 0.3, 0.1], top_k=2) == [0, 1, 2]
    assert _kept([0.4, 0.4, 0.2], top_p=0.3) == [0, 1]


def test_invalid_processing_arguments():
    x = torch.zeros(4)
    for kw in [dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)]:
        with pytest.raises(ValueError):
            TextCategorical(x, **kw)


def test_masked_sampling_never_draws_removed_tokens_and_matches_probs():
    V, N = 12, 40_000
    row = _logits((V,), 4).float()
    d = TextCategorical(row.expand(N, V), temperature=0.9, top_k=6, top_p=0.85)
    kept = torch.isfinite(d.log_probs[0])
    assert 1 < int(kept.sum()) < 6
    draws = d.sample(torch.Generator().manual_seed(0))
    assert draws.shape == (N,)
    assert kept[draws].all()
    freq = torch.bincount(draws, minlength=V).double() / N
    p = d.probs[0].double()
    assert torch.all((freq - p).abs() <= 4 * torch.sqrt(p * (1 - p) / N) + 1e-12)
    # the global-RNG path also respects the mask
    torch.manual_seed(1)
    assert kept[d.sample()].all()


def test_per_row_generators_make_rows_independent_of_the_batch():
    logits = _logits((8, 5, 20), 5).float()
    gens = lambda rows: [generator_for(3, 1, i, 0) for i in rows]  # noqa: E731
    batch = TextCategorical(logits, top_k=10).sample(gens(range(8)))
    perm = [5, 2, 7, 0, 1, 6, 3, 4]
    permuted = TextCategorical(logits[perm], top_k=10).sample(gens(perm))
    for i in range(8):
        alone = TextCategorical(logits[i : i + 1], top_k=10).sample(gens([i]))
        assert torch.equal(alone[0], batch[i])
    assert torch.equal(permuted, batch[perm])
    bits = _logits((8, 3, 16), 6).float()
    b_batch = VisualBits(bits).sample(gens(range(8)))
    for i in range(8):
        assert torch.equal(VisualBits(bits[i : i + 1]).sample(gens([i]))[0], b_batch[i])
    with pytest.raises(ValueError, match="generator"):
        TextCategorical(logits).sample(gens(range(7)))


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("shape", SHAPES)
def test_jsd_matches_definition(shape, beta):
    s = TextCategorical(_logits(shape, 7), temperature=1.3)
    t = TextCategorical(_logits(shape, 8), temperature=1.3)
    ref = _np_jsd(s.probs.numpy(), t.probs.numpy(), beta)
    # float64 vs numpy: the mixture, logs and an 11-term sum per side: ~40 roundings of
    # terms <= 1 (p log p <= 1/e)
    # bound: 40 x 2^-53 ~ 4e-15 worst case, under atol 1e-12
    np.testing.assert_allclose(s.jsd(t, beta).numpy(), ref, rtol=1e-9, atol=1e-12)
    if beta == 0.5:
        torch.testing.assert_close(s.jsd(t), t.jsd(s))
        assert (s.jsd(t) <= math.log(2) + 1e-12).all()


def test_masked_entries_give_finite_values_and_gradients():
    a = _logits((4, 9), 9).requires_grad_()
    b = _logits((4, 9), 10)
    b[:, :2] = -math.inf  # teacher rules out two tokens
    t = TextCategorical(b, top_p=0.7)
    for beta in (0.1, 0.5, 0.9):
        s = TextCategorical(a, top_k=3)
        j = s.jsd(t, beta)
        ref = _np_jsd(s.probs.detach().numpy(), t.probs.numpy(), beta)
        # bound: float64, the JSD of 9 classes as above: ~35 x 2^-53 ~ 4e-15, under 1e-12
        np.testing.assert_allclose(j.detach().numpy(), ref, rtol=1e-9, atol=1e-12)
        (g,) = torch.autograd.grad(j.sum() + s.entropy().sum(), a)
        assert torch.isfinite(j).all() and torch.isfinite(g).all()
    # KL(p || q) is +inf where q is zero and p is not, finite the other way round when covered
    wide = TextCategorical(b.clone().fill_(0.0))
    assert torch.isinf(wide.kl(t)).all()
    assert torch.isfinite(t.kl(wide)).all()


def test_guidance_formula_and_logprob_modes():
    c, u = _logits((3, 4, 10), 11), _logits((3, 4, 10), 12)
    w, tau = 3.0, 0.8
    z = u + w * (c - u)
    guided = VisualCategorical(c, u, guidance=w, temperature=tau)
    cond = VisualCategorical(c, u, guidance=w, temperature=tau, logprob_mode="conditional")
    torch.testing.assert_close(guided.log_probs, torch.log_softmax(z / tau, -1))
    torch.testing.assert_close(cond.log_probs, torch.log_softmax(c / tau, -1))
    torch.testing.assert_close(cond.sampling_log_probs, guided.log_probs)
    a = torch.randint(0, 10, (3, 4))
    torch.testing.assert_close(guided.log_prob(a), Categorical(logits=z / tau).log_prob(a))
    torch.testing.assert_close(cond.log_prob(a), Categorical(logits=c / tau).log_prob(a))
    assert not torch.allclose(guided.log_prob(a), cond.log_prob(a))
    # both modes sample the guided distribution: same generator, same draws
    g1, g2 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    assert torch.equal(guided.sample(g1), cond.sample(g2))
    assert torch.equal(cond.mode(), z.argmax(-1))
    # truncation is applied to the conditional scoring distribution too
    cond_k = VisualCategorical(c, u, guidance=w, top_k=2, logprob_mode="conditional")
    np.testing.assert_allclose(cond_k.log_probs.numpy(), _np_process(c.numpy(), 1.0, 2, 1.0))
    np.testing.assert_allclose(
        cond_k.sampling_log_probs.numpy(), _np_process(z.numpy(), 1.0, 2, 1.0)
    )
    # w = 1 without uncond is the plain conditional softmax; w != 1 needs uncond
    torch.testing.assert_close(VisualCategorical(c).log_probs, torch.log_softmax(c, -1))
    with pytest.raises(ValueError, match="uncond"):
        VisualCategorical(c, guidance=2.0)
    with pytest.raises(ValueError, match="logprob_mode"):
        VisualCategorical(c, logprob_mode="z/w")


@pytest.mark.parametrize("shape", [(6,), (3, 8), (2, 3, 4)])
@pytest.mark.parametrize("tau", TEMPS)
def test_bits_match_torch_bernoulli(shape, tau):
    a, b = _logits(shape, 13, 3.0), _logits(shape, 14, 3.0)
    d, e = VisualBits(a, temperature=tau), VisualBits(b, temperature=tau)
    ref_d, ref_e = Bernoulli(logits=a / tau), Bernoulli(logits=b / tau)
    bits = torch.randint(0, 2, shape).double()
    torch.testing.assert_close(d.log_prob_factors(bits), ref_d.log_prob(bits))
    torch.testing.assert_close(d.log_prob(bits), ref_d.log_prob(bits).sum(-1))
    torch.testing.assert_close(d.entropy_factors(), ref_d.entropy())
    torch.testing.assert_close(d.entropy(), ref_d.entropy().sum(-1))
    torch.testing.assert_close(d.kl_factors(e), kl_divergence(ref_d, ref_e))
    torch.testing.assert_close(d.kl(e), kl_divergence(ref_d, ref_e).sum(-1))
    assert d.n_factors == shape[-1]
    assert torch.equal(d.mode(), (a > 0).double())


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_bits_jsd_is_mean_of_factor_jsd(beta):
    a, b = _logits((5, 7), 15, 3.0), _logits((5, 7), 16, 3.0)
    s, t = VisualBits(a, temperature=0.9), VisualBits(b, temperature=0.9)
    ps, pt = torch.sigmoid(a / 0.9).numpy(), torch.sigmoid(b / 0.9).numpy()
    per = _np_jsd(np.stack([ps, 1 - ps], -1), np.stack([pt, 1 - pt], -1), beta)
    # float64, a 2-class JSD per factor (~15 roundings of terms <= 1), then the mean of 7
    # bound: 15 x 2^-53 ~ 2e-15 per factor, +7 for the mean: under atol 1e-12
    np.testing.assert_allclose(s.jsd_factors(t, beta).numpy(), per, rtol=1e-9, atol=1e-12)
    # bound: as the line above, plus the mean's 7 roundings
    np.testing.assert_allclose(s.jsd(t, beta).numpy(), per.mean(-1), rtol=1e-9, atol=1e-12)


def test_bits_guidance_sampling_and_extremes():
    c, u = _logits((4, 6), 17), _logits((4, 6), 18)
    w, tau = 2.0, 0.5
    z = (u + w * (c - u)) / tau
    g = VisualBits(c, temperature=tau, uncond_logits=u, guidance=w)
    cond = VisualBits(c, temperature=tau, uncond_logits=u, guidance=w, logprob_mode="conditional")
    torch.testing.assert_close(g.probs, torch.sigmoid(z))
    torch.testing.assert_close(cond.probs, torch.sigmoid(c / tau))
    torch.testing.assert_close(g.entropy(), Bernoulli(logits=z).entropy().sum(-1))
    assert torch.equal(cond.mode(), (z > 0).double())
    with pytest.raises(ValueError, match="uncond"):
        VisualBits(c, guidance=2.0)
    # sample frequencies follow sigmoid(z)
    row = torch.tensor([-2.0, -0.3, 0.0, 0.8, 3.0])
    N = 40_000
    draws = VisualBits(row.expand(N, 5)).sample(torch.Generator().manual_seed(0))
    assert set(draws.unique().tolist()) <= {0.0, 1.0}
    p = torch.sigmoid(row).double()
    assert torch.all((draws.double().mean(0) - p).abs() <= 4 * torch.sqrt(p * (1 - p) / N))
    # saturated logits stay finite: logsigmoid(-1e4) = -1e4, not log(0)
    x = torch.tensor([[1e4, -1e4, 50.0]], requires_grad=True)
    d = VisualBits(x)
    other = VisualBits(torch.tensor([[-1e4, 1e4, 0.0]]))
    for value in (d.entropy(), d.jsd(other), d.log_prob(torch.tensor([[1.0, 0.0, 1.0]]))):
        assert torch.isfinite(value).all()
    (grad,) = torch.autograd.grad(d.entropy().sum() + d.jsd(other).sum(), x)
    assert torch.isfinite(grad).all()
    lp = d.log_prob(torch.tensor([[0.0, 0.0, 1.0]]))
    torch.testing.assert_close(lp.detach(), torch.tensor([-1e4]))
    with pytest.raises(ValueError, match="bits"):
        d.log_prob(torch.tensor([[0.5, 0.0, 1.0]]))
