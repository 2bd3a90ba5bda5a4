"""GRPO's per-prompt diversity metrics (`uniweave.train.onpolicy.diversity`) against
independent numpy computations on fixed samples: the code distance by broadcasting, the
Vendi score from the singular values of the normalised features (eigenvalues of
K / n = X̂ X̂ᵀ / n are the squared singular values of X̂ / √n), the classifier's features
by hand from its weights, and the metrics of a real GRPO rollout recomputed from its
trajectories."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tolerances import assert_within, fp64_bound, magnitude, reduction_bound, sum_bound
from trainer_helpers import grpo_config

from uniweave.config import validate_config
from uniweave.core.sample import ImagePart, Sample, TextPart
from uniweave.models.build import build_model
from uniweave.rewards import DigitClassifierReward, PluginSpec, RewardService
from uniweave.rewards.digit_classifier import DigitClassifier
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.methods.grpo.job import build_grpo_job
from uniweave.train.onpolicy.diversity import code_distance, diversity_metrics, vendi_score

pytestmark = pytest.mark.usefixtures("one_thread")

# float64 eigen/singular value routines agree to ~1e-15 relative on these 4-8 row
# matrices; exp(entropy) of values in [1, 8] keeps that within 1e-12 absolute.
TOL = 1e-12


def code_distance_bound(groups: int, size: int) -> float:
    """float64 code distances against numpy's: per side a share per pair (a division), the
    sum over the size*(size-1)/2 pairs and its division, then the mean over `groups`
    groups: pairs + groups + 2 roundings of values <= 1 per side (fp64_bound, 2 sides)."""
    pairs = size * (size - 1) // 2
    return fp64_bound(1.0, 2 * (pairs + groups + 2))


def numpy_vendi(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    unit = x / np.sqrt((x**2).sum(axis=1, keepdims=True))
    s = np.linalg.svd(unit / np.sqrt(len(x)), compute_uv=False)
    p = s**2
    p = p[p > 1e-300]
    return float(np.exp(-(p * np.log(p)).sum()))


def numpy_code_distance(codes: np.ndarray) -> float:
    """codes [G, gh, gw] or [G, gh, gw, L]: mean over i<j of the differing-position share."""
    diff = codes[:, None] != codes[None, :]
    if diff.ndim == 5:
        diff = diff.any(axis=-1)
    share = diff.reshape(len(codes), len(codes), -1).mean(axis=-1)
    g = len(codes)
    return float(share[np.triu_indices(g, 1)].mean())


def test_vendi_matches_numpy_and_its_closed_forms():
    rng = np.random.default_rng(0)
    for n, d in [(2, 3), (4, 8), (8, 5), (6, 64)]:
        x = rng.normal(size=(n, d))
        assert abs(vendi_score(x) - numpy_vendi(x)) <= TOL
    same = np.tile(rng.normal(size=(1, 7)), (5, 1)) * np.arange(1, 6)[:, None]
    assert abs(vendi_score(same) - 1.0) <= TOL  # one direction (scaled): one "kind"
    assert abs(vendi_score(np.eye(6)) - 6.0) <= TOL  # orthogonal: n kinds
    # two orthogonal directions, 3 and 1 copies: eigenvalues 3/4, 1/4
    two = np.array([[1.0, 0], [2.0, 0], [1.0, 0], [0, 1.0]])
    expected = math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert abs(vendi_score(two) - expected) <= TOL


def test_code_distance_matches_numpy_for_vq_and_bsq():
    rng = np.random.default_rng(1)
    vq = rng.integers(0, 3, size=(5, 4, 4))
    got = code_distance([torch.from_numpy(c).long() for c in vq])
    assert abs(got - numpy_code_distance(vq)) <= code_distance_bound(1, len(vq))
    bsq = rng.integers(0, 2, size=(4, 3, 3, 2)).astype(np.float32)
    got = code_distance([torch.from_numpy(c) for c in bsq])
    assert abs(got - numpy_code_distance(bsq)) <= code_distance_bound(1, len(bsq))
    assert code_distance([torch.zeros(2, 2, dtype=torch.long)] * 3) == 0.0
    assert code_distance([torch.zeros(2, 2, dtype=torch.long)]) is None


def _member(prompt: int, m: int, task: str) -> Sample:
    return Sample(id=f"prompt-{prompt}", task=task, parts=[TextPart("q", "user")]).fork(m)


def test_metrics_of_fixed_groups_with_classifier_features(classifier_dir):
    """Two t2i groups of 4 fixed images (scored and featurised by the reward service) and
    two text groups: every metric recomputed by hand."""
    rng = np.random.default_rng(2)
    clf = DigitClassifier.from_pretrained(classifier_dir)
    codes = rng.integers(0, 4, size=(8, 2, 2))
    codes[1] = codes[0]  # a repeated sample in group 0
    pixels = rng.uniform(size=(8, 8, 8)).astype(np.float32)
    samples, responses = [], []
    for i in range(8):
        s = _member(i // 4, i % 4, "t2i")
        s.meta["digit"] = i % 10
        samples.append(s)
        img = ImagePart(pixels=pixels[i], codes=torch.from_numpy(codes[i]).long(), role="assistant")
        responses.append([img])
    texts = ["7", " 7 ", "1", None, "a  b", "a b", "a b", "c"]
    for i, t in enumerate(texts):
        samples.append(_member(2 + i // 4, i % 4, "i2t_open"))
        responses.append(None if t is None else [TextPart(t, "assistant")])
    service = RewardService(
        [PluginSpec(DigitClassifierReward(clf), tasks=frozenset({"t2i"}))],
        features=True,
        decode_images=lambda c: None,
    )
    result = service.score(samples, _trajs(samples), responses)
    assert result.feature_source == "digit_classifier"
    # the classifier's hidden activations by hand from its weights
    w = {k: v.double() for k, v in clf.net.state_dict().items()}
    x = torch.from_numpy(pixels).double().unsqueeze(1)
    h = torch.relu(torch.nn.functional.conv2d(x, w["0.weight"], w["0.bias"], padding=1))
    h = torch.relu(torch.nn.functional.conv2d(h, w["2.weight"], w["2.bias"], padding=1))
    h = torch.nn.functional.max_pool2d(h, 2).flatten(1)
    h = torch.relu(h @ w["6.weight"].T + w["6.bias"])
    feats = result.features[:8].double()
    # one float32 forward against float64 (sum_bound): the two 3x3 convolutions' and the
    # dense layer's reductions, at the activations' scale
    n = w["0.weight"][0].numel() + w["2.weight"][0].numel() + w["6.weight"].shape[1]
    assert_within((feats - h).abs(), sum_bound(magnitude(h), n), "classifier features")
    assert torch.isnan(result.features[8:]).all()  # text rows: the plugin does not apply
    metrics = diversity_metrics(samples, responses, result.features)
    f = result.features.numpy().astype(np.float64)
    expect_vendi = np.mean([numpy_vendi(f[0:4]), numpy_vendi(f[4:8])])
    expect_code = np.mean([numpy_code_distance(codes[0:4]), numpy_code_distance(codes[4:8])])
    # the same float32 features on both sides, float64 from there: TOL, the vendi bound
    assert abs(metrics["diversity/t2i/vendi"] - expect_vendi) <= TOL
    assert abs(metrics["diversity/t2i/code_distance"] - expect_code) <= code_distance_bound(2, 4)
    assert metrics["diversity/t2i/image_groups"] == 2.0
    # group 2: "7", "7", "1", unparsed -> 3; group 3: "a b" x3, "c" -> 2
    assert metrics["diversity/i2t_open/distinct_answers"] == 2.5
    assert metrics["diversity/i2t_open/distinct_frac"] == 2.5 / 4
    assert metrics["diversity/i2t_open/text_groups"] == 2.0
    assert not any(k.startswith("diversity/t2i/distinct") for k in metrics)


def _trajs(samples):
    """Stand-ins carrying the three fields RewardService reads of a trajectory (every row
    ended eos: no truncation shaping)."""

    class Ended:
        def __init__(self, sid):
            self.sample_id, self.finish_reason, self.length_semantics = sid, "eos", "cap"

    return [Ended(s.id) for s in samples]


def test_a_grpo_rollout_logs_the_diversity_of_its_groups(tmp_path, small_vq_dir, classifier_dir):
    """The metrics of a real t2i rollout (2 prompts x G=4) equal the numpy computation on
    its trajectories' codes and the classifier features of its decoded images."""
    assets = {"vq": small_vq_dir, "clf": classifier_dir}
    cfg = validate_config(grpo_config(tmp_path / "run", assets))
    model = build_model(cfg).train()
    source, _ = build_grpo_job(cfg, model, tmp_path / "run", DistInfo())
    rollout = source.rollout(0)
    metrics = rollout.metrics
    parts = [model.parse_response(t) for t in rollout.trajectories]
    codes = np.stack(
        [next(p.codes for p in ps if isinstance(p, ImagePart)).numpy() for ps in parts]
    )
    G = cfg.algorithm.group_size
    expect = np.mean([numpy_code_distance(codes[g : g + G]) for g in range(0, len(codes), G)])
    groups = len(codes) // G
    assert abs(metrics["diversity/t2i/code_distance"] - expect) <= code_distance_bound(groups, G)
    clf = DigitClassifier.from_pretrained(classifier_dir)
    pixels = model.codec.decode(torch.from_numpy(codes))
    f = clf.features(pixels).double().numpy()
    expect = np.mean([numpy_vendi(f[g : g + G]) for g in range(0, len(f), G)])
    # the service featurises the same decoded pixels with the same float32 network, the
    # same kernels on the same batch: the same features, float64 from there: TOL
    assert abs(metrics["diversity/t2i/vendi"] - expect) <= TOL
    assert 1.0 <= metrics["diversity/t2i/vendi"] <= G


def test_round_robin_merge_keeps_each_rows_features_and_sums_counts():
    """Rank r scored rows r, r + 2, ...: the merged features are in batch order, a shard
    without features gets NaN rows, and plugin counts add up."""
    from uniweave.rewards import RewardResult
    from uniweave.train.onpolicy.scoring import merge_round_robin

    def part(ids, features, counts):
        n = len(ids)
        z = torch.zeros(n)
        flags = {"p": torch.zeros(n, dtype=torch.bool)}
        return RewardResult(
            z,
            z,
            {"p": z},
            flags,
            flags,
            flags,
            flags["p"],
            flags["p"],
            sample_ids=ids,
            tasks=["t"] * n,
            counts=counts,
            features=features,
        )

    f0 = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    merged = merge_round_robin(
        [
            part(["a", "c"], f0, {"p": {"n_rows": 2.0, "n_judged": 1.0}}),
            part(["b"], None, {"p": {"n_rows": 1.0}}),
        ]
    )
    assert merged.sample_ids == ["a", "b", "c"]
    assert torch.equal(merged.features[[0, 2]], f0) and torch.isnan(merged.features[1]).all()
    assert merged.counts == {"p": {"n_rows": 3.0, "n_judged": 1.0}}
    assert merged.metrics()["reward/p/judged_frac"] == 1 / 3


def test_clip_features_are_the_image_embeddings_its_score_uses(tiny_clip_dir):
    """cos(text embedding, ClipScore.features) is the cosine the score is built from
    (`ClipScore.similarity`), and rows without one image get NaN features."""
    from uniweave.rewards.base import Response
    from uniweave.rewards.clip_score import ClipScore

    rng = np.random.default_rng(3)
    clip = ClipScore(tiny_clip_dir)
    images = [rng.uniform(size=(16, 16, 3)).astype(np.float32) for _ in range(3)]
    responses = [
        Response((ImagePart(pixels=px, role="assistant"),), (torch.from_numpy(px),))
        for px in images
    ] + [Response(parsed=False)]
    samples = [Sample(id=f"s{i}", parts=[TextPart("a red cat", "user")]) for i in range(4)]
    feats = clip.features(samples, responses)
    assert torch.isnan(feats[3]).all() and not torch.isnan(feats[:3]).any()
    inputs = clip.processor(text=["a red cat"], return_tensors="pt", padding=True)
    with torch.no_grad():
        text = clip.model.get_text_features(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
        ).pooler_output[0]
    cos = torch.nn.functional.cosine_similarity(feats[:3], text[None], dim=-1)
    expected = clip.similarity(["a red cat"] * 3, images)
    # the same float32 embeddings of width d, two cosine computations: each its three
    # d-term sums (two norms, the dot product), values <= 1 (tests/tolerances.py)
    tol = reduction_bound(1.0, 3 * text.shape[-1])
    assert_within((cos - expected).abs(), tol, "clip cosine")
