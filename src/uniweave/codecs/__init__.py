"""Image codecs: VQ (k-means codebook over patches) and BSQ (binary spherical quantisation)
for the 8x8 digits, and the real-scale BSQ image tokenizer (`bsq_tokenizer`).

`build_codec(kind, **config)` makes an unfitted digits codec; `load_codec(dir)` loads a
saved one, dispatching on the "kind" stored in `codec.json` (digits codecs) or, for a
directory without one, in `config.json` (`BSQTokenizer`). `codec_geometry(dir)` reads a
saved codec's kind, grid and bits per position from its config alone (no weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from uniweave.codecs.base import CONFIG_NAME, ImageCodec, read_codec_dir
from uniweave.codecs.bsq import BSQCodec
from uniweave.codecs.bsq_tokenizer import CONFIG_FILE as TOKENIZER_CONFIG
from uniweave.codecs.bsq_tokenizer import BSQTokenizer, BSQTokenizerConfig
from uniweave.codecs.vq import VQCodec

CODECS: dict[str, type[ImageCodec]] = {"vq": VQCodec, "bsq": BSQCodec}
BSQ_KINDS = ("bsq", "bsq_tokenizer")
"""Codec kinds that write binary (BSQ) codes."""


def _codec_class(kind: str, where: str) -> type[ImageCodec]:
    if kind not in CODECS:
        raise ValueError(
            f"unknown codec kind {kind!r} in {where}; expected one of {sorted(CODECS)}"
        )
    return CODECS[kind]


def build_codec(kind: str, **config: Any) -> ImageCodec:
    """An unfitted codec of `kind` ("vq" or "bsq") built from its constructor arguments."""
    cls = _codec_class(kind, "build_codec")
    try:
        return cls(**config)
    except TypeError as err:
        raise ValueError(f"invalid {kind!r} codec config: {err}") from err


def codec_config_file(directory: str | Path) -> Path:
    """`codec.json` of a digits codec, else the `config.json` of a BSQ tokenizer;
    FileNotFoundError naming `codec.json` when neither exists."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"codec directory {root} does not exist")
    if not (root / CONFIG_NAME).is_file() and (root / TOKENIZER_CONFIG).is_file():
        return root / TOKENIZER_CONFIG
    if not (root / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{root / CONFIG_NAME}: missing (or {TOKENIZER_CONFIG})")
    return root / CONFIG_NAME


def codec_geometry(directory: str | Path) -> tuple[str, tuple[int, int], int]:
    """(kind, grid, bits per position; 0 for VQ) of a saved codec, from its config alone.
    ValueError naming the file and the field for an invalid config."""
    file = codec_config_file(directory)
    if file.name == TOKENIZER_CONFIG:
        cfg = BSQTokenizerConfig.from_file(file)
        return BSQTokenizer.kind, cfg.grid, cfg.bits_per_position
    config, _ = read_codec_dir(directory)
    kind = str(config.pop("kind"))
    try:
        codec = _codec_class(kind, str(file))(**config)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{file}: invalid {kind} codec config ({err})") from None
    grid = (int(codec.grid[0]), int(codec.grid[1]))
    return kind, grid, int(getattr(codec, "bits_per_position", 0))


def load_codec(directory: str | Path) -> ImageCodec | BSQTokenizer:
    """Load a codec saved with `save_pretrained`, choosing the class from its "kind"."""
    if codec_config_file(directory).name == TOKENIZER_CONFIG:
        return BSQTokenizer.from_pretrained(directory)
    config, _ = read_codec_dir(directory)
    return _codec_class(str(config["kind"]), str(Path(directory) / CONFIG_NAME)).from_pretrained(
        directory
    )


__all__ = [
    "BSQ_KINDS",
    "CODECS",
    "BSQCodec",
    "BSQTokenizer",
    "BSQTokenizerConfig",
    "ImageCodec",
    "VQCodec",
    "build_codec",
    "codec_config_file",
    "codec_geometry",
    "load_codec",
]
