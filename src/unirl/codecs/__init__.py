"""Image codecs: VQ (k-means codebook over patches) and BSQ (binary spherical quantisation).

`build_codec(kind, **config)` makes an unfitted codec; `load_codec(dir)` loads a saved one,
dispatching on the "kind" stored in `codec.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unirl.codecs.base import CONFIG_NAME, ImageCodec, read_codec_dir
from unirl.codecs.bsq import BSQCodec
from unirl.codecs.vq import VQCodec

CODECS: dict[str, type[ImageCodec]] = {"vq": VQCodec, "bsq": BSQCodec}


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


def load_codec(directory: str | Path) -> ImageCodec:
    """Load a codec saved with `save_pretrained`, choosing the class from its "kind"."""
    config, _ = read_codec_dir(directory)
    return _codec_class(str(config["kind"]), str(Path(directory) / CONFIG_NAME)).from_pretrained(
        directory
    )


__all__ = ["CODECS", "BSQCodec", "ImageCodec", "VQCodec", "build_codec", "load_codec"]
