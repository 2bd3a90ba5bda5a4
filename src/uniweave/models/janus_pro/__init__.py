"""Janus-Pro (DeepSeek) on transformers' `JanusForConditionalGeneration`: the adapter,
checkpoint loading with checks, the chat template and its CFG unconditional prompt.

Kind "janus_pro" (declared in `kind.json`): a VQ head; loads a local checkpoint (a transformers `model_type: janus`
download or a directory its `save_pretrained` wrote).
"""

from uniweave.models.janus_pro.images import JanusVQCodec, PixelSpec
from uniweave.models.janus_pro.loading import check_checkpoint
from uniweave.models.janus_pro.model import JanusProModel
from uniweave.models.janus_pro.template import JanusTemplate, JanusTokens

__all__ = [
    "JanusProModel",
    "JanusTemplate",
    "JanusTokens",
    "JanusVQCodec",
    "PixelSpec",
    "check_checkpoint",
]
