"""`uniweave models write-full-shape NAME OUT [--shape full|small]`: which writer makes
which model (`janus_pro.full_shape`, `uniar.full_shape`; the layout and the shard writing
are `hub_layout`'s). No torch at import (the CLI's parser reads `NAMES`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from uniweave.models.hub_layout import Written

NAMES = ("janus-pro-1b", "janus-pro-7b", "qwen3-vl-2b")
SHAPES = ("full", "small")


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
        from uniweave.models.janus_pro.full_shape import write_janus

        return write_janus(name, out, small, seed)
    from uniweave.models.uniar.full_shape import write_uniar

    return write_uniar(out, small, seed)
