"""Random-weight checkpoints at the published sizes, in the hub's file layout.

    unirl models write-full-shape janus-pro-1b OUT [--shape full|small]

writes what a download of the model's hub repository holds, with random weights:
`config.json`, `generation_config.json`, bf16 weights sharded as
`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`, the tokenizer
(`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` where the hub has
it) with the real special tokens at their real ids and the real token count, and the image
processor (`preprocessor_config.json`). `--shape small` writes the same files and the same
key names at tiny widths (fewer layers), for tests.

The weights are never all in memory: the module is built on the meta device (names and
shapes only), the tensors are grouped into shards of at most `SHARD_BYTES`, and each
shard is filled with random values (normal(0, 0.02) for matrices and embeddings, ones for
norm scales, zeros for biases), saved, and freed before the next.

The tokenizer is a `tokenizers` WordLevel model: the real checkpoint's BPE merges are not
reproduced (no copy is reachable here), so text tokenises differently from the real
model; what matches is what the loaders and `unirl plan` read: the special tokens, their
ids, the tokenizer's length and the config's vocabulary size.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SHARD_BYTES = 2 * 1024**3
"""Largest shard (bytes) of the full shape: Janus-Pro-1B's 3.9 GB of bf16 make 2 shards."""
SMALL_SHARD_BYTES = 256 * 1024
"""Largest shard of the small shape, so that it is sharded too (same layout)."""
INDEX = "model.safetensors.index.json"
DTYPE = torch.bfloat16
INIT_STD = 0.02

# Janus-Pro's tokenizer (DeepSeek-LLM's 100,000 BPE tokens + added tokens); the ids of the
# tokens unirl reads. Not verified against a copy of the hub repository (none reachable):
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

NAMES = ("janus-pro-1b", "janus-pro-7b", "qwen3-vl-2b")
SHAPES = ("full", "small")


@dataclass(frozen=True)
class Written:
    """What `write_full_shape` wrote."""

    path: Path
    parameters: int
    shards: int
    bytes: int


# ---- the shards ---------------------------------------------------------------------


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A random tensor for parameter `name` (module docstring)."""
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=DTYPE)
    if len(shape) == 1 and name.endswith("weight"):
        return torch.ones(shape, dtype=DTYPE)
    return torch.empty(shape, dtype=DTYPE).normal_(0.0, INIT_STD, generator=gen)


def plan_shards(
    shapes: dict[str, tuple[int, ...]], limit: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors in state-dict order, grouped greedily into shards of at most `limit`
    bytes (a tensor larger than `limit` gets a shard of its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    size = torch.tensor([], dtype=DTYPE).element_size()
    for name, shape in shapes.items():
        n = size * int(torch.Size(shape).numel())
        if shards[-1] and used + n > limit:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += n
    return shards


def write_shards(
    path: Path, shapes: dict[str, tuple[int, ...]], limit: int, seed: int = 0
) -> tuple[int, int]:
    """Write `shapes` as random bf16 shards + the index; (shard count, total bytes)."""
    from safetensors.torch import save_file

    groups = plan_shards(shapes, limit)
    n = len(groups)
    weight_map: dict[str, str] = {}
    total = 0
    gen = torch.Generator().manual_seed(seed)
    for k, group in enumerate(groups, start=1):
        file = f"model-{k:05d}-of-{n:05d}.safetensors"
        tensors = {name: _init(name, shape, gen) for name, shape in group}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        (path / file).chmod(0o644)  # safetensors writes 0600; the other files are 0644
        del tensors
        weight_map.update({name: file for name, _ in group})
    params = total // torch.tensor([], dtype=DTYPE).element_size()
    index = {"metadata": {"total_size": total, "total_parameters": params},
             "weight_map": weight_map}  # fmt: skip
    (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return n, total


def meta_state_shapes(build: Callable[[], torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the persistent state of `build()` made on the meta device; a
    tensor tied to an earlier one is stored once, under the earlier name."""
    with torch.device("meta"):
        module = build()
    seen: set[int] = set()
    out: dict[str, tuple[int, ...]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = tuple(t.shape)
    return out


# ---- tokenizers ---------------------------------------------------------------------


def _base_words() -> list[str]:
    return ["\n", " ", *string.ascii_letters, *string.digits, *string.punctuation]


def _filler(i: int) -> str:
    return f"<|filler_{i}|>"


def wordlevel_tokenizer(
    size: int, fixed: dict[str, int], unk: str, words: list[str], added: tuple[str, ...]
):
    """A WordLevel `PreTrainedTokenizerFast` of exactly `size` tokens: `words` first, the
    `fixed` tokens at their ids (special), filler tokens elsewhere; `added` (chat tags)
    are added tokens among the `words`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {}
    for w in [unk, *words, *added]:
        vocab.setdefault(w, len(vocab))
    taken = set(fixed.values())
    if taken & set(vocab.values()) or max(taken) >= size:
        raise ValueError(f"special ids {sorted(taken)} collide with the base words or size {size}")
    by_id = {i: t for t, i in fixed.items()}
    i = len(vocab)
    while i < size:
        vocab[by_id.get(i, _filler(i))] = i
        i += 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|\d|[^\W\d]|[^\w\s]| "), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fixed])
    tok.add_tokens([AddedToken(t, normalized=False) for t in added])
    return tok


def janus_tokenizer(small: bool):
    from transformers import PreTrainedTokenizerFast

    from unirl.models.janus_pro.template import (
        ASSISTANT,
        BOI,
        BOS,
        EOI,
        EOS,
        IMAGE,
        PAD,
        USER,
    )

    words = _base_words()
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

    from unirl.models.janus_pro.template import BOS, EOS, IMAGE, PAD

    text = dict(JANUS_SMALL if small else JANUS_TEXT[name])
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

    from unirl.models.janus_pro.template import BOS, EOS, PAD

    tokenizer = janus_tokenizer(small)
    config = janus_config(name, small, tokenizer)
    shapes = meta_state_shapes(lambda: JanusForConditionalGeneration(config))
    out.mkdir(parents=True, exist_ok=True)
    shards, total = write_shards(out, shapes, SMALL_SHARD_BYTES if small else SHARD_BYTES, seed)
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
    # config (unirl reads neither: its template inserts the image tokens itself)
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


# ---- entry --------------------------------------------------------------------------


def write_full_shape(name: str, out: str | Path, shape: str = "full", seed: int = 0) -> Written:
    """Write model `name` (one of `NAMES`) at `shape` ("full" or "small") to `out`, which
    must not exist or be empty. ValueError naming what is wrong, before anything is
    written."""
    if name not in NAMES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(NAMES)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory")
    small = shape == "small"
    if name.startswith("janus"):
        return write_janus(name, out, small, seed)
    from unirl.models.uniar.full_shape import write_uniar

    return write_uniar(out, small, seed)


def iter_hub_files(path: Path) -> Iterator[str]:
    """File names of a written directory, relative, sorted (the layout test reads them)."""
    yield from sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
