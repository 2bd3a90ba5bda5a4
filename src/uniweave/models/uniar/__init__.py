"""UniAR: transformers' Qwen3-VL reading images through its vision tower and writing them
as grouped BSQ bits (k x k cells x L bits per composite position) through a bit embedding
and a small visual decoder; M-RoPE positions from `get_rope_index`.

Kind "uniar" (declared in `kind.json`): a BSQ head; built from the config (a tiny Qwen3-VL on the digits, `tiny`)
or loaded from a directory its `save_pretrained` wrote (`loading`).
"""

from uniweave.models.uniar.loading import check_directory
from uniweave.models.uniar.model import InterleavedOutput, UniARModel, UniARSpec
from uniweave.models.uniar.tiny import SMALL_SIZES, TinyUniARSizes, build_tiny_uniar, build_uniar

__all__ = [
    "SMALL_SIZES",
    "InterleavedOutput",
    "TinyUniARSizes",
    "UniARModel",
    "UniARSpec",
    "build_tiny_uniar",
    "build_uniar",
    "check_directory",
]
