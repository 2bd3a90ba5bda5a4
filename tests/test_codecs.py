"""Image codecs on the real 8x8 digits: shapes, BSQ numerics, persistence, acceptance."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans
from tolerances import assert_within, reduction_bound, sum_bound

from uniweave.codecs import BSQCodec, VQCodec, build_codec, load_codec
from uniweave.codecs.base import to_patches
from uniweave.codecs.bsq import bsq_entropy_terms, group_bits, quantize, sub_codebook, ungroup_bits
from uniweave.codecs.vq import DIST_ROWS, _sq_dists, kmeans
from uniweave.data.digits_images import load_split
from uniweave.rewards.codec_report import codec_report


@pytest.fixture(scope="module")
def train():
    return load_split("train")


@pytest.fixture(scope="module")
def test_images():
    return load_split("test").images


@pytest.fixture(scope="module")
def vq(train):
    return VQCodec().fit(train.images, seed=0)


@pytest.fixture(scope="module")
def bsq(train):
    return BSQCodec().fit(train.images, seed=0)


@pytest.fixture(scope="module")
def classifier(digits_classifier):
    return digits_classifier


def test_vq_shapes_dtypes_and_range(vq, test_images):
    codes = vq.encode(test_images)
    assert vq.grid == (4, 4)
    assert codes.dtype == torch.long and codes.shape == (len(test_images), 4, 4)
    assert int(codes.min()) >= 0 and int(codes.max()) < vq.codebook_size
    pixels = vq.decode(codes)
    assert pixels.dtype == torch.float32 and pixels.shape == (len(test_images), 8, 8)
    assert float(pixels.min()) >= 0.0 and float(pixels.max()) <= 1.0


def test_vq_encode_is_the_nearest_codeword(vq, test_images):
    images = test_images[:50].astype(np.float64)
    book = vq.codebook.double().numpy()
    codes = vq.encode(test_images[:50]).numpy()
    for i in range(4):
        for j in range(4):
            patch = images[:, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2].reshape(50, 4)
            dist = ((patch[:, None, :] - book[None]) ** 2).sum(-1)
            chosen = dist[np.arange(50), codes[:, i, j]]
            # encode picks by float32 |x|^2 - 2 x.c + |c|^2 (three 4-term sums, 2 adds) at
            # the scale |x|^2 + |c|^2: its pick is within twice one path's error of the min
            scale = float((patch**2).sum(1).max() + (book**2).sum(1).max())
            tol = 2 * sum_bound(scale, 3 * patch.shape[1] + 2)
            assert_within(np.abs(chosen - dist.min(1)), tol, "nearest codeword")
    decoded = vq.decode(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(
        decoded[:, :2, :2].reshape(50, 4), book[codes[:, 0, 0]].astype(np.float32)
    )


@pytest.mark.parametrize("dim", [4, 16])
def test_sq_dists_in_blocks_equal_the_one_pass_formula(dim):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2 * DIST_ROWS + 37, dim, generator=g, dtype=torch.float64)
    centers = torch.rand(9, dim, generator=g, dtype=torch.float64)
    assert torch.equal(_sq_dists(x, centers), (x[:, None] - centers[None]).pow(2).sum(-1))
    x32, c32 = x.float(), centers.float()
    assert torch.equal(_sq_dists(x32, c32), (x32[:, None] - c32[None]).pow(2).sum(-1))


def test_kmeans_inertia_close_to_sklearn(train):
    x = to_patches(torch.from_numpy(train.images[:400]), 2).reshape(-1, 4).double()
    _, ours = kmeans(x, 32, torch.Generator().manual_seed(0))
    ref = KMeans(n_clusters=32, n_init=1, random_state=0).fit(x.numpy()).inertia_
    print(f"k-means inertia ours {ours:.3f} sklearn {ref:.3f}")
    assert ours <= 1.05 * ref


def test_vq_fit_is_deterministic_for_a_seed(train):
    a = VQCodec(codebook_size=16, n_init=1).fit(train.images[:200], seed=3)
    b = VQCodec(codebook_size=16, n_init=1).fit(train.images[:200], seed=3)
    c = VQCodec(codebook_size=16, n_init=1).fit(train.images[:200], seed=4)
    assert torch.equal(a.codebook, b.codebook)
    assert not torch.equal(a.codebook, c.codebook)


def test_bsq_bits_and_unit_vectors(bsq, test_images):
    bits = bsq.encode(test_images)
    L = bsq.latent_dim
    assert bsq.grid == (4, 4) and bsq.bits_per_position == L
    assert bits.dtype == torch.float32 and bits.shape == (len(test_images), 4, 4, L)
    assert bool(((bits == 0) | (bits == 1)).all())
    vectors = bsq.bits_to_vectors(bits)
    # one float32 norm of L entries +-1/sqrt(L) (each rounded once): L squares and
    # additions and a sqrt against the exact 1 (sum_bound)
    err = (vectors.norm(dim=-1) - 1).abs()
    assert_within(err, sum_bound(1.0, 2 * L + 2), "unit vectors")
    assert torch.equal(vectors.abs(), torch.full_like(vectors, 1 / math.sqrt(L)))
    assert torch.equal(vectors > 0, bits.bool())
    with torch.no_grad():
        u = bsq.net.latents(torch.from_numpy(test_images))
    assert torch.equal(bits, (u > 0).float().permute(0, 2, 3, 1))
    pixels = bsq.decode(bits)
    assert pixels.dtype == torch.float32 and pixels.shape == (len(test_images), 8, 8)
    assert float(pixels.min()) >= 0.0 and float(pixels.max()) <= 1.0


def test_straight_through_forward_value_and_identity_gradient():
    u = torch.nn.functional.normalize(torch.randn(5, 8, 2, 2), dim=1).requires_grad_(True)
    c_hat = quantize(u)
    # bound: u + sg(c - u) rounds twice, at |c - u| <= 2/sqrt(8) and |c| = 1/sqrt(8), and c itself once: 4 x 2^-24 / sqrt(8) ~ 8.4e-8 < 1e-7
    assert torch.allclose(c_hat, torch.sign(u.detach()) / math.sqrt(8), atol=1e-7)
    weights = torch.randn_like(c_hat)
    (c_hat * weights).sum().backward()
    assert torch.allclose(u.grad, weights)


def test_straight_through_gradient_reaches_the_encoder(train):
    codec = BSQCodec(hidden=8, epochs=1).fit(train.images[:64])
    codec.net.zero_grad()
    loss, _ = codec.loss(torch.from_numpy(train.images[:32]))
    loss.backward()
    for name, p in codec.net.encoder.named_parameters():
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
    assert float(codec.net.proj.weight.grad.abs().sum()) > 0
    codec.net.zero_grad()
    recon_only = torch.nn.functional.mse_loss(
        codec.net.decode(quantize(codec.net.latents(torch.from_numpy(train.images[:32])))),
        torch.from_numpy(train.images[:32]),
    )
    recon_only.backward()
    assert float(codec.net.encoder[0].weight.grad.abs().sum()) > 0


def test_bsq_entropy_terms_match_softmax_and_bernoulli_forms():
    gen = torch.Generator().manual_seed(0)
    L, g, tau = 8, 4, 3.0
    u = torch.nn.functional.normalize(torch.randn(50, L, generator=gen), dim=-1)
    codebook = sub_codebook(g, L)
    assert codebook.shape == (16, 4) and torch.equal(codebook.abs(), torch.full((16, 4), L**-0.5))
    h_sample, h_codebook = bsq_entropy_terms(u, codebook, tau)
    # softmax over the group's 2^g sub-codes, enumerated explicitly
    logits = torch.stack([2 * tau * u[:, j * g : (j + 1) * g] @ codebook.T for j in range(2)], 1)
    q = torch.distributions.Categorical(logits=logits)
    # two float32 paths to a group's 2^g-way entropy: the g-term logits, a 2^g-term
    # logsumexp and entropy sum, the sum over groups and the mean over rows, at the
    # entropies' scale (<= L log 2 per row)
    n_h = g + 3 * 2**g + L // g + u.shape[0]
    want = q.entropy().sum(-1).mean()
    assert_within((h_sample - want).abs(), reduction_bound(L * math.log(2), n_h), "h_sample")
    # the same distribution as a product of per-bit Bernoulli(sigmoid(4 tau u / sqrt(L)))
    p1 = torch.sigmoid(4 * tau * u / math.sqrt(L))
    expected = 0.0
    for j in range(L // g):
        pj = p1[:, j * g : (j + 1) * g]
        subs = [(s >> torch.arange(g - 1, -1, -1)) & 1 for s in range(2**g)]
        prod = torch.stack([torch.where(b.bool(), pj, 1 - pj).prod(-1) for b in subs], dim=-1)
        # a probability two ways: g sigmoids and g - 1 products vs a 2^g-way softmax of
        # g-term logits; its error is p x its log's, relative to |log p|: p |log p| <= 1/e,
        # so scale 1
        n_p = 2 * g + 3 + g + 2 * 2**g
        assert_within((prod - q.probs[:, j]).abs(), reduction_bound(1.0, n_p), "sub-code p")
        expected += torch.distributions.Categorical(probs=prod.mean(0)).entropy()
    # each group: the mean of the rows' probabilities, a 2^g-term entropy; two groups
    tol = reduction_bound(L * math.log(2), n_h + 2 * 2**g)
    assert_within((h_codebook - expected).abs(), tol, "h_codebook")


def test_grouping_round_trip(bsq, test_images):
    bits = bsq.encode(test_images[:20])
    grouped_codec = bsq.with_group(2)
    grouped = grouped_codec.encode(test_images[:20])
    L = bsq.latent_dim
    assert grouped_codec.grid == (2, 2) and grouped_codec.bits_per_position == 4 * L
    assert grouped.shape == (20, 2, 2, 4 * L)
    assert torch.equal(grouped, group_bits(bits, 2))
    assert torch.equal(ungroup_bits(grouped, 2, L), bits)
    top_left = torch.cat([bits[:, 0, 0], bits[:, 0, 1], bits[:, 1, 0], bits[:, 1, 1]], dim=-1)
    assert torch.equal(grouped[:, 0, 0], top_left)
    assert torch.equal(grouped_codec.decode(grouped), bsq.decode(bits))
    vectors = grouped_codec.bits_to_vectors(grouped)
    # 4 unit cells: 4L squares and additions and a sqrt against the exact 2 (sum_bound)
    err = (vectors.norm(dim=-1) - 2.0).abs()
    assert_within(err, sum_bound(2.0, 2 * vectors.shape[-1] + 2), "grouped unit vectors")


def test_bsq_fit_is_deterministic_for_a_seed(train):
    a = BSQCodec(hidden=8, epochs=2).fit(train.images[:128], seed=5)
    b = BSQCodec(hidden=8, epochs=2).fit(train.images[:128], seed=5)
    for key, value in a.tensors().items():
        assert torch.equal(value, b.tensors()[key]), key


@pytest.mark.parametrize("which", ["vq", "bsq", "bsq_grouped"])
def test_save_pretrained_round_trips_bitwise(which, vq, bsq, test_images, tmp_path):
    codec = {"vq": vq, "bsq": bsq, "bsq_grouped": bsq.with_group(2)}[which]
    codec.save_pretrained(tmp_path / which)
    assert json.loads((tmp_path / which / "codec.json").read_text())["kind"] == codec.kind
    loaded = load_codec(tmp_path / which)
    assert type(loaded) is type(codec) and loaded.config() == codec.config()
    assert type(codec).from_pretrained(tmp_path / which).grid == codec.grid
    codes = codec.encode(test_images)
    assert torch.equal(loaded.encode(test_images), codes)
    assert torch.equal(loaded.decode(codes), codec.decode(codes))


def test_acceptance_reconstructions_keep_90_percent_of_accuracy(vq, bsq, classifier):
    for name, codec in (("vq", vq), ("bsq", bsq)):
        r = codec_report(codec, classifier, split="test")
        print(
            f"{name}: mse {r['mse']:.4f} acc_original {r['acc_original']:.3f} "
            f"acc_reconstruction {r['acc_reconstruction']:.3f} ratio {r['acc_ratio']:.3f} n {r['n']}"
        )
        assert r["n"] == 269
        assert r["acc_reconstruction"] >= 0.90 * r["acc_original"], name
        assert math.isclose(r["acc_ratio"], r["acc_reconstruction"] / r["acc_original"])


def test_build_codec_dispatch_and_errors():
    assert isinstance(build_codec("vq", codebook_size=8), VQCodec)
    codec = build_codec("bsq", latent_dim=4, entropy_group=2, group=2)
    assert isinstance(codec, BSQCodec) and codec.grid == (2, 2) and codec.bits_per_position == 16
    with pytest.raises(ValueError, match="unknown codec kind 'rvq'"):
        build_codec("rvq")
    with pytest.raises(ValueError, match="invalid 'vq' codec config"):
        build_codec("vq", bits=3)
    with pytest.raises(ValueError, match="entropy_group must divide latent_dim"):
        BSQCodec(latent_dim=6, entropy_group=4)
    with pytest.raises(ValueError, match="group must divide"):
        BSQCodec(group=3)


def test_bad_inputs_raise_clear_errors(vq, bsq, test_images):
    x = test_images[:4]
    for codec in (vq, bsq):
        with pytest.raises(ValueError, match=r"shape \[N, 8, 8\]"):
            codec.encode(x.reshape(4, 64))
        with pytest.raises(ValueError, match=r"in \[0, 1\]"):
            codec.encode(x * 16.0)
        with pytest.raises(ValueError, match="non-finite"):
            codec.encode(np.full((1, 8, 8), np.nan, dtype=np.float32))
        with pytest.raises(ValueError, match="numpy array or torch tensor"):
            codec.encode(x.tolist())
    with pytest.raises(ValueError, match=rf"must lie in \[0, {vq.codebook_size}\)"):
        vq.decode(torch.full((1, 4, 4), vq.codebook_size))
    with pytest.raises(ValueError, match="integer"):
        vq.decode(torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match=r"shape \[N, 4, 4\]"):
        vq.decode(torch.zeros(1, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"values in \{0, 1\}"):
        bsq.decode(torch.full((1, 4, 4, bsq.latent_dim), 0.5))
    with pytest.raises(ValueError, match=r"shape \[N, 4, 4, "):
        bsq.decode(torch.zeros(1, 2, 2, 4 * bsq.latent_dim))
    with pytest.raises(ValueError, match="bits must end in a dim"):
        bsq.bits_to_vectors(torch.zeros(3, 5))
    with pytest.raises(RuntimeError, match="not fitted"):
        VQCodec().encode(x)
    with pytest.raises(RuntimeError, match="not fitted"):
        BSQCodec().save_pretrained("unused")


def test_codec_directory_errors_name_the_path(vq, bsq, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_codec(tmp_path / "nowhere")
    vq.save_pretrained(tmp_path / "vq")
    (tmp_path / "vq" / "codec.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "vq" / "codec.safetensors")):
        load_codec(tmp_path / "vq")
    bsq.save_pretrained(tmp_path / "bsq")
    with pytest.raises(ValueError, match="holds a 'bsq' codec, not 'vq'"):
        VQCodec.from_pretrained(tmp_path / "bsq")
    (tmp_path / "bsq" / "codec.json").write_text(json.dumps({"kind": "rvq"}))
    with pytest.raises(ValueError, match="unknown codec kind 'rvq'"):
        load_codec(tmp_path / "bsq")
    (tmp_path / "bsq" / "codec.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_codec(tmp_path / "bsq")
