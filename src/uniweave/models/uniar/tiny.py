"""A tiny UniAR for CPU: a Qwen3-VL of a few hundred thousand to a few million parameters
with a BSQ codec, built from sizes (tests) or from the `model` config section (recipes).

Text decoder: `TinyUniARSizes` (the config's `DecoderSizes` plus key/value heads and the
init scale; `SMALL_SIZES` by default; head_dim = hidden / heads; M-RoPE sections (t, h, w)
with h = w = floor(3 s / 8), t = s - 2 h for s = head_dim / 2, as Qwen's [24, 20, 20] for
128).
Vision tower: one block of width 32, patch 8, merge 2, fed 32x32 pixels by the image
processor (2x2 = 4 placeholder positions per understanding image). Tokenizer: the digits
WordLevel tokenizer (it holds the ChatML/Qwen-VL special tokens) plus `<|video_pad|>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from tokenizers import AddedToken
from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from uniweave.config.errors import ConfigError
from uniweave.config.schema import DecoderSizes, ModelConfig
from uniweave.data.tokenizer import build_tokenizer
from uniweave.models.uniar.model import UniARModel, UniARSpec
from uniweave.models.uniar.template import special_id_map

VIDEO_PAD = "<|video_pad|>"
IMAGE_SIDE = 32
PATCH, MERGE = 8, 2


class TinyUniARSizes(DecoderSizes):
    """What the tiny UniAR's text decoder is built from: `DecoderSizes` (the sizes of
    `model.tiny`, defined there) plus what the config does not set."""

    num_kv_heads: int | None = Field(None, gt=0)
    """Key/value heads (grouped-query attention); None: `num_heads`."""
    initializer_range: float = 0.02


SMALL_SIZES = TinyUniARSizes(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
)
"""The sizes `build_tiny_uniar` defaults to (a few hundred thousand parameters: tests)."""


def uniar_tokenizer(tokenizer: Any = None) -> Any:
    """`tokenizer` (default: the digits WordLevel one) with `<|video_pad|>` added."""
    tok = build_tokenizer() if tokenizer is None else tokenizer
    if VIDEO_PAD not in tok.get_vocab():
        tok.add_tokens([AddedToken(VIDEO_PAD, special=True, normalized=False)], special_tokens=True)
    return tok


def mrope_section(head_dim: int) -> list[int]:
    s = head_dim // 2
    hw = (3 * s) // 8
    return [s - 2 * hw, hw, hw]


def tiny_qwen3_vl_config(sizes: TinyUniARSizes, tokenizer: Any) -> Qwen3VLConfig:
    """A Qwen3-VL config of `sizes` whose special ids are `tokenizer`'s."""
    ids = special_id_map(tokenizer)
    head_dim = sizes.hidden_size // sizes.num_heads
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": sizes.hidden_size,
        "intermediate_size": sizes.intermediate_size,
        "num_hidden_layers": sizes.num_layers,
        "num_attention_heads": sizes.num_heads,
        "num_key_value_heads": sizes.num_kv_heads or sizes.num_heads,
        "head_dim": head_dim,
        "max_position_embeddings": sizes.max_position_embeddings,
        "initializer_range": sizes.initializer_range,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e4,
            "mrope_section": mrope_section(head_dim),
            "mrope_interleaved": True,
        },
        "pad_token_id": ids["pad"],
        "eos_token_id": ids["eos"],
        "tie_word_embeddings": False,
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": sizes.hidden_size,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
        "initializer_range": sizes.initializer_range,
    }
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["image_pad"],
        video_token_id=tokenizer.convert_tokens_to_ids(VIDEO_PAD),
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=False,
    )


def image_processor() -> Qwen2VLImageProcessorPil:
    """Qwen's image processor at a fixed 32x32 (CLIP mean/std, bicubic)."""
    side = IMAGE_SIDE * IMAGE_SIDE
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": side, "longest_edge": side},
        do_rescale=False,
    )


def build_tiny_uniar(
    codec: Any,
    sizes: TinyUniARSizes | None = None,
    spec: UniARSpec | None = None,
    tokenizer: Any = None,
    seed: int = 0,
) -> UniARModel:
    """A fresh tiny UniAR (module docstring), weights from `seed`."""
    sizes = sizes or SMALL_SIZES
    tok = uniar_tokenizer(tokenizer)
    config = tiny_qwen3_vl_config(sizes, tok)
    torch.manual_seed(seed)
    hf = Qwen3VLForConditionalGeneration(config)
    gen = hf.generation_config
    text: Any = config.text_config  # transformers types sub-configs as dict | config | None
    gen.pad_token_id, gen.eos_token_id = text.pad_token_id, special_id_map(tok)["eos"]
    return UniARModel(hf.eval(), tok, image_processor(), codec, spec).eval()


def check_uniar_config(cfg: ModelConfig) -> None:
    """The registered config check (run by `check_model_config` before anything is built
    or written): `model.tiny` sizes a tiny Qwen3-VL can take. ConfigError naming the key."""
    t = cfg.tiny
    if t.mixer_kernel != 0:
        raise ConfigError(
            "kind 'uniar' (a Qwen3-VL decoder) has no mixer; set model.tiny.mixer_kernel=0",
            key="model.tiny.mixer_kernel",
        )
    if (t.hidden_size // t.num_heads) % 4:
        raise ConfigError(
            f"uniar needs hidden_size / num_heads divisible by 4 (M-RoPE sections); got "
            f"{t.hidden_size} / {t.num_heads} = {t.hidden_size // t.num_heads}",
            key="model.tiny.num_heads",
        )


def build_uniar(cfg: ModelConfig, seed: int, codec_dir: Path | None, tokenizer: Any = None):
    """The registered builder: `model.tiny` sizes (`check_uniar_config`: `mixer_kernel`
    must be 0, Qwen3-VL has no mixer), the codec of `model.codec` fitted or loaded as the
    tiny model's is."""
    from uniweave.models.tiny.build import build_or_load_codec

    check_uniar_config(cfg)  # already passed in check_model_config; repeated for direct callers
    t = cfg.tiny
    codec = build_or_load_codec(cfg, seed, codec_dir)
    sizes = TinyUniARSizes(**t.model_dump(include=set(DecoderSizes.model_fields)))
    return build_tiny_uniar(codec, sizes, tokenizer=tokenizer, seed=seed)
