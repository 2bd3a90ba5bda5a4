"""A small CNN that classifies 8x8 digits; used as a learned image reward.

Architecture: conv3x3(1->c) - ReLU - conv3x3(c->2c) - ReLU - maxpool2 - linear(2c*16 -> h)
- ReLU - linear(h -> 10). Trained with AdamW on cross-entropy, fixed seed and data order.
As a reward, `score(pixels, digits)` = p(digit | pixels) under the softmax of the logits,
computed in eval mode without gradients.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from uniweave.codecs.base import ArrayLike, as_pixels, as_tensor, train_minibatches
from uniweave.config.schema import RewardConfig
from uniweave.core.atomic import apply_umask
from uniweave.data.digits_images import load_split

CONFIG_NAME = "classifier.json"
WEIGHTS_NAME = "classifier.safetensors"
N_CLASSES = 10


def _labels(labels: ArrayLike, n: int, name: str = "labels") -> torch.Tensor:
    """Validate integer class ids [n] in [0, 10) and return them as long."""
    t = as_tensor(labels, name)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be integers, got dtype {t.dtype}")
    if tuple(t.shape) != (n,):
        raise ValueError(f"{name} must have shape [{n}] to match the images, got {list(t.shape)}")
    if int(t.min()) < 0 or int(t.max()) >= N_CLASSES:
        raise ValueError(f"{name} must lie in [0, {N_CLASSES}), got {int(t.min())}..{int(t.max())}")
    return t.long()


class DigitClassifier:
    """p(digit | 8x8 image in [0, 1]) from a two-layer CNN."""

    def __init__(
        self,
        channels: int = 16,
        hidden: int = 64,
        epochs: int = 20,
        batch_size: int = 64,
        lr: float = 3e-3,
        weight_decay: float = 1e-4,
    ) -> None:
        self.channels = int(channels)
        self.hidden = int(hidden)
        self.epochs = int(epochs)
        self.batch_size = int(batch_size)
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.net = self._build()
        self.net.eval()
        self.fitted = False

    def _build(self) -> nn.Sequential:
        c, h = self.channels, self.hidden
        return nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * c * 16, h),
            nn.ReLU(),
            nn.Linear(h, N_CLASSES),
        )

    def config(self) -> dict[str, Any]:
        return {
            "channels": self.channels,
            "hidden": self.hidden,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
        }

    def fit(self, images: ArrayLike, labels: ArrayLike, seed: int = 0) -> DigitClassifier:
        """Train from scratch on cross-entropy (seeded init and data order; `train_minibatches`)."""
        x = as_pixels(images, name="images").unsqueeze(1)
        y = _labels(labels, x.shape[0])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = self._build()
        self.net.train()
        train_minibatches(
            self.net.parameters(),
            lambda idx: nn.functional.cross_entropy(self.net(x[idx]), y[idx]),
            n=x.shape[0],
            epochs=self.epochs,
            batch_size=self.batch_size,
            lr=self.lr,
            weight_decay=self.weight_decay,
            seed=seed,
        )
        self.net.eval()
        self.fitted = True
        return self

    def _check_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError("DigitClassifier is not fitted; call fit(images, labels) first")

    def logits(self, pixels: ArrayLike) -> torch.Tensor:
        """Class logits [N, 10] (eval mode, no gradients)."""
        self._check_fitted()
        x = as_pixels(pixels).unsqueeze(1)
        self.net.eval()
        with torch.no_grad():
            return self.net(x)

    def features(self, pixels: ArrayLike) -> torch.Tensor:
        """The input of the last linear layer (the ReLU'd hidden activations), float32
        [N, hidden] (eval mode, no gradients): the classifier's image features."""
        self._check_fitted()
        x = as_pixels(pixels).unsqueeze(1)
        self.net.eval()
        with torch.no_grad():
            return self.net[:-1](x)

    def predict_proba(self, pixels: ArrayLike) -> torch.Tensor:
        """softmax(logits): float32 [N, 10], rows sum to 1."""
        return self.logits(pixels).softmax(dim=-1)

    def predict(self, pixels: ArrayLike) -> torch.Tensor:
        """argmax class: long [N]."""
        return self.logits(pixels).argmax(dim=-1)

    def accuracy(self, pixels: ArrayLike, labels: ArrayLike) -> float:
        """Fraction of images whose argmax class equals the label."""
        pred = self.predict(pixels)
        return float((pred == _labels(labels, pred.shape[0])).double().mean())

    def score(self, pixels: ArrayLike, digits: ArrayLike) -> torch.Tensor:
        """Reward p(digit_i | pixels_i): float32 [N] in [0, 1]."""
        proba = self.predict_proba(pixels)
        d = _labels(digits, proba.shape[0], name="digits")
        return proba.gather(1, d.unsqueeze(1)).squeeze(1)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write `classifier.safetensors` and `classifier.json` into `directory`."""
        self._check_fitted()
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.net.state_dict().items()}
        save_file(state, str(root / WEIGHTS_NAME))
        config = {"kind": "digit_classifier", **self.config()}
        (root / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        apply_umask(root)  # safetensors writes 0600
        return root

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> DigitClassifier:
        """Load a classifier saved by `save_pretrained`; missing files name their path."""
        root = Path(directory)
        if not root.is_dir():
            raise FileNotFoundError(f"classifier directory {root} does not exist")
        for path in (root / CONFIG_NAME, root / WEIGHTS_NAME):
            if not path.is_file():
                raise FileNotFoundError(f"classifier directory {root} is missing {path}")
        try:
            config = json.loads((root / CONFIG_NAME).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{root / CONFIG_NAME} is not valid JSON: {err}") from err
        if not isinstance(config, dict) or config.pop("kind", None) != "digit_classifier":
            raise ValueError(f"{root / CONFIG_NAME} is not a digit_classifier config")
        try:
            model = cls(**config)
        except TypeError as err:
            raise ValueError(f"{root / CONFIG_NAME} has invalid fields: {err}") from err
        state = load_file(str(root / WEIGHTS_NAME))
        try:
            model.net.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"{root / WEIGHTS_NAME} does not match the config: {err}") from err
        model.net.eval()
        model.fitted = True
        return model


def load_or_fit_classifier(directory: Path | None, seed: int = 0) -> DigitClassifier:
    """The digits classifier saved in `directory`, or one fitted on the train split (and
    saved there when a directory is given)."""
    if directory is not None and (directory / "classifier.json").is_file():
        return DigitClassifier.from_pretrained(directory)
    train = load_split("train")
    classifier = DigitClassifier().fit(train.images, train.labels, seed=seed)
    if directory is not None:
        classifier.save_pretrained(directory)
    return classifier


CLASSIFIER_DIR = "classifier"
"""Where a run keeps its fitted digits classifier (under the run or eval directory)."""


def needs_digit_classifier(reward: RewardConfig) -> bool:
    """Whether a reward plugin of `reward` needs the built-in digits classifier (the
    `digit_classifier` plugin, a plugin asked to `require_image_class`, or the `geneval`
    plugin with the digits detector) and was given no path of its own."""
    return any(
        p.path is None
        and (
            p.name == "digit_classifier"
            or bool(p.kwargs.get("require_image_class"))
            or (p.name == "geneval" and p.kwargs.get("detector") == "digits")
        )
        for p in reward.plugins
    )
