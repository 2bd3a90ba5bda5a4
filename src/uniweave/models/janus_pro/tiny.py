"""A tiny random Janus-Pro checkpoint in the transformers layout (tests and dry runs).

Same classes and file layout as a real checkpoint (`JanusForConditionalGeneration`,
tokenizer, image processor, config), random weights, nothing downloaded. The tokenizer
is a `tokenizers` WordLevel model (pieces: newline, digit runs, letter runs, single
punctuation; other whitespace dropped) holding the Janus-Pro special tokens, the chat
tags and the words of `texts`. Geometry follows the real model's constraints: the vision
and VQ projections equal the text width, `num_image_tokens` = (image_size / patch)^2, and
the VQ downsample 2^(len(channel_multiplier) - 1) equals the patch size.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    JanusConfig,
    JanusForConditionalGeneration,
    JanusImageProcessorPil,
    LlamaConfig,
    PreTrainedTokenizerFast,
)

from uniweave.models.janus_pro.template import (
    ASSISTANT,
    BOI,
    BOS,
    EOI,
    EOS,
    IMAGE,
    PAD,
    SPECIAL_TOKENS,
    USER,
)

UNK = "<unk>"
PIECES = r"\n|\d+|[^\W\d]+|[^\w\s]"


@dataclass(frozen=True)
class TinyJanusSpec:
    """Sizes of a tiny Janus-Pro (`grid` x `grid` image tokens of `patch` pixels each)."""

    grid: int = 4
    patch: int = 4
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    codebook_size: int = 64
    vocab_size: int | None = None  # None: the tokenizer's size
    max_position_embeddings: int = 2048
    initializer_range: float = 0.2
    seed: int = 0


def build_tokenizer(texts: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """WordLevel tokenizer with the Janus-Pro special tokens (module docstring)."""
    split = pre_tokenizers.Split(Regex(PIECES), behavior="removed", invert=True)
    words = set(string.ascii_letters) | set(string.punctuation) | {str(k) for k in range(10)}
    for text in texts:
        words.update(p for p, _ in split.pre_tokenize_str(text))
    ordered = [*SPECIAL_TOKENS, UNK, USER, ASSISTANT, "\n", *sorted(words - {"\n"})]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(ordered)}, unk_token=UNK))
    tok.pre_tokenizer = split
    tok.decoder = decoders.Sequence(
        [decoders.WordPiece(prefix="##", cleanup=False), decoders.Replace(Regex(r" ?\n ?"), "\n")]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, normalized=False) for t in (USER, ASSISTANT)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens={"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI},
        clean_up_tokenization_spaces=False,
    )


def tiny_config(spec: TinyJanusSpec, tokenizer: PreTrainedTokenizerFast) -> JanusConfig:
    d, side = spec.hidden_size, spec.grid * spec.patch
    ids: dict[str, Any] = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, PAD, IMAGE)}
    text = LlamaConfig(
        vocab_size=spec.vocab_size or len(tokenizer),
        hidden_size=d,
        intermediate_size=2 * d,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    vision = {
        "hidden_size": d,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": side,
        "patch_size": spec.patch,
        "projection_dim": d,
        "num_image_tokens": spec.grid**2,
        "mlp_ratio": 2.0,
        "initializer_range": spec.initializer_range,
    }
    levels = spec.patch.bit_length() - 1
    if 2**levels != spec.patch:
        raise ValueError(f"patch {spec.patch} must be a power of two (the VQ downsample)")
    vq = {
        "embed_dim": 8,
        "num_embeddings": spec.codebook_size,
        "latent_channels": 32,
        "base_channels": 32,
        "channel_multiplier": [1] * (levels + 1),
        "num_res_blocks": 1,
        "projection_dim": d,
        "image_token_embed_dim": d,
        "initializer_range": spec.initializer_range,
    }
    return JanusConfig(
        text_config=text.to_dict(),
        vision_config=vision,
        vq_config=vq,
        image_token_id=ids[IMAGE],
        tie_word_embeddings=False,
    )


def write_tiny_checkpoint(
    path: str | Path, spec: TinyJanusSpec | None = None, texts: Iterable[str] = ()
) -> Path:
    """Write a tiny random Janus-Pro checkpoint to `path` and return it."""
    spec = spec or TinyJanusSpec()
    path = Path(path)
    tokenizer = build_tokenizer(texts)
    config = tiny_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = JanusForConditionalGeneration(config)
    gen = model.generation_config
    text: Any = config.text_config  # transformers types sub-configs as dict | config | None
    gen.pad_token_id, gen.bos_token_id = text.pad_token_id, text.bos_token_id
    gen.eos_token_id = text.eos_token_id
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    side = spec.grid * spec.patch
    processor = JanusImageProcessorPil(
        size={"height": side, "width": side}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor.save_pretrained(str(path))
    return path
