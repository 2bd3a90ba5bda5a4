"""The tiny model built from the `model` config section alone (no `model.path`).

Weights are initialised from `seed`; the codec is loaded from `model.codec.path` (or from
`codec_dir` when an earlier attempt of the run saved it there), else fitted with `seed` on
the images of its geometry (`model.codec.image_size`, `channels`) — the digits train split
for 8x8 greyscale, digits-world canvases otherwise (`uniweave.data.digits_world.fit_images`)
— and saved to `codec_dir`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from uniweave.codecs import ImageCodec, build_codec, load_codec
from uniweave.codecs.base import CONFIG_NAME
from uniweave.config.schema import ModelConfig
from uniweave.data.digits_world import fit_images
from uniweave.data.tokenizer import build_tokenizer
from uniweave.models.tiny.model import TinyArchitecture, TinyUnifiedModel


def new_codec(cfg: ModelConfig) -> ImageCodec:
    """The unfitted codec `model.codec` describes for `model.visual_head`: VQ with
    `codebook_size` entries, or BSQ with `bits` per patch grouped `group` x `group`; both
    on `patch_size` pixel patches of `image_size` x `image_size` images of `channels`."""
    c = cfg.codec
    geometry = {"image_size": (c.image_size, c.image_size), "channels": c.channels}
    if cfg.visual_head == "vq":
        return build_codec("vq", codebook_size=c.codebook_size, patch=c.patch_size, **geometry)
    return build_codec("bsq", latent_dim=c.bits, patch=c.patch_size, group=c.group, **geometry)


def build_or_load_codec(cfg: ModelConfig, seed: int, codec_dir: Path | None) -> ImageCodec:
    """The tiny model's codec (module docstring); ValueError when a saved codec's kind is
    not `model.visual_head`, or its geometry not `model.codec.image_size` / `channels`."""
    c = cfg.codec
    path = c.path or (str(codec_dir) if codec_dir and (codec_dir / CONFIG_NAME).is_file() else None)
    if path:
        codec = load_codec(path)
        if not isinstance(codec, ImageCodec) or codec.kind != cfg.visual_head:
            raise ValueError(
                f"model.codec.path={path} holds a {codec.kind} codec but "
                f"model.visual_head={cfg.visual_head}"
            )
        size, channels = (c.image_size, c.image_size), c.channels
        if (tuple(codec.image_size), codec.channels) != (size, channels):
            raise ValueError(
                f"{path} holds a codec of {codec.image_size[0]}x{codec.image_size[1]} px, "
                f"{codec.channels} channel(s) but model.codec asks for {c.image_size}x"
                f"{c.image_size} px, {channels} channel(s)"
            )
        return codec
    codec = new_codec(cfg)
    codec.fit(fit_images(c.image_size, c.channels, seed=seed), seed=seed)
    if codec_dir is not None:
        codec.save_pretrained(codec_dir)
    return codec


def build_tiny(
    cfg: ModelConfig, seed: int, codec_dir: Path | None, tokenizer: Any = None
) -> TinyUnifiedModel:
    """A fresh tiny model of `model.tiny`'s sizes, initialised from `seed`; `tokenizer`
    None = the digits WordLevel tokenizer."""
    codec = build_or_load_codec(cfg, seed, codec_dir)
    torch.manual_seed(seed)
    return TinyUnifiedModel(
        TinyArchitecture(**cfg.tiny.model_dump(), visual_head=cfg.visual_head),
        build_tokenizer() if tokenizer is None else tokenizer,
        codec,
    )
