"""Codecs and the tiny model on images larger than one digit and in colour (issue 52 item
5): the geometry (`image_size`, `channels`) comes from the codec's config, a digits codec
saves what it saved before, and the tiny model takes the grid and patch width of the
codec it is given."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from rollout_fixtures import tokenizer

from uniweave.codecs import build_codec, codec_geometry, load_codec
from uniweave.codecs.base import as_pixels, from_patches, to_patches
from uniweave.config import load_config
from uniweave.config.errors import ConfigError
from uniweave.config.schema import ModelConfig
from uniweave.core.sample import ImagePart, Sample, TextPart
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.digits_world import fit_images
from uniweave.data.template import serialize
from uniweave.forward import forward_interleaved
from uniweave.models.registry import saved_sizes
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel

SIZE = (16, 16)


@pytest.fixture(scope="module")
def canvases() -> np.ndarray:
    return fit_images(16, 3, n=60, seed=3)


def test_rgb_patches_are_dy_dx_channel_vectors_and_invert():
    x = torch.rand(2, 4, 6, 3)
    p = to_patches(x, 2)
    assert p.shape == (2, 2, 3, 12)
    # patch (1, 2) of image 1 is pixels (2..3, 4..5), row-major, each pixel's 3 channels
    want = torch.cat([x[1, 2, 4], x[1, 2, 5], x[1, 3, 4], x[1, 3, 5]])
    assert torch.equal(p[1, 1, 2], want)
    assert torch.equal(from_patches(p, 2, 3), x)
    grey = torch.rand(2, 4, 6)
    assert torch.equal(from_patches(to_patches(grey, 2), 2), grey)


def test_pixels_of_the_wrong_geometry_are_refused():
    with pytest.raises(ValueError, match=r"shape \[N, 16, 16, 3\]"):
        as_pixels(torch.rand(1, 16, 16), SIZE, channels=3)
    with pytest.raises(ValueError, match="channels must be one of"):
        build_codec("vq", image_size=SIZE, channels=2)
    with pytest.raises(ValueError, match="patch must divide"):
        build_codec("vq", patch=3, image_size=SIZE, channels=3)


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_colour_codec_round_trips_its_geometry(tmp_path, canvases, kind):
    if kind == "vq":
        codec = build_codec(
            "vq", codebook_size=16, n_init=1, max_iter=10, image_size=SIZE, channels=3
        )
    else:
        codec = build_codec(
            "bsq", latent_dim=4, entropy_group=4, hidden=8, epochs=1, image_size=SIZE, channels=3
        )
    codec.fit(canvases)
    codes = codec.encode(canvases[:5])
    assert tuple(codes.shape[1:3]) == (8, 8) == codec.grid
    out = codec.decode(codes)
    assert out.shape == (5, 16, 16, 3) and float(out.min()) >= 0 and float(out.max()) <= 1
    codec.save_pretrained(tmp_path / kind)
    saved = json.loads((tmp_path / kind / "codec.json").read_text())
    assert saved["image_size"] == [16, 16] and saved["channels"] == 3
    assert codec_geometry(tmp_path / kind)[1] == (8, 8)
    loaded = load_codec(tmp_path / kind)
    assert (loaded.image_size, loaded.channels) == (SIZE, 3)
    assert torch.equal(loaded.encode(canvases[:5]), codes)


def test_vq_colour_codewords_decode_exactly(canvases):
    codec = build_codec("vq", codebook_size=8, n_init=1, max_iter=5, image_size=SIZE, channels=3)
    codec.fit(canvases)
    codes = torch.randint(8, (3, 8, 8))
    pixels = codec.decode(codes)
    # each 2x2 patch of the decoded image is its codeword, in (dy, dx, channel) order
    assert torch.equal(to_patches(pixels, 2), codec.codebook[codes])
    assert len(torch.unique(codec.codebook, dim=0)) == 8  # distinct codewords: codes recovered
    assert torch.equal(codec.encode(pixels), codes)


def test_a_digits_codec_saves_no_geometry_fields(tmp_path):
    images = fit_images(8, 1)[:200]
    codec = build_codec("vq", codebook_size=8, n_init=1, max_iter=5).fit(images)
    codec.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "codec.json").read_text())
    assert "image_size" not in saved and "channels" not in saved
    assert (codec.image_size, codec.channels) == ((8, 8), 1)


def test_tiny_model_takes_the_colour_codecs_grid_and_patch_width(canvases, tmp_path):
    codec = build_codec("vq", codebook_size=16, n_init=1, max_iter=10, image_size=SIZE, channels=3)
    codec.fit(canvases)
    torch.manual_seed(0)
    arch = TinyArchitecture(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model = TinyUnifiedModel(arch, tokenizer(), codec).eval()
    assert model.visual_position.shape[0] == 64 and model.visual_patch.shape[1] == 12
    sample = Sample(
        id="c",
        parts=[
            TextPart("draw the digit 3", role="user"),
            ImagePart(pixels=canvases[0], role="assistant"),
        ],
    )
    row = serialize(sample, tokenizer(), encode_image=codec.encode)
    batch = TrajectoryBatch.collate([row], model.special_ids.pad)
    out = forward_interleaved(model, batch)
    assert out.visual_logits.shape == (64, 16)
    assert torch.equal(out.visual_targets, codec.encode(canvases[:1]).flatten())
    loss = torch.nn.functional.cross_entropy(out.visual_logits, out.visual_targets)
    loss.backward()
    assert model.visual_patch.grad is not None and float(model.visual_patch.grad.abs().sum()) > 0
    # a saved model's directory records the geometry its config then takes (model.path)
    model.save_pretrained(tmp_path / "m")
    sizes = saved_sizes(ModelConfig(kind="tiny", path=str(tmp_path / "m")))
    assert sizes["model.codec.image_size"] == 16 and sizes["model.codec.channels"] == 3


def test_codec_geometry_in_the_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {kind: tiny}\n")
    cfg = load_config(path, ["model.codec.image_size=16", "model.codec.channels=3"])
    assert (cfg.model.codec.image_size, cfg.model.codec.channels) == (16, 3)
    with pytest.raises(ConfigError, match="model.codec.image_size"):
        load_config(path, ["model.codec.image_size=12"])
    with pytest.raises(ConfigError, match="model.codec.channels"):
        load_config(path, ["model.codec.channels=2"])
    uniar = ["model.kind=uniar", "model.tiny.mixer_kernel=0", "model.codec.image_size=16"]
    with pytest.raises(ConfigError, match="model.codec.image_size"):
        load_config(path, uniar)
