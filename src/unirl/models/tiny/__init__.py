"""The embedded default: a ~1-3 M parameter unified model trained from scratch on digits."""

from unirl.models.tiny.model import TinyModelConfig, TinyUnifiedModel

__all__ = ["TinyModelConfig", "TinyUnifiedModel"]
