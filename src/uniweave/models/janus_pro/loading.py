"""Loading a local Janus-Pro checkpoint in the transformers layout, with checks first.

A checkpoint directory holds `config.json` (model_type "janus"), the weights
(`model.safetensors` or a sharded `model.safetensors.index.json`), the tokenizer
(`tokenizer.json` or `tokenizer_config.json`) and the image processor
(`preprocessor_config.json` or `processor_config.json`). Before any weight is read,
`check_checkpoint` refuses, with one sentence naming the file: a missing file, a config
of another model type or one that asks for remote code (`auto_map`: the checkpoint's own
Python would replace the registered classes), and an inconsistent image geometry.
`load_parts` then checks the tokenizer against the config (`JanusTokens`, the image
token id, the vocabulary size). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    JanusConfig,
    JanusForConditionalGeneration,
)

from uniweave.models.janus_pro.template import IMAGE, JanusTokens
from uniweave.models.registry import ModelFacts, check_transformers_directory

ARCHITECTURE = "JanusForConditionalGeneration"
ALTERNATIVES: dict[str, tuple[str, ...]] = {
    "config": ("config.json",),
    "weights": ("model.safetensors", "model.safetensors.index.json"),
    "tokenizer": ("tokenizer.json", "tokenizer_config.json"),
    "image processor": ("preprocessor_config.json", "processor_config.json"),
}


def check_checkpoint(path: Path) -> dict:
    """The checkpoint's config.json as a dict, after the checks of the module docstring."""
    config = check_transformers_directory(
        path,
        "Janus-Pro",
        ALTERNATIVES,
        "janus",
        " (the original deepseek-ai layout needs converting to the transformers layout)",
    )
    archs = config.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in archs:
        raise ValueError(f"{path / 'config.json'}: architectures {archs} lack {ARCHITECTURE}")
    return config


def check_geometry(config: JanusConfig, image_size: int, where: Path) -> None:
    """The understanding and generation paths must agree on one square image grid."""
    vision: Any = config.vision_config  # transformers types sub-configs as dict | config
    vq: Any = config.vq_config
    side = int(vision.image_size) // int(vision.patch_size)
    downsample = 2 ** (len(vq.channel_multiplier) - 1)
    problems = []
    if int(vision.num_image_tokens) != side * side:
        problems.append(f"vision num_image_tokens {vision.num_image_tokens} != {side}^2")
    if int(vq.num_patches) != side:
        problems.append(f"vq num_patches {vq.num_patches} != {side}")
    if int(vision.image_size) // downsample != side:
        problems.append(f"the VQ downsample {downsample} maps {vision.image_size}px off the grid")
    if image_size != int(vision.image_size):
        problems.append(f"processor size {image_size} != vision image_size {vision.image_size}")
    if problems:
        raise ValueError(f"{where}: inconsistent Janus-Pro image geometry: {'; '.join(problems)}")


def check_tokenizer(tokenizer, config: JanusConfig, where: Path) -> JanusTokens:
    """The tokenizer's special ids, checked against the model config."""
    try:
        tokens = JanusTokens.from_tokenizer(tokenizer)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if tokens.image != int(config.image_token_id):
        raise ValueError(
            f"{where}: tokenizer's {IMAGE} is id {tokens.image} but config image_token_id is "
            f"{config.image_token_id} (mismatched tokenizer)"
        )
    text: Any = config.text_config  # transformers types sub-configs as dict | config
    vocab = int(text.vocab_size)
    if len(tokenizer) > vocab:
        raise ValueError(
            f"{where}: tokenizer has {len(tokenizer)} tokens but the model's text vocabulary "
            f"has {vocab} rows (mismatched tokenizer)"
        )
    return tokens


def inspect_checkpoint(path: Path, full: bool = False) -> ModelFacts:
    """The registered `inspect`: a checkpoint's facts from its config.json (a VQ head of
    `vq_config.num_embeddings` codes on a `vq_config.num_patches` square grid; no prefix
    sharing) and its image processor's size, with `full` also the tokenizer's vocabulary
    (the VQ codebook lives in the weights: no codec tensors). No weights are read."""
    path = Path(path)
    check_checkpoint(path)
    vq: Any = JanusConfig.from_pretrained(str(path)).vq_config
    processor = AutoImageProcessor.from_pretrained(str(path), trust_remote_code=False)
    size = (int(processor.size["height"]), int(processor.size["width"]))
    vocab = None
    if full:
        vocab = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False).get_vocab()
    side = int(vq.num_patches)
    return ModelFacts("vq", int(vq.num_embeddings), (side, side), False, vocab, None, size)


def load_parts(path: str | Path, dtype: torch.dtype = torch.float32):
    """(transformers model in eval mode, tokenizer, image processor) of a checkpoint, every
    check done before the weights are read."""
    path = Path(path)
    check_checkpoint(path)
    config = JanusConfig.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    check_tokenizer(tokenizer, config, path)
    processor = AutoImageProcessor.from_pretrained(str(path), trust_remote_code=False)
    height, width = processor.size["height"], processor.size["width"]
    if height != width:
        raise ValueError(f"{path}: the image processor's size {height}x{width} is not square")
    check_geometry(config, int(height), path)
    model = JanusForConditionalGeneration.from_pretrained(str(path), config=config, dtype=dtype)
    return model.eval(), tokenizer, processor
