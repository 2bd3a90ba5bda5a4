"""OPD numerics (`uniweave.algorithms.opd`) against independent implementations: numpy
float64 formulas for the values and torch.distributions for the gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributions import Bernoulli, Categorical, kl_divergence

from uniweave.algorithms.opd import (
    Events,
    categorical_divergence,
    clip_text_contribution,
    event_index,
    generalized_jsd,
    row_events,
    tempered_logp,
    trajectory_first,
    union_bound,
)
from uniweave.core.distributions import bernoulli_jsd, bit_pairs
from uniweave.core.types import Modality


def np_gjsd(zs: np.ndarray, zt: np.ndarray, beta: float, tau: float) -> np.ndarray:
    """TRL GKD's generalised JSD in float64 numpy, per row, written from the probabilities."""

    def softmax(z):
        e = np.exp((z - z.max(-1, keepdims=True)) / tau)
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(zs / 1.0), softmax(zt / 1.0)
    if beta == 0:
        return (q * np.log(q / p)).sum(-1)
    if beta == 1:
        return (p * np.log(p / q)).sum(-1)
    m = (1 - beta) * p + beta * q
    return beta * (q * np.log(q / m)).sum(-1) + (1 - beta) * (p * np.log(p / m)).sum(-1)


def torch_gjsd(zs: torch.Tensor, zt: torch.Tensor, beta: float, tau: float) -> torch.Tensor:
    """The same through torch.distributions (autograd reference for the gradient)."""
    P, Q = Categorical(logits=zs / tau), Categorical(logits=zt / tau)
    if beta == 0:
        return kl_divergence(Q, P)
    if beta == 1:
        return kl_divergence(P, Q)
    M = Categorical(probs=(1 - beta) * P.probs + beta * Q.probs)
    return beta * kl_divergence(Q, M) + (1 - beta) * kl_divergence(P, M)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_generalized_jsd_value_and_gradient(beta, tau):
    g = torch.Generator().manual_seed(int(beta * 10 + tau * 100))
    zs = torch.randn(37, 50, generator=g, dtype=torch.float64) * 2
    zt = torch.randn(37, 50, generator=g, dtype=torch.float64) * 2
    zs.requires_grad_(True)
    ours = generalized_jsd(tempered_logp(zs, tau), tempered_logp(zt, tau), beta)
    ref = np_gjsd(zs.detach().numpy(), zt.numpy(), beta, tau)
    # bound: float64 vs numpy, one formula over 50 classes: ~110 roundings (two 50-term sums, logs, exps) of values <= ~10: 110 x 2^-53 x 10 ~ 1e-13 worst case, under atol 1e-12
    np.testing.assert_allclose(ours.detach().numpy(), ref, rtol=1e-10, atol=1e-12)
    w = torch.rand(37, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((ours * w).sum(), zs)
    zs2 = zs.detach().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad((torch_gjsd(zs2, zt, beta, tau) * w).sum(), zs2)
    # bound: float64, two autograd formulas of one gradient: ~110 roundings each at entries <= ~1: 2 x 110 x 2^-53 ~ 2.4e-14, far under atol 1e-10 (a wrong term moves it by ~1e-2)
    torch.testing.assert_close(grad, expected, rtol=1e-8, atol=1e-10)


def test_endpoints_are_forward_and_reverse_kl():
    zs, zt = torch.randn(5, 9, dtype=torch.float64), torch.randn(5, 9, dtype=torch.float64)
    lp, lq = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    fwd = kl_divergence(Categorical(logits=zt), Categorical(logits=zs))
    rev = kl_divergence(Categorical(logits=zs), Categorical(logits=zt))
    torch.testing.assert_close(generalized_jsd(lp, lq, 0.0), fwd)
    torch.testing.assert_close(generalized_jsd(lp, lq, 1.0), rev)
    assert not torch.allclose(fwd, rev)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bernoulli_jsd_is_the_per_factor_mean(beta):
    g = torch.Generator().manual_seed(1)
    zs = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    zt = torch.randn(6, 8, generator=g, dtype=torch.float64)
    tau = 0.8
    ours = bernoulli_jsd(bit_pairs(zs, tau), bit_pairs(zt, tau), beta)
    P, Q = Bernoulli(logits=zs / tau), Bernoulli(logits=zt / tau)
    if beta == 0:
        per = kl_divergence(Q, P)
    elif beta == 1:
        per = kl_divergence(P, Q)
    else:
        M = Bernoulli(probs=(1 - beta) * P.probs + beta * Q.probs)
        per = beta * kl_divergence(Q, M) + (1 - beta) * kl_divergence(P, M)
    torch.testing.assert_close(ours, per.mean(-1))
    (g1,) = torch.autograd.grad(ours.sum(), zs)
    (g2,) = torch.autograd.grad(per.mean(-1).sum(), zs)
    torch.testing.assert_close(g1, g2)


def test_top_k_union_equals_full_when_it_covers_the_vocabulary():
    """Teacher and student rank 12 ids in opposite orders: their top-6 sets are disjoint
    and together cover the vocabulary, so the union path (with an empty tail) is exact."""
    g = torch.Generator().manual_seed(2)
    order = torch.arange(12, dtype=torch.float64)
    zs = order * 0.3 + torch.rand(10, 12, generator=g, dtype=torch.float64) * 0.1
    zt = (-order * 0.4).repeat(10, 1)
    zs.requires_grad_(True)
    a, b = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    union = categorical_divergence(a, b, 0.5, top_k=6, retained_mass_min=0.0)
    exact = generalized_jsd(a, b, 0.5)
    # bound: float64, the union path groups the 12 classes' ~40 roundings otherwise, values <= log 2: 40 x 2^-53 ~ 4e-15, under atol 1e-12
    torch.testing.assert_close(union.jsd, exact, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(union.retained, torch.ones(10, dtype=torch.float64))
    assert union.fallback.sum() == 0
    (g1,) = torch.autograd.grad(union.jsd.sum(), zs, retain_graph=True)
    (g2,) = torch.autograd.grad(exact.sum(), zs)
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("beta", [0.25, 0.5, 0.75])
def test_top_k_union_is_within_the_stated_bound(beta):
    g = torch.Generator().manual_seed(3)
    zs = torch.randn(64, 400, generator=g, dtype=torch.float64) * 3
    zt = zs + torch.randn(64, 400, generator=g, dtype=torch.float64)
    lp, lq = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    full = generalized_jsd(lp, lq, beta)
    union = categorical_divergence(lp, lq, beta, top_k=8, retained_mass_min=0.0)
    ids = torch.cat([lq.topk(8).indices, lp.topk(8).indices], -1)
    keep = torch.zeros_like(lp, dtype=torch.bool).scatter_(-1, ids, True)
    p_tail = lp.exp().masked_fill(keep, 0).sum(-1)
    q_tail = lq.exp().masked_fill(keep, 0).sum(-1)
    gap = full - union.jsd
    assert (gap >= -1e-12).all()
    assert (gap <= union_bound(p_tail, q_tail, beta) + 1e-12).all()
    assert (gap > 1e-6).any()  # the tail does lose something here
    torch.testing.assert_close(union.retained, 1 - q_tail)


def test_retained_mass_guard_falls_back_to_the_full_vocabulary():
    g = torch.Generator().manual_seed(4)
    zs = torch.randn(20, 300, generator=g, dtype=torch.float64)
    zt = torch.randn(20, 300, generator=g, dtype=torch.float64) * 0.1  # flat teacher
    zt[:5] *= 200  # five peaked teacher rows keep their mass in the union
    lp, lq = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    out = categorical_divergence(lp, lq, 0.5, top_k=4, retained_mass_min=0.9)
    assert out.fallback.tolist() == [0.0] * 5 + [1.0] * 15
    full = generalized_jsd(lp, lq, 0.5)
    torch.testing.assert_close(out.jsd[5:], full[5:])
    assert (out.jsd[:5] <= full[:5] + 1e-12).all()


def test_events_of_a_draw_then_answer_row():
    #   prompt 0-2 | text 3-5 (header) | visual 6-9 | controller 10 | text 11-12
    scored = [3, 4, 5, 6, 7, 8, 9, 11, 12]
    visual = [False] * 6 + [True] * 4 + [False] * 3
    all_ev = row_events(scored, visual, "eos", "all_complete_transitions")
    assert all_ev == [("text", [3, 4, 5]), ("visual", [6, 7, 8, 9]), ("text", [11, 12])]
    window = row_events(scored, visual, "eos", "first_complete_window")
    assert window == [("window", [6, 7, 8, 9, 11, 12])]
    cut = row_events(scored, visual, "cap", "all_complete_transitions")
    assert cut == all_ev[:2]  # the capped answer is not a complete event
    assert row_events(scored, visual, "cap", "first_complete_window") == [("window", [6, 7, 8, 9])]
    assert row_events([3, 4], [False] * 5, "cap", "first_complete_window") == []


def test_trajectory_first_weighs_each_trajectory_once():
    """Row 0 has three events, row 1 one; each row's value is the mean of its event means,
    and the loss is the mean over rows (not over events or positions)."""
    B, T = 2, 12
    modality = torch.full((B, T), int(Modality.TEXT))
    modality[0, 4:8] = int(Modality.VISUAL)
    scored = torch.zeros(B, T, dtype=torch.bool)
    scored[0, 1:11] = True
    scored[1, 2:4] = True
    events = event_index(scored, modality, ["eos", "eos"], "all_complete_transitions")
    assert events.kinds == [["text", "visual", "text"], ["text"]]
    values = torch.arange(B * T, dtype=torch.float64).view(B, T) / 10
    per_row, _ = trajectory_first(values, events)
    v = values.numpy()
    row0 = np.mean([v[0, 1:4].mean(), v[0, 4:8].mean(), v[0, 8:11].mean()])
    row1 = v[1, 2:4].mean()
    np.testing.assert_allclose(per_row.numpy(), [row0, row1])
    # three events do not make row 0 weigh three times: the loss is the plain row mean
    assert math.isclose(float(per_row.mean()), (row0 + row1) / 2)
    assert not math.isclose(float(per_row.mean()), float(v[scored.numpy()].mean()))


def test_a_row_without_events_contributes_zero():
    ev = Events(torch.full((1, 4), -1), [[]])
    per_row, _ = trajectory_first(torch.ones(1, 4), ev)
    assert per_row.tolist() == [0.0]


def test_text_clip_value_and_gradient_equal_numpy():
    """`clip_text_contribution` on float64 values against explicit loops: row value
    V_i + min(T_i, c) (each event's positions summed by modality and divided by all of the
    event's positions, then averaged over the row's events) and the gradient of a random
    linear function of the rows, ∂/∂x_t = r_i·(1 or s_i)/(|e|·n_i), s_i = min(1, c/T_i);
    1e-12 (float64 on both sides, a few dozen terms)."""
    gen = torch.Generator().manual_seed(0)
    B, T = 5, 12
    x = torch.rand(B, T, generator=gen, dtype=torch.float64)
    visual = torch.rand(B, T, generator=gen) < 0.5
    index = torch.full((B, T), -1)
    kinds = []
    for b in range(B):  # row b: b events of consecutive positions from 1 (row 0: none)
        cuts = sorted(torch.randperm(T - 2, generator=gen)[:b].tolist())
        bounds = [1] + [k + 2 for k in cuts] + [T]
        for e in range(b):
            index[b, bounds[e] : bounds[e + 1]] = e
        kinds.append(["text"] * b)
    events = Events(index, kinds)
    c = float(clip_text_contribution(x, visual, events, math.inf)[1][1:].median())
    xg = x.clone().requires_grad_(True)
    rows, t_part, scale = clip_text_contribution(xg, visual, events, c)
    r = torch.rand(B, generator=gen, dtype=torch.float64)
    (rows * r).sum().backward()
    xs, vs, ix = x.numpy(), visual.numpy(), index.numpy()
    want_grad = np.zeros((B, T))
    for b in range(B):
        n_ev = len(kinds[b])
        tv = {False: 0.0, True: 0.0}
        for e in range(n_ev):
            ts = np.flatnonzero(ix[b] == e)
            for m in (False, True):
                tv[m] += sum(xs[b, t] for t in ts if vs[b, t] == m) / len(ts) / n_ev
        s = min(1.0, c / tv[False]) if tv[False] > 0 else 1.0
        # bound: float64 sums of a row's <= 12 values in [0, 1] in another order, divided: <= 14 roundings: 14 x 2^-53 ~ 1.6e-15 relative, rel 1e-12; abs 1e-15 floors exact zeros
        assert t_part[b].item() == pytest.approx(tv[False], rel=1e-12, abs=1e-15)
        assert scale[b].item() == pytest.approx(s, rel=1e-12)
        # bound: as t_part's, plus one addition
        assert rows[b].item() == pytest.approx(tv[True] + min(tv[False], c), rel=1e-12, abs=1e-15)
        for e in range(n_ev):
            ts = np.flatnonzero(ix[b] == e)
            for t in ts:
                want_grad[b, t] = r[b].item() * (1.0 if vs[b, t] else s) / (len(ts) * n_ev)
    assert (scale < 1).any() and (scale[1:] == 1).any()  # both cases occur
    # bound: float64, r x (1 or s) / (|e| n): <= 4 roundings per entry, 4 x 2^-53 ~ 4e-16 relative under rtol 1e-12; atol floors exact zeros
    np.testing.assert_allclose(xg.grad.numpy(), want_grad, rtol=1e-12, atol=1e-15)
