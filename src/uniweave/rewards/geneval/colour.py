"""GenEval's colour classifier on transformers' CLIP: zero-shot over its ten colours.

For an object of class c (a `Detection` with its box and, from Mask2Former, its mask) in
an RGB image, as GenEval's `evaluate_images.py` does it:

1. the crop: the image with every pixel outside the object's mask replaced by the
   background colour `#999` (RGB 153, 153, 153; no mask: the image as is), cut to the
   object's box by PIL's `crop` (which rounds the box's coordinates to whole pixels);
2. the classifier of class c: for each colour k of `COLOURS`, CLIP's text embeddings of
   the three prompts `TEMPLATES` ("a photo of a {k} {c}", "a photo of a {k}-colored {c}",
   "a photo of a {k} object"), each L2-normalised, averaged, and the mean normalised
   again — the zero-shot classifier of clip_benchmark that GenEval calls;
3. the colour: argmax over k of the normalised image embedding of the crop (CLIP's image
   preprocessing: resize, centre crop, normalise) dotted with class c's colour vectors.

The classifier's text vectors are computed once per class and kept. Crops run `batch_size`
at a time on `device`, without gradients. GenEval runs OpenAI's ViT-L/14 through
open_clip; its transformers twin is `openai/clip-vit-large-patch14` (the image resize may
differ by interpolation details, so a colour on a crop that sits on the boundary between
two colours can differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from uniweave.rewards.base import local_model_dir
from uniweave.rewards.geneval.metadata import COLOURS
from uniweave.rewards.geneval.rules import Detection

TEMPLATES: tuple[str, ...] = (
    "a photo of a {colour} {cls}",
    "a photo of a {colour}-colored {cls}",
    "a photo of a {colour} object",
)
"""GenEval's three colour prompts."""

BACKGROUND = (153, 153, 153)
"""GenEval's `#999`: what replaces the pixels outside an object's mask."""


def colour_crop(image: Image.Image, detection: Detection) -> Image.Image:
    """The crop GenEval classifies for `detection` in `image` (module docstring, step 1)."""
    image = image.convert("RGB")
    if detection.mask is not None:
        blank = Image.new("RGB", image.size, BACKGROUND)
        mask = Image.fromarray((np.asarray(detection.mask) > 0).astype(np.uint8) * 255)
        image = Image.composite(image, blank, mask)
    return image.crop(detection.box)


class ClipColourClassifier:
    """Zero-shot colour of detected objects under a local CLIP model (module docstring)."""

    def __init__(self, path: str | Path, device: str = "cpu", batch_size: int = 16) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"colour batch_size must be an integer >= 1, got {batch_size!r}")
        self.batch_size = batch_size
        self.device = local_model_dir(path, device, "CLIP colour")
        from transformers import CLIPModel, CLIPProcessor

        model = CLIPModel.from_pretrained(str(path))
        self.model = model.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to in a decorator mypy reads as unbound
        self.processor = CLIPProcessor.from_pretrained(str(path))
        self._weights: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def weights(self, cls: str) -> torch.Tensor:
        """Class `cls`'s colour vectors, float32 [len(COLOURS), d] (module docstring, step 2)."""
        if cls not in self._weights:
            texts = [t.format(colour=k, cls=cls) for k in COLOURS for t in TEMPLATES]
            tokens = self.processor.tokenizer(texts, padding=True, return_tensors="pt")
            tokens = tokens.to(self.device)
            emb = self.model.get_text_features(
                input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
            ).pooler_output.float()
            emb = torch.nn.functional.normalize(emb, dim=-1).view(len(COLOURS), len(TEMPLATES), -1)
            self._weights[cls] = torch.nn.functional.normalize(emb.mean(dim=1), dim=-1)
        return self._weights[cls]

    @torch.no_grad()
    def classify(self, crops: Sequence[Image.Image], cls: str) -> list[str]:
        """The colour of each crop (of objects of class `cls`), step 3."""
        weights = self.weights(cls)
        out: list[str] = []
        for start in range(0, len(crops), self.batch_size):
            batch = list(crops[start : start + self.batch_size])
            pixels = self.processor.image_processor(images=batch, return_tensors="pt")
            feats = self.model.get_image_features(
                pixel_values=pixels["pixel_values"].to(self.device)
            ).pooler_output.float()
            logits = torch.nn.functional.normalize(feats, dim=-1) @ weights.T
            out.extend(COLOURS[int(k)] for k in logits.argmax(dim=-1).tolist())
        return out

    def colours(self, image: Image.Image, detections: Sequence[Detection]) -> list[str]:
        """The colour of each detection in `image`, each judged with its own class's prompts."""
        out: list[str | None] = [None] * len(detections)
        by_class: dict[str, list[int]] = {}
        for i, det in enumerate(detections):
            by_class.setdefault(det.label, []).append(i)
        for cls, idx in by_class.items():
            found = self.classify([colour_crop(image, detections[i]) for i in idx], cls)
            for i, colour in zip(idx, found):
                out[i] = colour
        return [c for c in out if c is not None]
