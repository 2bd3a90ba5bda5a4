"""CLIP / PickScore-style reward on a tiny random `CLIPModel` saved to a temporary
directory: the score against CLIP's own logits, config building and its errors, and the
reward service on Janus-Pro text-to-image rollouts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tolerances import (
    assert_within,
    decoder_reductions,
    elementwise_bound,
    magnitude,
    reduction_bound,
)
from transformers import CLIPModel, CLIPProcessor

from uniweave.codecs.base import single_thread
from uniweave.config import ConfigError, RewardConfig, RewardPluginConfig
from uniweave.core.sample import GenerationRequest, ImagePart, Sample, TextPart
from uniweave.models.janus_pro import JanusProModel
from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint
from uniweave.rewards import PLUGINS, Response, build_plugin, build_reward_service
from uniweave.rewards.clip_score import ClipScore, prompt_text
from uniweave.rollout import RolloutEngine, RolloutRequest, SamplingParams


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is far faster (and immune to a busy second core)."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def clip_dir(tiny_clip_dir) -> Path:
    return tiny_clip_dir


def _images(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((20, 24, 3), dtype=np.float32) for _ in range(n)]


def clip_reductions(model: CLIPModel) -> int:
    """tests/tolerances.py's N for a CLIP similarity: each tower a pre-norm transformer
    (`decoder_reductions` over its sequence: the text's longest, the vision's patches and
    class token) with its final norm and projection, then the cosine's three sums over the
    projection width."""
    t, v = model.config.text_config, model.config.vision_config
    proj = model.config.projection_dim

    def tower(c, keys: int) -> int:
        head_dim = c.hidden_size // c.num_attention_heads
        return decoder_reductions(
            c.hidden_size, c.intermediate_size, c.num_hidden_layers, keys, head_dim,
            head=2 * c.hidden_size,
        )  # fmt: skip

    patches = (v.image_size // v.patch_size) ** 2 + 1
    return tower(t, t.max_position_embeddings) + tower(v, patches) + 3 * proj


def _reference_logits(clip_dir: Path, texts: list[str], images: list[np.ndarray]) -> torch.Tensor:
    """exp(logit_scale) * cos per aligned pair, from CLIPModel's own forward."""
    model = CLIPModel.from_pretrained(str(clip_dir)).eval()
    processor = CLIPProcessor.from_pretrained(str(clip_dir))
    inputs = processor(
        text=texts, images=images, return_tensors="pt", padding=True, do_rescale=False
    )
    with torch.no_grad():
        return model(**inputs).logits_per_image.diagonal()


def test_scores_equal_clip_logits_and_clipscore(clip_dir):
    texts = ["a red cat", "photo of a dog", "a cat"]
    images = _images(3)
    samples = [Sample(f"s{k}", [TextPart(t), GenerationRequest(4, 4)]) for k, t in enumerate(texts)]
    responses = [
        Response((ImagePart(pixels=px, role="assistant"),), (torch.from_numpy(px),))
        for px in images
    ]
    expected = _reference_logits(clip_dir, texts, images)
    pick = ClipScore(clip_dir, batch_size=2)
    # two float32 paths (batches of 2 vs 3) through both towers: at the logits' scale
    # (logit_scale x cosine); clipscore: 2.5 x a cosine, at scale 1
    n = clip_reductions(pick.model)
    tol = reduction_bound(magnitude(expected), n)
    assert_within((pick.score(samples, responses) - expected).abs(), tol, "clip logits")
    clip = ClipScore(clip_dir, mode="clipscore")
    scale = math.exp(float(clip.model.logit_scale.detach()))
    want = 2.5 * (expected / scale).clamp(min=0)
    tol = 2.5 * reduction_bound(1.0, n) + elementwise_bound(want, 2)
    assert_within((clip.score(samples, responses) - want).abs(), tol, "clipscore")
    assert pick.invalid_format(samples, responses) == [False] * 3


def test_prompt_text_and_invalid_rows(clip_dir):
    sample = Sample("c", [TextPart("a cat"), TextPart("ignored", "assistant")])
    assert prompt_text(sample) == "a cat"
    assert prompt_text(Sample("m", [TextPart("x")], meta={"caption": "a red dog"})) == "a red dog"
    px = _images(1)[0]
    gray = torch.from_numpy(px[:, :, 0])
    rows = [
        Response((ImagePart(pixels=px[:, :, 0], role="assistant"),), (gray,)),  # grey is fine
        Response(parsed=False),
        Response((TextPart("a cat", "assistant"),)),
        Response((), (torch.from_numpy(px), torch.from_numpy(px))),
    ]
    scorer = ClipScore(clip_dir)
    samples = [sample] * 4
    assert scorer.invalid_format(samples, rows) == [False, True, True, True]
    scores = scorer.score(samples, rows)
    assert scores[0] != 0 and (scores[1:] == 0).all()


def test_registered_plugin_built_from_config_with_clear_errors(clip_dir, tmp_path):
    assert PLUGINS["clip_score"] is ClipScore and PLUGINS["pickscore"] is ClipScore
    cfg = RewardPluginConfig(name="pickscore", path=str(clip_dir), kwargs={"device": "cpu"})
    plugin = build_plugin(cfg, "reward.plugins.0")
    assert isinstance(plugin, ClipScore) and plugin.device == torch.device("cpu")
    bad = [
        (RewardPluginConfig(name="clip_score"), "reward.plugins.0.path"),
        (RewardPluginConfig(name="clip_score", path=str(tmp_path)), "reward.plugins.0.path"),
        (
            RewardPluginConfig(name="clip_score", path=str(clip_dir), kwargs={"mode": "x"}),
            "reward.plugins.0.kwargs",
        ),
        (
            RewardPluginConfig(name="clip_score", path=str(clip_dir), kwargs={"colour": 1}),
            "reward.plugins.0.kwargs.colour",
        ),
    ]
    if not torch.cuda.is_available():
        cuda = RewardPluginConfig(name="clip_score", path=str(clip_dir), kwargs={"device": "cuda"})
        bad.append((cuda, "reward.plugins.0.kwargs"))
    for config, key in bad:
        with pytest.raises(ConfigError) as err:
            build_plugin(config, "reward.plugins.0")
        assert key in str(err.value)
    remote = tmp_path / "remote"
    remote.mkdir()
    config = json.loads((clip_dir / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(ValueError, match="remote code"):
        ClipScore(remote)


def test_janus_t2i_rollouts_are_scored_and_never_shaped_as_truncated(clip_dir, tmp_path):
    janus = JanusProModel.from_pretrained(write_tiny_checkpoint(tmp_path, TinyJanusSpec()))
    samples = [
        Sample(f"p/{k}", [TextPart(t), GenerationRequest(4, 4)], task="t2i")
        for k, t in enumerate(["a red cat", "a dog"])
    ]
    params = SamplingParams(guidance=5.0, max_new_tokens=16, length_semantics="exact")
    trajs = RolloutEngine(janus).generate(
        [RolloutRequest(s, k, params) for k, s in enumerate(samples)]
    )
    assert [t.finish_reason for t in trajs] == ["length_exact"] * 2  # 16 of 16: not truncated
    cfg = RewardConfig(plugins=[RewardPluginConfig(name="clip_score", path=str(clip_dir))])
    service = build_reward_service(cfg, decode_images=janus.codec.decode)
    result = service.score(samples, trajs, [janus.parse_response(t) for t in trajs])
    assert not result.overwritten.any() and (result.total != 0).all()
    images = [
        janus.codec.decode(t.visual_codes[t.modality == 1].reshape(1, 4, 4))[0] for t in trajs
    ]
    expected = _reference_logits(clip_dir, ["a red cat", "a dog"], [i.numpy() for i in images])
    n = clip_reductions(CLIPModel.from_pretrained(str(clip_dir)))
    tol = reduction_bound(magnitude(expected), n)
    assert_within((result.total - expected).abs(), tol, "service clip logits")
