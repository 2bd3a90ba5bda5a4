"""The embedded default: a ~1-3 M parameter unified model trained from scratch on digits.

Kind "tiny": VQ or BSQ head; built from the config alone (`build_tiny`) or loaded from a
directory its `save_pretrained` wrote.
"""

from unirl.models.registry import register_model
from unirl.models.tiny.build import build_tiny
from unirl.models.tiny.model import TinyModelConfig, TinyUnifiedModel

register_model(
    "tiny", visual_heads=("vq", "bsq"), build=build_tiny, inspect=TinyUnifiedModel.inspect
)(TinyUnifiedModel)

__all__ = ["TinyModelConfig", "TinyUnifiedModel", "build_tiny"]
