"""Soft-BSQ feature loss (issue 32 item 5): the expected code of the predicted bits and the
target's hard code through the codec's frozen code -> feature projection. Values and
gradients against an independent numpy float64 computation on the same logits; the
projection against the codec's own module; refusals before anything is written."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from rollout_fixtures import tiny_model, tokenizer
from tolerances import (
    assert_within,
    fp64_bound,
    fp64_forward_bound,
    gradient_reductions,
    magnitude,
    mixed_fp64_bound,
    reduction_bound,
    rmsnorm_fp32_reductions,
    tiny_decoder_reductions,
)

from uniweave.algorithms.sft import code_features, soft_bsq_distances
from uniweave.codecs import BSQTokenizer, BSQTokenizerConfig
from uniweave.codecs.base import single_thread
from uniweave.codecs.bsq import ungroup_bits
from uniweave.config import ConfigError, validate_config
from uniweave.config.algorithms import SFTConfig
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.digits import make_task_samples
from uniweave.data.template import serialize
from uniweave.forward import forward_interleaved
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.methods.sft.objective import SFTObjective

LAMBDA = 0.7


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _reference(z, bits, weight, bias, latent_dim, lam, n):
    """numpy float64, written from docs/numerics.md §2: value λ/N Σ_p ‖F(ĉ) − F(c)‖² and its
    gradient in z. F per L-bit cell: x ↦ W x + b; ĉ = (2σ(z) − 1)/√L, dĉ/dz = 2σ(1 − σ)/√L;
    d/dĉ ‖W(ĉ − c)‖² = 2 Wᵀ W (ĉ − c) per cell (the bias cancels in the difference)."""
    z, bits = np.asarray(z, np.float64), np.asarray(bits, np.float64)
    W, b = np.asarray(weight, np.float64), np.asarray(bias, np.float64)
    s = 1.0 / (1.0 + np.exp(-z))
    soft = (2.0 * s - 1.0) / math.sqrt(latent_dim)
    hard = (2.0 * bits - 1.0) / math.sqrt(latent_dim)
    cells = z.shape[1] // latent_dim
    value, grad = 0.0, np.zeros_like(z)
    for p in range(z.shape[0]):
        for k in range(cells):
            sl = slice(k * latent_dim, (k + 1) * latent_dim)
            diff = (W @ soft[p, sl] + b) - (W @ hard[p, sl] + b)
            value += float(diff @ diff)
            grad[p, sl] = 2.0 * (W.T @ diff) * 2.0 * s[p, sl] * (1.0 - s[p, sl])
            grad[p, sl] /= math.sqrt(latent_dim)
    return lam * value / n, lam * grad / n


@pytest.mark.parametrize("cells", [1, 4])
def test_distances_and_gradient_equal_numpy_float64(cells):
    """Pure function in float64 against the numpy reference: rtol 1e-10 (the same formula
    in another float64 order: a few hundred roundings of 1e-16 each)."""
    g = torch.Generator().manual_seed(cells)
    L, h, n = 4, 5, 7
    z = (3.0 * torch.randn(n, cells * L, generator=g, dtype=torch.float64)).requires_grad_()
    bits = (torch.rand(n, cells * L, generator=g) < 0.5).double()
    W = torch.randn(h, L, generator=g, dtype=torch.float64)
    b = torch.randn(h, generator=g, dtype=torch.float64)
    loss = LAMBDA * soft_bsq_distances(z, bits, W, b, L).sum() / n
    loss.backward()
    value, grad = _reference(z.detach(), bits, W, b, L, LAMBDA, n)
    assert float(loss.detach()) == pytest.approx(value, rel=1e-10)
    # float64 worst case per entry (fp64_bound): the cell's two W x + b (L products and
    # sums each), the difference, h more in W^T diff, the sigmoid and the chain's factors:
    # under 100 roundings in series, at the scale of the largest entry
    tol = fp64_bound(magnitude(torch.from_numpy(grad)), 100)
    assert_within((z.grad - torch.from_numpy(grad)).abs(), tol, "soft-bsq gradient")


def _rows(model, n, task="t2i"):
    samples = make_task_samples(task, "val", n, seed=4)
    bits = model.n_visual_outputs
    return [serialize(s, tokenizer(), encode_image=model.codec.encode, bits=bits) for s in samples]


def test_sft_objective_adds_the_term_with_the_numpy_value_and_gradient():
    """The tiny BSQ model, a real forward and backward: the objective with Soft-BSQ minus
    the objective without it equals the numpy value on the same visual logits, and its
    parameter gradient equals that of L_SFT + Σ z·G with G the numpy gradient in z (the
    chain rule through the same forward). The model runs with float64 weights (as under
    `trainer.precision: fp64`); its cross-entropies and some internals still compute in
    float32, so one combined backward and two separate ones differ by float32 roundings
    of the same linear maps: measured up to 1.8e-7 on the embeddings, bar 1e-6 relative to
    max(1, the largest entry) (docs/numerics.md §15). The value: 1e-10 (float64 sums).
    """
    model = tiny_model("bsq", init=0.3).to(torch.float64).train()
    rows = _rows(model, 3) + _rows(model, 1, "draw_then_answer")
    batch = TrajectoryBatch.collate(rows, model.special_ids.pad)
    on = SFTObjective(SFTConfig(soft_bsq={"weight": LAMBDA}))
    off = SFTObjective(SFTConfig())
    n = on.count(batch)
    on.begin_update(0, [batch], DistInfo())
    off.begin_update(0, [batch], DistInfo())
    weight, bias = model.codec.feature_projection()
    assert torch.equal(weight, model.codec.net.decoder[0].weight[:, :, 0, 0])

    model.zero_grad()
    loss_on, stats = on.loss(model, batch, n)
    loss_on.backward()
    grad_on = {k: p.grad.clone() for k, p in model.named_parameters()}

    model.zero_grad()
    loss_off, _ = off.loss(model, batch, n)
    out = forward_interleaved(model, batch)
    n_visual = len(out.visual_targets)
    assert n_visual == on.visual_global > 0
    value, grad = _reference(
        out.visual_logits.detach(), out.visual_targets, weight, bias,
        model.codec.latent_dim, LAMBDA, n_visual,
    )  # fmt: skip
    surrogate = loss_off + (out.visual_logits * torch.tensor(grad)).sum()
    surrogate.backward()
    assert float((loss_on - loss_off).detach()) == pytest.approx(value, rel=1e-10)
    cfg, tokens = model.config, int(batch.attention_mask.sum())
    n64 = gradient_reductions(tiny_decoder_reductions(cfg, batch.token_ids.shape[1]), tokens)
    n32 = rmsnorm_fp32_reductions(cfg.hidden_size, cfg.num_layers)
    for k, p in model.named_parameters():
        tol = mixed_fp64_bound(magnitude(grad_on[k]), n64, n32)
        assert_within((grad_on[k] - p.grad).abs(), tol, k)
    # logged: the mean distance per scored visual position (λ not applied)
    fin = on.finalize({**stats}, n)
    assert fin["soft_bsq"] == pytest.approx(value / LAMBDA, rel=1e-10)


def test_split_across_micro_batches_gives_one_loss():
    """Normalised by the global batch's visual positions: 1 + 3 rows sum to the 4-row loss."""
    model = tiny_model("bsq", init=0.3)
    rows = _rows(model, 4)
    whole = TrajectoryBatch.collate(rows, model.special_ids.pad)
    parts = [TrajectoryBatch.collate(r, model.special_ids.pad) for r in (rows[:1], rows[1:])]
    obj = SFTObjective(SFTConfig(soft_bsq={"weight": LAMBDA}))
    n = obj.count(whole)
    obj.begin_update(0, [whole], DistInfo())
    one, _ = obj.loss(model, whole, n)
    obj.begin_update(0, parts, DistInfo())
    split = sum(obj.loss(model, m, n)[0] for m in parts)
    assert float(split.detach()) == pytest.approx(float(one.detach()), rel=1e-6)


@pytest.mark.parametrize("group", [1, 2])
def test_projection_is_the_tokenizers_post_quant_embed_per_cell(group):
    """F of a composite position = the tokenizer's own `post_quant_embed` applied to each of
    its k² cells (after `ungroup_bits`), concatenated in (dy, dx) order. float32, same
    products in another order: reduction_bound over the L bits and the bias."""
    torch.manual_seed(0)
    cfg = BSQTokenizerConfig(
        image_size=16, num_channels=1, patch_size=4, hidden_size=6, num_layers=1,
        embed_dim=3, spatial_group=group,
    )  # fmt: skip
    tok = BSQTokenizer(cfg)
    gh, gw = cfg.grid
    bits = (torch.rand(2, gh, gw, cfg.bits_per_position) < 0.5).float()
    weight, bias = tok.feature_projection()
    ours = code_features(tok.bits_to_vectors(bits).reshape(-1, cfg.bits_per_position),
                         weight, bias, cfg.embed_dim)  # fmt: skip
    cells = ungroup_bits(tok.bits_to_vectors(bits), group, cfg.embed_dim)  # [2, gh*k, gw*k, L]
    feats = tok.net.post_quant_embed(cells.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    k, h = group, cfg.hidden_size
    want = feats.reshape(2, gh, k, gw, k, h).permute(0, 1, 3, 2, 4, 5).reshape(-1, k * k * h)
    tol = reduction_bound(magnitude(want), cfg.bits_per_position + 1)
    assert_within((ours - want).abs(), tol, "projection")


def _cfg(tmp_path, **sections):
    base = {
        "run": {"name": "t", "output_dir": str(tmp_path / "run"), "device": "cpu"},
        "model": {"kind": "tiny", "visual_head": "bsq"},
        "algorithm": {"name": "sft", "soft_bsq": {"weight": 0.5}},
    }
    return {**base, **sections}


@pytest.mark.parametrize(
    "sections,why",
    [
        ({"model": {"kind": "tiny", "visual_head": "vq"}}, "visual_head bsq"),
        ({"data": {"tasks": ["i2t_mc", "jigsaw_mc"]}}, "text-only"),
    ],
)
def test_refused_at_config_time_before_anything_is_written(tmp_path, sections, why):
    with pytest.raises(ConfigError) as err:
        validate_config(_cfg(tmp_path, **sections))
    assert err.value.key == "algorithm.soft_bsq.weight" and why in str(err.value)
    assert not (tmp_path / "run").exists()


def test_dataset_rows_without_an_image_answer_are_refused_by_preflight(tmp_path):
    from uniweave.train.run import run_train

    rows = tmp_path / "rows.jsonl"
    row = {"id": "a", "task": "qa", "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}  # fmt: skip
    rows.write_text(json.dumps(row) + "\n")
    data = {"path": str(rows), "tasks": ["qa"], "val_size": 0, "test_size": 0}
    cfg = validate_config(_cfg(tmp_path, data=data))
    with pytest.raises(ConfigError) as err:
        run_train(cfg)
    assert err.value.key == "algorithm.soft_bsq.weight" and "image" in str(err.value)
    assert not (tmp_path / "run").exists()


def test_soft_bsq_is_invariant_to_sequence_packing():
    """`trainer.packing` (not refused): the packed batch gives the same Soft-BSQ loss and
    gradients as the padded one — float64 weights, float32 norms: the bounds of packing's
    own test (tests/test_packing.py)."""
    from uniweave.train.engine.batching import pack

    model = tiny_model("bsq", init=0.3).to(torch.float64)
    rows = _rows(model, 3) + _rows(model, 2, "draw_then_answer")
    pad = model.special_ids.pad
    plain, packed = TrajectoryBatch.collate(rows, pad), pack(rows, pad)
    assert len(packed.sample_ids) < len(plain.sample_ids)
    results = []
    for batch in (plain, packed):
        obj = SFTObjective(SFTConfig(soft_bsq={"weight": LAMBDA}))
        obj.begin_update(0, [batch], DistInfo())
        model.zero_grad()
        loss, stats = obj.loss(model, batch, obj.count(batch))
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((float(loss.detach()), stats["soft_bsq_sum"], grads, obj.visual_global))
    (l0, s0, g0, n0), (l1, s1, g1, n1) = results
    cfg, tokens = model.config, int(plain.attention_mask.sum())
    fwd = tiny_decoder_reductions(cfg, plain.token_ids.shape[1])
    assert n0 == n1 and s0 == pytest.approx(s1, rel=1e-6)
    assert_within(abs(l0 - l1), fp64_forward_bound(magnitude(l0), fwd + tokens), "loss")
    n64 = gradient_reductions(fwd, tokens)
    n32 = rmsnorm_fp32_reductions(cfg.hidden_size, cfg.num_layers)
    for k in g0:
        tol = mixed_fp64_bound(magnitude(g0[k]), n64, n32)
        assert_within((g0[k] - g1[k]).abs(), tol, k)


def test_uniar_composite_positions():
    """UniAR (Qwen3-VL body) with a 2×2-grouped BSQ codec (composite positions of 4 cells of 8 bits):
    the objective's Soft-BSQ term equals the numpy value on the same logits, F applied per
    cell with the codec's `decoder[0]`. float32 forward: 1e-6 relative."""
    from model_fixtures import UNIAR_SIZES, random_bsq_codec

    from uniweave.models.uniar import build_tiny_uniar

    codec = random_bsq_codec(8, 2, 2)
    model = build_tiny_uniar(codec, UNIAR_SIZES, seed=0).eval()
    assert model.n_visual_outputs == 4 * 8
    samples = make_task_samples("t2i", "val", 2, seed=2)
    trajs = [model.prompt_trajectory(s, add_generation_prompt=False) for s in samples]
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    on, off = (SFTObjective(SFTConfig(**kw)) for kw in ({"soft_bsq": {"weight": LAMBDA}}, {}))
    n = on.count(batch)
    for obj in (on, off):
        obj.begin_update(0, [batch], DistInfo())
    with torch.no_grad():
        diff = on.loss(model, batch, n)[0] - off.loss(model, batch, n)[0]
        out = forward_interleaved(model, batch)
    weight, bias = codec.feature_projection()
    value, _ = _reference(out.visual_logits, out.visual_targets, weight, bias, 8, LAMBDA,
                          len(out.visual_targets))  # fmt: skip
    assert len(out.visual_targets) > 0
    assert float(diff) == pytest.approx(value, rel=1e-6)
