"""Janus-Pro (DeepSeek) on transformers' `JanusForConditionalGeneration`: the adapter,
checkpoint loading with checks, the chat template and its CFG unconditional prompt.

Kind "janus_pro": a VQ head; loads a local checkpoint (a transformers `model_type: janus`
download or a directory its `save_pretrained` wrote).
"""

from unirl.models.janus_pro.images import JanusVQCodec, PixelSpec
from unirl.models.janus_pro.loading import check_checkpoint, inspect_checkpoint
from unirl.models.janus_pro.model import JanusProModel
from unirl.models.janus_pro.template import JanusTemplate, JanusTokens
from unirl.models.registry import register_model

register_model(
    "janus_pro",
    visual_heads=("vq",),
    transformers_model_types=("janus",),
    inspect=inspect_checkpoint,
)(JanusProModel)

__all__ = [
    "JanusProModel",
    "JanusTemplate",
    "JanusTokens",
    "JanusVQCodec",
    "PixelSpec",
    "check_checkpoint",
]
