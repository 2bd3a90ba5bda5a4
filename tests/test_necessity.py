"""Necessity and EMA Necessity distillation (docs/numerics.md §3 "Necessity"): the fused
11/10/01/00 virtual batch against one forward per view (tiny model, tiny UniAR), carriers
against numpy, the divergences against torch.distributions (values and gradients), the
SFT objective's ND term against an independent computation with a separate EMA copy, the
EMA against its closed form, and the EMA shadow bitwise across a SIGKILL and a resume."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from rollout_fixtures import tiny_model, tokenizer
from tolerances import (
    assert_within,
    fp64_bound,
    gradient_reductions,
    magnitude,
    mixed_fp64_bound,
    rmsnorm_fp32_reductions,
    tiny_decoder_reductions,
)
from torch.distributions import Bernoulli, Categorical, kl_divergence
from trainer_helpers import (
    assert_same_state,
    checkpoint_tensors,
    run_cli,
    tiny_config,
    write_config,
)

from uniweave.algorithms.information_gain import batch_events, blind_attention_mask
from uniweave.algorithms.necessity import (
    ALL_VIEWS,
    answer_events,
    carriers,
    fused_views,
    hidden_blocks,
    nd_bits,
    nd_text,
    question_block,
)
from uniweave.codecs.base import single_thread
from uniweave.config.algorithms import SFTConfig
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.data.digits import make_task_samples
from uniweave.data.template import serialize
from uniweave.forward import forward_interleaved
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.ema import EMA
from uniweave.train.methods.sft.information_gain import blind_scores
from uniweave.train.methods.sft.objective import SFTObjective


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _batch(model, n=3, task="draw_then_answer"):
    bits = model.n_visual_outputs if model.visual_head == "bsq" else None
    samples = make_task_samples(task, "val", n, seed=2)
    rows = [serialize(s, tokenizer(), encode_image=model.codec.encode, bits=bits) for s in samples]
    return TrajectoryBatch.collate(rows, model.special_ids.pad)


def _separate(model, batch, events, view):
    """Unit scores [E] of `view`, one forward for this view alone (IG's blind-view path,
    which runs only the events' rows of this view), NaN where the event has no q."""
    q = {e: question_block(batch, e) for e in events}
    have = [e for e in events if hidden_blocks(view, e, q[e]) is not None]
    scores, calls = blind_scores(model, batch, have, 64, lambda e: hidden_blocks(view, e, q[e]))
    out = torch.full((len(events),), math.nan)
    for s, e in zip(scores.tolist(), have):
        out[events.index(e)] = s
    return out, calls


# Tolerance: the fused and the separate forwards compute the same float32 sums over
# different padded widths and row sets; a log-prob of magnitude ≲ 10 carries a rounding
# error of a few float32 ulps per layer (≈ 1e-6 each), so 1e-5 bounds the difference.
VIEW_TOL = 1e-5


def _check_fused(model, batch):
    events = answer_events(batch)
    fused = fused_views(model, batch, events, ALL_VIEWS, chunk_size=4 * len(events))
    assert fused.calls == 1  # every view of every event in one backbone call
    two = 0
    for view in ALL_VIEWS:
        ref, calls = _separate(model, batch, events, view)
        assert calls == 1
        got = fused.scores[view].cpu()
        assert torch.equal(got.isnan(), ref.isnan()), view
        ok = ~ref.isnan()
        assert (got[ok] - ref[ok]).abs().max() <= VIEW_TOL, view
        two = int(ok.sum())
    assert two > 0  # some events have a q, so 01/00 were really computed
    # 11 is the ordinary causal forward (key-padding mask instead of a 2-D mask)
    out = forward_interleaved(model, batch)
    logp = torch.full(batch.token_ids.shape, math.nan)
    text = torch.log_softmax(out.text_logits.float(), -1).gather(1, out.text_targets[:, None])
    logp[out.text_index.rows, out.text_index.cols] = text[:, 0]
    if len(out.visual_index):
        if out.visual_targets.dim() == 2:
            z, b = out.visual_logits.float(), out.visual_targets.float()
            v = (
                b * torch.nn.functional.logsigmoid(z) + (1 - b) * torch.nn.functional.logsigmoid(-z)
            ).sum(-1)
        else:
            v = torch.log_softmax(out.visual_logits.float(), -1).gather(
                1, out.visual_targets[:, None]
            )[:, 0]
        logp[out.visual_index.rows, out.visual_index.cols] = v
    full = fused.logp["11"].cpu()
    assert (full - logp[fused.pos_row, fused.pos_col]).abs().max() <= VIEW_TOL
    # chunking changes nothing but the number of calls
    small = fused_views(model, batch, events, ALL_VIEWS, chunk_size=3)
    assert small.calls == math.ceil((2 * len(events) + 2 * two) / 3)
    for view in ALL_VIEWS:
        a, b = small.logp[view], fused.logp[view]
        assert torch.equal(a.isnan(), b.isnan())
        assert (a[~a.isnan()] - b[~b.isnan()]).abs().max() <= VIEW_TOL
    return fused


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_fused_views_equal_one_forward_per_view_tiny(kind):
    model = tiny_model(kind, init=0.3)
    fused = _check_fused(model, _batch(model))
    # the answer depends on the drawn image: blinding it changes the score
    assert (fused.scores["11"] - fused.scores["10"]).abs().max() > 1e-3


def test_fused_views_equal_one_forward_per_view_uniar():
    """UniAR (Qwen3-VL body, M-RoPE): the views reuse the full view's positions."""
    from model_fixtures import UNIAR_SIZES, random_bsq_codec

    from uniweave.models.uniar import build_tiny_uniar

    model = build_tiny_uniar(random_bsq_codec(16, 2, 1), UNIAR_SIZES, seed=0).eval()
    samples = make_task_samples("draw_then_answer", "val", 2, seed=2)
    trajs = [model.prompt_trajectory(s, add_generation_prompt=False) for s in samples]
    _check_fused(model, TrajectoryBatch.collate(trajs, model.special_ids.pad))


def test_carriers_against_numpy():
    rng = np.random.default_rng(0)
    nec = rng.normal(size=23)
    nec[5] = nec[6]  # a tie: the earlier position wins
    rows = np.sort(rng.integers(0, 4, size=23))
    t_nec, t_rows = torch.tensor(nec), torch.tensor(rows)
    got = carriers(t_nec, t_rows, "min_necessity", 0.2, 0.5).numpy()
    assert (got == (nec >= 0.2)).all()
    for f in (0.1, 0.5, 1.0):
        got = carriers(t_nec, t_rows, "fraction", 0.0, f).numpy()
        want = np.zeros(23, dtype=bool)
        for r in np.unique(rows):
            idx = np.nonzero(rows == r)[0]
            k = math.ceil(f * len(idx))
            order = sorted(idx, key=lambda i: (-nec[i], i))
            want[order[:k]] = True
        assert (got == want).all(), f


def _ref_jsd(p, q, beta):
    """β·KL(q ‖ m) + (1 − β)·KL(p ‖ m), m = (1 − β)p + βq, from torch.distributions
    (p, q distribution objects of one family with `probs`)."""
    m = type(p)(probs=(1 - beta) * p.probs + beta * q.probs)
    return beta * kl_divergence(q, m) + (1 - beta) * kl_divergence(p, m)


@pytest.mark.parametrize("beta", [0.5, 0.2])
def test_divergences_match_torch_distributions(beta):
    g = torch.Generator().manual_seed(1)
    zs = torch.randn(7, 11, generator=g, dtype=torch.float64) * 2
    zt = torch.randn(7, 11, generator=g, dtype=torch.float64) * 2
    # float64 logits: nd_text / nd_bits compute in float64 (promote_types(float64, float32)),
    # against torch.distributions' float64 (fp64_bound, the worst case): the softmax's and
    # the KL's sums over the 11 classes and ~10 elementwise roundings (logs, the mixture,
    # products); a class's term p log(p / m) weights its log's error, of scale |log p|, by
    # p, and p |log p| <= 1/e: scale 1. The gradient (p - m-weighted terms) likewise.
    tol = fp64_bound(1.0, 2 * zs.shape[-1] + 10)
    a = zs.clone().requires_grad_()
    got = nd_text(a, zt, beta)
    b = zs.clone().requires_grad_()
    ref = _ref_jsd(Categorical(logits=b), Categorical(logits=zt), beta)
    assert_within((got.double() - ref).abs(), tol, "nd value")
    (ga,) = torch.autograd.grad(got.sum(), a)
    (gb,) = torch.autograd.grad(ref.sum(), b)
    assert_within((ga.double() - gb).abs(), tol, "nd gradient")
    # bits: the per-factor Bernoulli JSD, mean over the L factors
    a = zs.clone().requires_grad_()
    got = nd_bits(a, zt, beta)
    b = zs.clone().requires_grad_()
    ref = _ref_jsd(Bernoulli(logits=b), Bernoulli(logits=zt), beta).mean(-1)
    assert_within((got.double() - ref).abs(), tol, "nd value")
    (ga,) = torch.autograd.grad(got.sum(), a)
    (gb,) = torch.autograd.grad(ref.sum(), b)
    assert_within((ga.double() - gb).abs(), tol, "nd gradient")


def _blind_logp(model, batch, e):
    """Per-position log-probs [len(e.targets)] of e's targets with e's source blinded:
    one single-row forward with its own mask (independent of the fused batch)."""
    sub = batch[[e.row]]
    T = sub.max_length
    inputs = model.prepare(sub)
    mask = blind_attention_mask(int(sub.lengths[0]), T, [e.source], e.target.end)[None]
    inputs = dataclasses.replace(inputs, attention_mask=mask)
    h = model.hidden(inputs).hidden[0]
    out = []
    for p in e.targets:
        if int(sub.modality[0, p]) == Modality.VISUAL:
            z = model.visual_logits(h[p - 1][None]).float()[0]
            c = sub.visual_codes[0, p]
            if c.dim():
                lp = (
                    c * torch.nn.functional.logsigmoid(z)
                    + (1 - c) * torch.nn.functional.logsigmoid(-z)
                ).sum()
            else:
                lp = torch.log_softmax(z, -1)[c]
        else:
            lp = torch.log_softmax(model.text_logits(h[p - 1][None]).float()[0], -1)[
                sub.token_ids[0, p]
            ]
        out.append(float(lp))
    return out


def _position_logits(out, row, col):
    """(logits, visual) of the SFT forward `out` at scored position (row, col)."""
    for index, logits, vis in ((out.text_index, out.text_logits, False),
                               (out.visual_index, out.visual_logits, True)):  # fmt: skip
        hit = ((index.rows == row) & (index.cols == col)).nonzero()
        if len(hit):
            return logits[int(hit[0, 0])], vis
    raise AssertionError((row, col))


@pytest.mark.parametrize(("kind", "selection"), [("vq", "fraction"), ("bsq", "min_necessity")])
def test_nd_term_matches_an_independent_computation(kind, selection):
    """The ND part of the SFT objective (its loss minus the plain SFT loss, values and
    gradients) equals λ · mean_i mean_{p ∈ C_i} JSD_β computed with torch.distributions
    on an explicit EMA copy θ̄ = μθ₀ + (1 − μ)θ₁, carriers from single-row blind views."""
    lam, mu, beta = 0.7, 0.6, 0.5
    model = tiny_model(kind, init=0.3).double()  # float64: the comparison is not rounding-bound
    batch = _batch(model)
    if kind == "bsq":
        batch.visual_codes = batch.visual_codes.double()
    nd = {"weight": lam, "ema_decay": mu, "beta": beta, "selection": selection}
    nd.update({"carrier_fraction": 0.5} if selection == "fraction" else {"min_necessity": 0.0})
    obj = SFTObjective(SFTConfig(necessity_distillation=nd), model)
    obj.begin_update(0, [batch], DistInfo())  # θ̄₀ = θ₀
    theta0 = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    obj.after_step()  # θ̄₁ = μθ₀ + (1 − μ)θ₁
    obj.begin_update(1, [batch], DistInfo())
    n = obj.count(batch)
    params = list(model.parameters())
    loss, stats = obj.loss(model, batch, n)
    plain, _ = SFTObjective(SFTConfig()).loss(model, batch, n)
    got = loss - plain
    got_grads = torch.autograd.grad(got, params, allow_unused=True)

    teacher = copy.deepcopy(model)
    with torch.no_grad():
        for pt, p0, p1 in zip(teacher.parameters(), theta0, model.parameters()):
            pt.copy_(mu * p0 + (1 - mu) * p1)
        t_out = forward_interleaved(teacher, batch)
    s_out = forward_interleaved(model, batch)
    scored = batch.policy_mask.clone()
    scored[:, 0] = False
    events = [e for row in batch_events(batch.modality == Modality.VISUAL, scored,
                                        batch.lengths) for e in row]  # fmt: skip
    per_row: dict[int, list[tuple[float, int]]] = {}  # row -> [(n_p, p)] in position order
    for e in events:
        with torch.no_grad():
            blind = _blind_logp(teacher, batch, e)
        for p, lb in zip(e.targets, blind):
            z, vis = _position_logits(t_out, e.row, p)
            z = z.double()
            if vis and kind == "bsq":
                lf = float(
                    Bernoulli(logits=z).log_prob(batch.visual_codes[e.row, p].double()).sum()
                )
            else:
                y = batch.visual_codes[e.row, p] if vis else batch.token_ids[e.row, p]
                lf = float(Categorical(logits=z).log_prob(y))
            per_row.setdefault(e.row, []).append((lf - lb, p))
    n_positions = sum(len(v) for v in per_row.values())
    n_carriers = 0
    ref_sum, rows = 0.0, 0
    for r, items in per_row.items():
        if selection == "fraction":
            k = math.ceil(0.5 * len(items))
            order = sorted(range(len(items)), key=lambda j: (-items[j][0], j))
            chosen = [items[j] for j in order[:k]]
        else:
            chosen = [x for x in items if x[0] >= 0.0]
        ds = []
        for _, p in chosen:
            zs, vis = _position_logits(s_out, r, p)
            zt, _ = _position_logits(t_out, r, p)
            fam = Bernoulli if vis and kind == "bsq" else Categorical
            d = _ref_jsd(fam(logits=zs.double()), fam(logits=zt.detach().double()), beta)
            ds.append(d.mean() if fam is Bernoulli else d)
        n_carriers += len(ds)
        if ds:
            ref_sum = ref_sum + torch.stack(ds).mean()
            rows += 1
    assert rows > 0 and 0 < n_carriers < n_positions  # a real selection
    assert stats["nd/carriers"] == n_carriers and stats["nd/positions"] == n_positions
    ref = lam * ref_sum / rows
    # float64 weights, float32 norms (tests/tolerances.py): the value is the objective's
    # loss minus the plain one, so its rounding is at the loss's scale; forwards over the
    # batch plus the means over its tokens. Not fp64_forward_bound: the BSQ case differs
    # by 3e-9 (float32 internals on its bits' path, 2e4 x the float64 bound), so the
    # forward's norms count as float32 (mixed_fp64_bound, the forward half). A wrong
    # carrier, weight or reduction moves it by ~its own size.
    cfg, tokens = model.config, int(batch.attention_mask.sum())
    fwd = tiny_decoder_reductions(cfg, batch.token_ids.shape[1])
    n32 = rmsnorm_fp32_reductions(cfg.hidden_size, cfg.num_layers)
    tol = mixed_fp64_bound(magnitude(loss), fwd + tokens, n32 // 2)
    assert_within(abs(float(got.detach()) - float(ref.detach())), tol, "nd term")
    ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
    n64 = gradient_reductions(fwd, tokens)
    for a, b in zip(got_grads, ref_grads):
        if b is None:
            assert a is None or a.abs().max() == 0
            continue
        assert a is not None
        assert_within((a.double() - b).abs(), mixed_fp64_bound(magnitude(b), n64, n32), "grad")
    assert float(got.detach()) > 0


def test_ema_follows_its_closed_form_and_swaps_exactly():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    net[0].bias.requires_grad_(False)  # frozen parameters are not shadowed
    mu, k = 0.8, 5
    ema = EMA(mu)
    ema.attach(net)
    trainable = [p for p in net.parameters() if p.requires_grad]
    history = [[p.detach().clone() for p in trainable]]
    for _ in range(k):
        with torch.no_grad():
            for p in trainable:
                p.add_(torch.randn_like(p))
        history.append([p.detach().clone() for p in trainable])
        ema.update()
    for j, s in enumerate(ema.shadow):
        closed = mu**k * history[0][j] + sum(
            (1 - mu) * mu ** (k - i) * history[i][j] for i in range(1, k + 1)
        )
        # float64 worst case (fp64_bound): k EMA updates (2 roundings each) and the closed
        # form's k + 1 scaled terms (2-3 roundings) and k additions in series, at the
        # scale of the largest parameter (the weights sum to 1)
        tol = fp64_bound(max(float(h[j].abs().max()) for h in history), 6 * k + 2)
        assert_within((s - closed).abs(), tol, "ema closed form")
    before = [p.detach().clone() for p in trainable]
    shadow = [s.clone() for s in ema.shadow]
    with ema.swapped():
        for p, s in zip(trainable, shadow):
            assert torch.equal(p, s)
    for p, b in zip(trainable, before):
        assert torch.equal(p, b)
    other = EMA(mu)
    other.load_state_dict(ema.state_dict())
    other.attach(net)
    assert_same_state(ema.state_dict(), other.state_dict())
    with pytest.raises(ValueError, match="decay"):
        EMA(0.5).load_state_dict(ema.state_dict())


def test_ema_shadow_resumes_bitwise_after_sigkill(tmp_path, small_vq_dir):
    """SFT with ND, killed after update 3 and resumed from the update-2 checkpoint, ends
    with the same model, optimizer and EMA shadow as the uninterrupted run, bit for bit."""
    sections = {
        "data": {"tasks": ["draw_then_answer"], "train_size": 8, "val_size": 0, "test_size": 0},
        "algorithm": {"name": "sft", "necessity_distillation": {"weight": 1.0, "ema_decay": 0.5}},
        "trainer": {"optimizer": {"lr": 3e-3}, "total_updates": 4, "global_batch_size": 4,
                    "micro_batch_size": 2},
    }  # fmt: skip
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref = run_cli(["train", str(write_config(tmp_path / "r.yaml",
                                              tiny_config(ref_dir, small_vq_dir, **sections)))])  # fmt: skip
    assert ref.returncode == 0, ref.stderr
    cfg = write_config(tmp_path / "k.yaml", tiny_config(run_dir, small_vq_dir, **sections))
    killed = run_cli(["train", str(cfg)], {"UNIWEAVE_FAULT": "after_update:3"})
    assert killed.returncode == -9, killed.stderr
    resumed = run_cli(["train", str(cfg)])
    assert resumed.returncode == 0, resumed.stderr
    a = checkpoint_tensors(ref_dir / "checkpoints" / "update-000004")
    b = checkpoint_tensors(run_dir / "checkpoints" / "update-000004")
    assert_same_state(a[0], b[0], "model")
    assert_same_state(a[1], b[1], "optimizer")
    shadow = a[1]["objective"]["ema"]["shadow"]
    assert shadow and any(not torch.equal(shadow[k], a[0][k]) for k in shadow if k in a[0])


def test_rollout_necessity_and_shaped_rewards_against_separate_forwards():
    """RL IG: N_i of each row's last event (its answer block) from the fused 11/10 views
    equals the full score of the ordinary forward minus the blind score of a separate
    blind forward; r' = r + λ·clip(N, −c, c) checked against numpy."""
    from uniweave.algorithms.necessity import rollout_necessity, shaped_rewards

    model = tiny_model("vq", init=0.3)
    batch = _batch(model, 3)
    n, has, calls = rollout_necessity(model, batch, chunk_size=4)
    assert has.all() and calls == math.ceil(2 * 3 / 4)
    last = {}
    for e in answer_events(batch):
        last[e.row] = e
    events = [last[r] for r in range(3)]
    assert all(not e.target.visual for e in events)  # draw_then_answer: the text answer
    blind, _ = blind_scores(model, batch, events, 8)
    with torch.no_grad():
        out = forward_interleaved(model, batch)
    for k, e in enumerate(events):
        full = []
        for p in e.targets:
            z, _ = _position_logits(out, e.row, p)
            full.append(float(torch.log_softmax(z.double(), -1)[batch.token_ids[e.row, p]]))
        assert abs(float(n[k]) - (sum(full) / len(full) - float(blind[k]))) <= VIEW_TOL
    r = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    got = shaped_rewards(r, n, 0.3, 0.05).numpy()
    want = r.numpy() + 0.3 * np.clip(n.numpy(), -0.05, 0.05)
    # float64, two roundings per side (the product and the sum, or one fused multiply-add)
    assert_within(np.abs(got - want), fp64_bound(float(np.abs(want).max()), 4), "shaped")


def test_opd_carrier_threshold_is_refused_without_necessity_carriers():
    """(The SFT and GRPO refusals are rows of tests/test_knobs.py's INERT table, whose
    default-value check reads SFT/GRPO defaults only.)"""
    from uniweave.config import ConfigError, validate_config

    opd = {"algorithm": {"name": "opd", "teacher": {"path": "t"}, "carrier_min_necessity": 0.1}}
    with pytest.raises(ConfigError, match="carrier_min_necessity: acts only with carriers"):
        validate_config(opd)
    opd["algorithm"]["carriers"] = "necessity"
    validate_config(opd)
    opd["algorithm"]["carriers"] = "all"
    opd["algorithm"]["carrier_min_necessity"] = 0.0  # the default where it does not act
    validate_config(opd)
