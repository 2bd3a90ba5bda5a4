"""UniAR: transformers' Qwen3-VL reading images through its vision tower and writing them
as grouped BSQ bits (k x k cells x L bits per composite position) through a bit embedding
and a small visual decoder; M-RoPE positions from `get_rope_index`.

Kind "uniar": a BSQ head; built from the config (a tiny Qwen3-VL on the digits, `tiny`)
or loaded from a directory its `save_pretrained` wrote (`loading`).
"""

from unirl.models.registry import register_model
from unirl.models.uniar.loading import check_directory, inspect_directory
from unirl.models.uniar.model import InterleavedOutput, UniARModel, UniARSpec
from unirl.models.uniar.tiny import (
    TinyUniARSizes,
    build_tiny_uniar,
    build_uniar,
    check_uniar_config,
)

register_model(
    "uniar",
    visual_heads=("bsq",),
    transformers_model_types=("qwen3_vl",),
    build=build_uniar,
    check=check_uniar_config,
    inspect=inspect_directory,
)(UniARModel)

__all__ = [
    "InterleavedOutput",
    "TinyUniARSizes",
    "UniARModel",
    "UniARSpec",
    "build_tiny_uniar",
    "build_uniar",
    "check_directory",
]
