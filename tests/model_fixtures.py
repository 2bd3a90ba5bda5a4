"""Tiny random models and model assets shared by several test modules (not collected: no
test_ prefix): the UniAR test sizes and a seeded random BSQ codec, and a tiny random
CLIP model and a tiny random Mask2Former saved as directories."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    CLIPConfig,
    CLIPImageProcessorPil,
    CLIPModel,
    CLIPProcessor,
    Mask2FormerConfig,
    Mask2FormerForUniversalSegmentation,
    Mask2FormerImageProcessorPil,
    PreTrainedTokenizerFast,
    SwinConfig,
)

from uniweave.codecs.bsq import BSQCodec
from uniweave.models.uniar import SMALL_SIZES

UNIAR_SIZES = SMALL_SIZES.model_copy(update={"initializer_range": 0.5})
"""The tiny Qwen3-VL sizes of the UniAR tests (init 0.5: logits far from uniform)."""

CLIP_WORDS = ["<|startoftext|>", "<|endoftext|>", "<unk>", "a", "cat", "dog", "red", "photo", "of"]
"""The tiny CLIP's whole vocabulary (WordLevel)."""


M2F_LABELS = {0: "cat", 1: "dog", 2: "mouse"}
"""The tiny Mask2Former's labels; "mouse" is COCO's spelling of GenEval's "computer mouse"."""


def write_tiny_mask2former(path: Path) -> Path:
    """A tiny random Mask2Former (labels `M2F_LABELS`) whose class head favours "cat"
    (bias +8 on its logit), so that instance scores (class probability x mean mask
    probability) clear 0.3; saved with its image processor (64x64) to `path`."""
    backbone = SwinConfig(
        image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
        window_size=2, out_features=["stage1", "stage2", "stage3", "stage4"],
    )  # fmt: skip
    config = Mask2FormerConfig(
        backbone_config=backbone, num_labels=3, hidden_dim=32, num_queries=6,
        encoder_layers=1, decoder_layers=2, num_attention_heads=2, encoder_feedforward_dim=16,
        dim_feedforward=16, mask_feature_size=32, feature_size=32, common_stride=4,
        id2label=M2F_LABELS, label2id={v: k for k, v in M2F_LABELS.items()},
        use_pretrained_backbone=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Mask2FormerForUniversalSegmentation(config).eval()
    with torch.no_grad():
        model.class_predictor.bias[0] += 8.0
    model.save_pretrained(str(path))
    Mask2FormerImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(str(path))
    return path


def random_bsq_codec(latent_dim: int, patch: int, group: int, seed: int = 0) -> BSQCodec:
    """An unfitted BSQ codec with seeded random weights (encode/decode work)."""
    codec = BSQCodec(latent_dim=latent_dim, patch=patch, group=group)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        codec.net = codec._build().eval()
    return codec


def write_tiny_clip(path: Path, words: list[str] = CLIP_WORDS) -> Path:
    """A tiny random CLIPModel + CLIPProcessor (WordLevel tokenizer over `words`, whose
    first two are the start and end tokens) saved to `path`."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # like CLIP's tokenizer: <|startoftext|> ... <|endoftext|> (the text model pools at EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{words[0]} $A {words[1]}", special_tokens=[(words[0], 0), (words[1], 1)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=words[0],
        eos_token=words[1],
        pad_token=words[1],
        unk_token="<unk>",
        model_max_length=16,
    )
    text = {
        "vocab_size": len(words),
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 16,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
    }
    vision = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 16,
        "patch_size": 8,
    }
    with torch.random.fork_rng(devices=[]):  # seeded weights; the caller's RNG untouched
        torch.manual_seed(0)
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))
    model.save_pretrained(str(path))
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    )
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(str(path))
    return path
