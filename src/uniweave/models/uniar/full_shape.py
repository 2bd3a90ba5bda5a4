"""A random UniAR directory at Qwen3-VL-2B's sizes (+ the BSQ head), written shard by
shard (`uniweave.models.full_shape` says how), in the layout `loading` reads: the
Qwen3-VL-2B-Instruct hub files (config.json, generation_config.json, sharded bf16
weights + index, tokenizer, preprocessor_config.json) plus UniAR's own `uniweave_model.json`
and `codec/` (a random real-scale `BSQTokenizer`: 384 px, /16, k = 4, L = 64, so 1,024
bits per position on a 6x6 grid).

The tokenizer has Qwen's 151,643 base positions (WordLevel words + fillers) and its 26
added tokens at their real ids (151643..151668), then UniAR's `<image_gen>` and `<pad>`
as `convert.py` adds them (the next free ids, inside the 151,936 embedding rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from uniweave.models.hub_layout import (
    SHARD_BYTES,
    Written,
    base_words,
    meta_state_shapes,
    small_shard_bytes,
    wordlevel_tokenizer,
    write_shards,
)

# Qwen3-VL's tokenizer: 151,643 BPE tokens, then 26 added tokens in this order.
QWEN_ADDED = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)  # fmt: skip
QWEN_BASE = 151643
QWEN_VOCAB = 151936

# Qwen3-VL-2B's sizes (`uniweave plan --preset qwen3-vl-2b` reads these too; docs/plan.md
# says which are verified)
QWEN3_VL_2B_TEXT = dict(
    hidden_size=2048,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=6144,
    vocab_size=QWEN_VOCAB,
    tie_word_embeddings=True,
)
QWEN3_VL_2B_VISION = dict(
    depth=24,
    hidden_size=1024,
    intermediate_size=4096,
    num_heads=16,
    out_hidden_size=2048,
    deepstack_visual_indexes=[5, 11, 17],
)
SMALL_TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128)  # fmt: skip
SMALL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                    deepstack_visual_indexes=[0], num_position_embeddings=16)  # fmt: skip
SMALL_PATCH, SMALL_SIDE = 8, 32


def qwen_tokenizer(small: bool):
    from transformers import PreTrainedTokenizerFast

    from uniweave.data.tokenizer import CHAT_TEMPLATE
    from uniweave.models.uniar.template import add_special_tokens

    words = base_words()
    base = len(words) + 1 if small else QWEN_BASE
    fixed = {t: base + k for k, t in enumerate(QWEN_ADDED)}
    tok = wordlevel_tokenizer(base + len(QWEN_ADDED), fixed, "<unk>", words, ())
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        clean_up_tokenization_spaces=False,
        model_max_length=262144,
        chat_template=CHAT_TEMPLATE,
    )
    add_special_tokens(fast)
    fast.pad_token = "<pad>"
    return fast


def qwen_config(small: bool, tokenizer):
    """Qwen3-VL-2B's config (`QWEN3_VL_2B_TEXT` / `_VISION`) or the
    same structure at tiny widths."""
    from transformers import Qwen3VLConfig

    from uniweave.models.uniar.template import special_id_map

    text: dict[str, Any] = dict(SMALL_TEXT if small else QWEN3_VL_2B_TEXT)
    vision: dict[str, Any] = dict(SMALL_VISION if small else QWEN3_VL_2B_VISION)
    text.update(
        vocab_size=len(tokenizer) if small else QWEN_VOCAB,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [2, 3, 3] if small else [24, 20, 20],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=True,  # Qwen3-VL-2B ties; small too (same key set)
    )
    vision.update(
        out_hidden_size=text["hidden_size"],
        patch_size=SMALL_PATCH if small else 16,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    if not small:
        vision["num_position_embeddings"] = 2304
    ids = special_id_map(tokenizer)
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["image_pad"],
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=text["tie_word_embeddings"],
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    config.dtype = "bfloat16"
    return config


def image_processor(small: bool):
    from transformers import Qwen2VLImageProcessorPil

    if small:
        from uniweave.models.uniar.tiny import image_processor as tiny_processor

        return tiny_processor()
    return Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 65536, "longest_edge": 16777216},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )


def codec(small: bool, seed: int):
    import torch

    from uniweave.codecs.bsq_tokenizer import BSQTokenizer, BSQTokenizerConfig

    torch.manual_seed(seed)
    if small:
        cfg = BSQTokenizerConfig(image_size=32, patch_size=8, hidden_size=8, num_layers=1,
                                 embed_dim=4, spatial_group=2)  # fmt: skip
    else:
        cfg = BSQTokenizerConfig()
    return BSQTokenizer(cfg)


def write_uniar(out: Path, small: bool, seed: int = 0) -> Written:
    import json

    import torch
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    from uniweave.models.registry import MODEL_CONFIG
    from uniweave.models.uniar.loading import CODEC_DIR
    from uniweave.models.uniar.model import UniARModel

    tokenizer = qwen_tokenizer(small)
    config = qwen_config(small, tokenizer)
    processor = image_processor(small)
    bsq = codec(small, seed)
    holder: dict = {}

    def build() -> torch.nn.Module:
        hf = Qwen3VLForConditionalGeneration(config)
        holder["model"] = UniARModel(hf, tokenizer, processor, bsq)
        return holder["model"]

    shapes = meta_state_shapes(build)
    record = holder["model"].record()
    out.mkdir(parents=True, exist_ok=True)
    shards, total = write_shards(
        out, shapes, small_shard_bytes(shapes) if small else SHARD_BYTES, seed
    )
    config.save_pretrained(str(out))
    ids = record["special_ids"]
    GenerationConfig(eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    bsq.save_pretrained(out / CODEC_DIR)
    (out / MODEL_CONFIG).write_text(json.dumps(record, indent=2) + "\n")
    return Written(out, total // 2, shards, total)
