"""Janus-Pro at its published sizes, random weights, in the hub's layout
(`uniweave.models.hub_layout` says how the shards are written). Sizes: transformers'
`JanusConfig` defaults for the SigLIP-L/16 384 px vision tower (576 tokens) and the VQ-16
model (16,384 codes on 24x24), the DeepSeek-LLM text sizes of `JANUS_TEXT`, 102,400
embedding rows, untied output head."""

from __future__ import annotations

import json
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

# Janus-Pro's tokenizer (DeepSeek-LLM's 100,000 BPE tokens + added tokens); the ids of the
# tokens uniweave reads. Not verified against a copy of the hub repository (none reachable):
# BOS/EOS/PAD are DeepSeek-LLM's, 100581 is transformers' JanusConfig image_token_id
# default, <begin_of_image>/<end_of_image> as Janus's processor uses them.
JANUS_IDS = {
    "<｜begin▁of▁sentence｜>": 100000,
    "<｜end▁of▁sentence｜>": 100001,
    "<｜▁pad▁｜>": 100002,
    "<begin_of_image>": 100016,
    "<image_placeholder>": 100581,
    "<end_of_image>": 100593,
}
JANUS_TOKENS = 100594  # len(tokenizer): ids 0..100593
JANUS_VOCAB = 102400  # the embedding rows (text_config.vocab_size)


def janus_tokenizer(small: bool):
    from transformers import PreTrainedTokenizerFast

    from uniweave.models.janus_pro.template import (
        ASSISTANT,
        BOI,
        BOS,
        EOI,
        EOS,
        IMAGE,
        PAD,
        USER,
    )

    words = base_words()
    if small:
        base = len(words) + 3
        specials = (BOS, EOS, PAD, BOI, IMAGE, EOI)
        fixed = {t: base + k for k, t in enumerate(specials)}
        size = base + len(specials)
    else:
        fixed, size = JANUS_IDS, JANUS_TOKENS
    tok = wordlevel_tokenizer(size, fixed, "<unk>", words, (USER, ASSISTANT))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token="<unk>",
        extra_special_tokens={"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI},
        clean_up_tokenization_spaces=False,
        model_max_length=16384,
    )


# ---- Janus-Pro ----------------------------------------------------------------------

JANUS_TEXT = {
    "janus-pro-1b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                         num_key_value_heads=16, intermediate_size=5632),
    "janus-pro-7b": dict(hidden_size=4096, num_hidden_layers=30, num_attention_heads=32,
                         num_key_value_heads=32, intermediate_size=11008),
}  # fmt: skip
JANUS_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, intermediate_size=64)  # fmt: skip


def janus_config(name: str, small: bool, tokenizer):
    """The JanusConfig of `name`: transformers' default vision (SigLIP-L/16, 384 px, 576
    tokens) and VQ (16,384 codes, 24x24) towers, the text sizes of `JANUS_TEXT`; small:
    the same structure at width 32, 2 text layers, 1 vision layer, 64 px images of 4x4."""
    from transformers import JanusConfig

    from uniweave.models.janus_pro.template import BOS, EOS, IMAGE, PAD

    text: dict[str, Any] = dict(JANUS_SMALL if small else JANUS_TEXT[name])
    h = text["hidden_size"]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, PAD, IMAGE)}
    text.update(
        model_type="llama",
        vocab_size=len(tokenizer) if small else JANUS_VOCAB,
        max_position_embeddings=16384,
        rms_norm_eps=1e-6,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    vision: dict = {"projection_dim": h}
    vq: dict = {"projection_dim": h, "image_token_embed_dim": h}
    if small:
        # 64 px at /16 (the VQ's five levels kept: the same keys as the full shape)
        vision.update(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=64,
            patch_size=16,
            num_image_tokens=16,
            mlp_ratio=2.0,
        )
        vq.update(embed_dim=8, num_embeddings=64, latent_channels=32, base_channels=32,
                  num_res_blocks=1)  # fmt: skip
    config = JanusConfig(
        text_config=text,
        vision_config=vision,
        vq_config=vq,
        image_token_id=ids[IMAGE],
        tie_word_embeddings=False,
    )
    config.architectures = ["JanusForConditionalGeneration"]
    config.dtype = "bfloat16"
    return config


def write_janus(name: str, out: Path, small: bool, seed: int = 0) -> Written:
    from transformers import (
        GenerationConfig,
        JanusForConditionalGeneration,
        JanusImageProcessorPil,
    )

    from uniweave.models.janus_pro.template import BOS, EOS, PAD

    tokenizer = janus_tokenizer(small)
    config = janus_config(name, small, tokenizer)
    shapes = meta_state_shapes(lambda: JanusForConditionalGeneration(config))
    out.mkdir(parents=True, exist_ok=True)
    shards, total = write_shards(
        out, shapes, small_shard_bytes(shapes) if small else SHARD_BYTES, seed
    )
    config.save_pretrained(str(out))
    t = config.text_config
    GenerationConfig(
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id, pad_token_id=t.pad_token_id
    ).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    side = int(config.vision_config.image_size)
    JanusImageProcessorPil(
        size={"height": side, "width": side}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(str(out))
    # what the hub repository also holds and transformers 5 no longer writes: JanusProcessor's
    # config (uniweave reads neither: its template inserts the image tokens itself)
    processor_config = {
        "num_image_tokens": int(config.vision_config.num_image_tokens),
        "processor_class": "JanusProcessor",
        "use_default_system_prompt": False,
    }
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": "<unk>"}
    for name, data in (("processor_config.json", processor_config),
                       ("special_tokens_map.json", special)):  # fmt: skip
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return Written(out, total // 2, shards, total)
