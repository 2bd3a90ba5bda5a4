"""The embedded default: a ~1-3 M parameter unified model trained from scratch on digits.

Kind "tiny" (declared in `kind.json`): VQ or BSQ head; built from the config alone (`build_tiny`) or loaded from a
directory its `save_pretrained` wrote.
"""

from uniweave.models.tiny.build import build_tiny
from uniweave.models.tiny.model import TinyArchitecture, TinyUnifiedModel

__all__ = ["TinyArchitecture", "TinyUnifiedModel", "build_tiny"]
