"""Janus-Pro (DeepSeek) on transformers' `JanusForConditionalGeneration`: the adapter,
checkpoint loading with checks, the chat template and its CFG unconditional prompt."""

from unirl.models.janus_pro.images import JanusVQCodec, PixelSpec
from unirl.models.janus_pro.loading import check_checkpoint
from unirl.models.janus_pro.model import JanusProModel
from unirl.models.janus_pro.template import JanusTemplate, JanusTokens

__all__ = [
    "JanusProModel",
    "JanusTemplate",
    "JanusTokens",
    "JanusVQCodec",
    "PixelSpec",
    "check_checkpoint",
]
