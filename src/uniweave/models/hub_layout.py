"""Random-weight checkpoints at the published sizes, in the hub's file layout.

    uniweave models write-full-shape janus-pro-1b OUT [--shape full|small]

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
model; what matches is what the loaders and `uniweave plan` read: the special tokens, their
ids, the tokenizer's length and the config's vocabulary size.
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI's parser reads NAMES / SHAPES: no torch at import
    import torch

SHARD_BYTES = 2 * 1024**3
"""Largest shard (bytes) of the full shape: Janus-Pro-1B's 3.9 GB of bf16 make 2 shards."""
SMALL_SHARDS = 3
"""The small shape is cut into about this many shards (same layout as the full one)."""


def small_shard_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """A shard limit that cuts `shapes` into about `SMALL_SHARDS` shards."""
    total = sum(BF16_BYTES * math.prod(shape) for shape in shapes.values())
    return -(-total // SMALL_SHARDS)


INDEX = "model.safetensors.index.json"
BF16_BYTES = 2
INIT_STD = 0.02


@dataclass(frozen=True)
class Written:
    """What `write_full_shape` wrote."""

    path: Path
    parameters: int
    shards: int
    bytes: int


# ---- the shards ---------------------------------------------------------------------


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A random bf16 tensor for parameter `name` (module docstring)."""
    import torch

    dtype = torch.bfloat16
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1 and name.endswith("weight"):
        return torch.ones(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype).normal_(0.0, INIT_STD, generator=gen)


def plan_shards(
    shapes: dict[str, tuple[int, ...]], limit: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors in state-dict order, grouped greedily into shards of at most `limit`
    bytes (a tensor larger than `limit` gets a shard of its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in shapes.items():
        n = BF16_BYTES * math.prod(shape)
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
    import torch
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
    params = total // BF16_BYTES
    index = {"metadata": {"total_size": total, "total_parameters": params},
             "weight_map": weight_map}  # fmt: skip
    (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return n, total


def meta_state_shapes(build: Callable[[], torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the persistent state of `build()` made on the meta device; a
    tensor tied to an earlier one is stored once, under the earlier name."""
    import torch

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


def base_words() -> list[str]:
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


def iter_hub_files(path: Path) -> Iterator[str]:
    """File names of a written directory, relative, sorted (the layout test reads them)."""
    yield from sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
