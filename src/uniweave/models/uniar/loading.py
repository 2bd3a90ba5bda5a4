"""Loading a UniAR directory (what `UniARModel.save_pretrained` writes), checks first.

A directory holds `uniweave_model.json` (kind "uniar", the spec, the special ids, the codec
geometry), `config.json` (a transformers Qwen3-VL config), the weights (`model.safetensors`, or
shards named by `model.safetensors.index.json` as the hub lays them out), the
tokenizer, the image processor (`preprocessor_config.json`) and the BSQ codec in
`codec/`. Before any weight is read, `check_directory` refuses with one line naming the
file and the field: a missing file or codec, a config that asks for remote code
(`auto_map`), a model type other than qwen3_vl, a codec that is not BSQ or makes a grid
other than the one recorded (or a side outside 1..30), special ids of the tokenizer that
differ from the recorded ones or from the config's image/vision ids. Nothing is downloaded
and no checkpoint code runs (`trust_remote_code=False`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLConfig

from uniweave.codecs import (
    BSQ_KINDS,
    BSQTokenizerConfig,
    codec_config_file,
    codec_geometry,
    load_codec,
)
from uniweave.codecs.base import CONFIG_NAME, ImageCodec
from uniweave.codecs.bsq_tokenizer import CONFIG_FILE as TOKENIZER_CONFIG
from uniweave.models.registry import (
    MODEL_CONFIG,
    ModelFacts,
    check_transformers_directory,
    read_json,
)
from uniweave.models.uniar.template import MAX_GRID_SIDE, special_id_map

WEIGHTS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
CODEC_DIR = "codec"
FILES = {
    "UniAR record": (MODEL_CONFIG,),
    "config": ("config.json",),
    "weights": (WEIGHTS, SHARD_INDEX),
    "tokenizer": ("tokenizer.json", "tokenizer_config.json"),
    "image processor": ("preprocessor_config.json",),
    "codec": (f"{CODEC_DIR}/{CONFIG_NAME}", f"{CODEC_DIR}/{TOKENIZER_CONFIG}"),
}
CONFIG_IDS = {
    "image_token_id": "image_pad",
    "vision_start_token_id": "vision_start",
    "vision_end_token_id": "vision_end",
}


def check_directory(path: Path) -> dict:
    """The `uniweave_model.json` record after the file, remote-code, type and geometry checks
    of the module docstring (no tokenizer or weights read)."""
    check_transformers_directory(path, "UniAR", FILES, "qwen3_vl")
    record = read_json(path / MODEL_CONFIG)
    if record.get("kind") != "uniar":
        raise ValueError(f"{path / MODEL_CONFIG}: field kind is {record.get('kind')!r}")
    _check_codec(path / CODEC_DIR, record, path / MODEL_CONFIG)
    return record


def _check_codec(directory: Path, record: dict, record_file: Path) -> None:
    """The codec's config (digits `codec.json` or a tokenizer's `config.json`) is BSQ and
    makes the recorded grid and bits; errors name that file and its geometry fields."""
    file = codec_config_file(directory)
    kind = read_json(file).get("kind")
    if kind not in BSQ_KINDS:
        raise ValueError(f"{file}: field kind is {kind!r}; UniAR needs one of {BSQ_KINDS}")
    _, grid_t, bits = codec_geometry(directory)
    grid = list(grid_t)
    tok = file.name == TOKENIZER_CONFIG
    grid_fields = "image_size/patch_size/spatial_group" if tok else "group/patch"
    bit_fields = "embed_dim/spatial_group" if tok else "latent_dim/group"
    if not all(1 <= side <= MAX_GRID_SIDE for side in grid):
        raise ValueError(
            f"{file}: field {grid_fields}: the codec makes a {grid} grid, outside 1..30"
        )
    if record.get("image_grid") != grid:
        raise ValueError(
            f"{file}: field {grid_fields}: the codec makes a {grid[0]}x{grid[1]} grid but "
            f"{record_file.name} field image_grid is {record.get('image_grid')}"
        )
    if record.get("bits_per_position") != bits:
        raise ValueError(
            f"{file}: field {bit_fields}: the codec gives {bits} bits per position but "
            f"{record_file.name} field bits_per_position is {record.get('bits_per_position')}"
        )


def check_tokenizer(tokenizer, record: dict, config: Qwen3VLConfig, path: Path) -> None:
    """The tokenizer's special ids equal the recorded ones and the config's."""
    try:
        found = special_id_map(tokenizer)
    except ValueError as err:
        raise ValueError(f"{path / 'tokenizer.json'}: {err}") from None
    saved = record.get("special_ids") or {}
    for name, value in sorted(found.items()):
        if saved.get(name) != value:
            raise ValueError(
                f"{path / MODEL_CONFIG}: field special_ids.{name} is {saved.get(name)} but "
                f"the tokenizer gives {value} (mismatched tokenizer)"
            )
    for field, name in CONFIG_IDS.items():
        if int(getattr(config, field)) != found[name]:
            raise ValueError(
                f"{path / 'config.json'}: field {field} is {getattr(config, field)} but the "
                f"tokenizer gives {found[name]}"
            )
    text: Any = config.text_config  # transformers types sub-configs as dict | config | None
    vocab = int(text.vocab_size)
    if len(tokenizer) > vocab:
        raise ValueError(
            f"{path / 'config.json'}: field text_config.vocab_size is {vocab} but the "
            f"tokenizer has {len(tokenizer)} tokens"
        )


def inspect_directory(path: Path, full: bool = False) -> ModelFacts:
    """The registered `inspect`: a UniAR directory's facts from `check_directory`'s record
    (a BSQ head, its grid and bits; no prefix sharing), with `full` also the tokenizer's
    vocabulary and the codec's tensors (None for the real-scale BSQ tokenizer, which
    exposes none). No model weights are read."""
    path = Path(path)
    record = check_directory(path)
    vocab = tensors = None
    if full:
        vocab = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False).get_vocab()
        get_tensors = getattr(load_codec(path / CODEC_DIR), "tensors", None)
        tensors = get_tensors() if callable(get_tensors) else None
    grid, bits = record["image_grid"], int(record["bits_per_position"])
    size = _codec_image_size(path / CODEC_DIR)
    return ModelFacts("bsq", bits, (grid[0], grid[1]), False, vocab, tensors, size)


def _codec_image_size(directory: Path) -> tuple[int, int]:
    """(H, W) pixels of a saved codec's images, from its config: a BSQ tokenizer's
    `image_size`, else the digits codecs' 8x8."""
    file = codec_config_file(directory)
    if file.name == TOKENIZER_CONFIG:
        side = BSQTokenizerConfig.from_file(file).image_size
        return (side, side)
    return ImageCodec.image_size


def load_parts(path: Path):
    """(config, tokenizer, image processor, codec, `uniar` spec fields, weights) of a
    UniAR directory, every check done before the weights are read."""
    record = check_directory(path)
    config = Qwen3VLConfig.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    check_tokenizer(tokenizer, record, config, path)
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
    spec = record.get("uniar", {})
    if not isinstance(spec, dict):
        raise ValueError(f"{path / MODEL_CONFIG}: field uniar is not an object")
    codec = load_codec(path / CODEC_DIR)
    return config, tokenizer, processor, codec, spec, load_weights(path)


def load_weights(path: Path) -> dict:
    """The state dict of `model.safetensors`, or of the shards its index names (every
    shard must exist; ValueError naming the index otherwise)."""
    if (path / WEIGHTS).is_file():
        return load_file(str(path / WEIGHTS))
    index = read_json(path / SHARD_INDEX)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{path / SHARD_INDEX}: field weight_map missing or empty")
    state: dict = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise ValueError(f"{path / SHARD_INDEX}: names shard {shard}, which is missing")
        part = load_file(str(path / shard))
        wrong = sorted(k for k in part if weight_map.get(k) != shard)
        if wrong:
            raise ValueError(
                f"{path / shard}: holds {wrong[0]}, which the index does not map to it"
            )
        state.update(part)
    return state
