"""Object detectors for GenEval's checks, behind one interface (`Detector`).

A detector turns images into `Detection`s (class name, score, pixel box, optional mask)
for `uniweave.rewards.geneval.rules.judge`. `detect(images, min_score)` takes a list of
images — PIL images, or arrays / tensors of pixels in [0, 1] shaped [H, W], [H, W, 3] or
[3, H, W] (what a reward plugin reads of a decoded response) — and returns one list of
detections per image, running `batch_size` images per forward pass on `device`, without
gradients. Array pixels are turned into 8-bit RGB (round(255 x), clipped) first, as if
the image had been saved as the PNG GenEval reads. `min_score` lets a detector drop what
scores below it (every detection scoring `min_score` or more is returned): callers pass
the lowest threshold the rules will apply, so nothing the rules could count is lost.

Two transformers detectors, each loaded from a local model directory (hub ids are
resolved by the callers, `uniweave.config.hub`; never remote code):

- `Mask2FormerDetector` (`mask2former`): `Mask2FormerForUniversalSegmentation` with its
  image processor's `post_process_instance_segmentation` (binary maps, no score floor of
  its own). Each instance's score is the processor's: the class probability times the mean
  mask probability inside the mask (transformers rounds it to 6 decimals); its mask is the
  binary map at the image's size and its box the mask's tight pixel-edge box
  (x_min, y_min, x_max + 1, y_max + 1), as mmdet derives Mask2Former's boxes from masks.
  An instance whose mask is empty at the image's size is dropped. The checkpoint of
  GenEval's family is `facebook/mask2former-swin-small-coco-instance`.
- `Owlv2Detector` (`owlv2`): open vocabulary. `Owlv2ForObjectDetection` with text queries
  = the class names (`classes`, default GenEval's 80 COCO names); each predicted box gets
  the class of its best query and that query's sigmoid score (the processor's
  `post_process_object_detection`); boxes are clipped to the image, and a box left with
  no area is dropped. No masks: colour is judged on the box crop. Checkpoint e.g.
  `google/owlv2-base-patch16-ensemble`.

And the embedded `DigitsDetector` (`digits`) for the digits world, from a digits
classifier directory (`classifier.json`):

  A canvas (`uniweave.data.digits_world`) is a grid of 8x8 cells (`CELL`); the detector
  needs an image whose height and width are multiples of 8 (a plain 8x8 digit is one cell).
  Per image, as 8-bit RGB scaled to [0, 1] (what `Detector.detect` hands over):

  1. each cell's ink is the largest of its three channels per pixel (a stroke painted in
     any world colour keeps the scan's intensity in its brightest channel); a cell whose
     ink never reaches `INK` (0.25) is empty: no detection. Nor is a cell whose ink is
     not digit-like: farther than `DIGIT_DISTANCE` (0.3, root-mean-square over the 64
     pixels) from every scan of the digits train split. The classifier names a digit in
     anything, so without this a canvas of noise would hold four "digits" (measured:
     held-out scans lie within 0.235 of the train scans, codec reconstructions of world
     canvases within 0.245, cells of random codes decoded by the world codec at 0.37 or
     more);
  2. every other cell's ink, an 8x8 greyscale image, goes through the digits classifier
     (`uniweave.rewards.digit_classifier.DigitClassifier`, all cells of a batch in one
     pass); the detection's class is the argmax digit's name ("0".."9") and its score that
     digit's softmax probability;
  3. its box is the tight pixel-edge box (x_min, y_min, x_max + 1, y_max + 1) of the cell's
     pixels with ink >= `INK`, in canvas pixels, and its mask those pixels;
  4. its colour is the stroke's: over those pixels, each pixel's RGB divided by its ink
     (the hue at full brightness), averaged with the ink as weight; the colour is the
     nearest (Euclidean) of the world's stroke colours (`WORLD_COLOURS`: red, green,
     blue, yellow, white — GenEval's names). So a colour clause is judged by the stroke
     colour, not by CLIP (`colours_objects`: the scorer needs no colour classifier).

  At most one detection per cell. `vocabulary` is the ten digit names. Loaded from a
  directory the classifier's `save_pretrained` wrote (`classifier.json`; a run keeps its
  fitted one in `<run dir>/classifier`), or given a fitted classifier (`classifier=`, how
  the `geneval` reward uses the run's own).

Class names: a detector's labels are GenEval's names (`COCO_CLASSES`); the COCO labels
that transformers checkpoints spell differently are renamed (`LABEL_ALIASES`: mouse ->
computer mouse, remote -> tv remote, keyboard -> computer keyboard).

Errors: a bad directory, device or option raises ValueError / FileNotFoundError when the
detector is built (one line, naming what); a failure inside a forward pass raises
`DetectionError` naming the detector and the batch's image indices, so the reward
service's error policy (`reward.on_error`) and `uniweave score --on-error` can count it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from uniweave.data.digits_images import load_split
from uniweave.data.digits_world import CELL, DIGITS, WORLD_COLOURS
from uniweave.rewards.base import local_model_dir
from uniweave.rewards.digit_classifier import CONFIG_NAME as CLASSIFIER_CONFIG
from uniweave.rewards.digit_classifier import DigitClassifier
from uniweave.rewards.geneval.metadata import COCO_CLASSES
from uniweave.rewards.geneval.rules import Detection

LABEL_ALIASES: dict[str, str] = {
    "mouse": "computer mouse",
    "remote": "tv remote",
    "keyboard": "computer keyboard",
}
"""COCO labels as transformers checkpoints spell them -> GenEval's names."""

ImageInput = Image.Image | np.ndarray | torch.Tensor


class DetectionError(RuntimeError):
    """A detector's forward pass failed; names the detector and the images."""


def to_pil(image: ImageInput) -> Image.Image:
    """`image` as an 8-bit RGB PIL image (module docstring); ValueError for another shape."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    pixels = image.detach().float().cpu().numpy() if isinstance(image, torch.Tensor) else image
    pixels = np.asarray(pixels, dtype=np.float32)
    if pixels.ndim == 3 and pixels.shape[0] == 3 and pixels.shape[2] != 3:
        pixels = pixels.transpose(1, 2, 0)
    if pixels.ndim == 2:
        pixels = np.repeat(pixels[:, :, None], 3, axis=2)
    if pixels.ndim != 3 or pixels.shape[2] != 3 or min(pixels.shape[:2]) < 1:
        raise ValueError(
            f"image of shape {list(pixels.shape)}: expected [H, W], [H, W, 3] or [3, H, W]"
        )
    if not np.isfinite(pixels).all():
        raise ValueError("image has non-finite pixels")
    return Image.fromarray(np.clip(np.rint(pixels * 255.0), 0, 255).astype(np.uint8), "RGB")


def mask_box(mask: np.ndarray) -> tuple[float, float, float, float] | None:
    """The tight pixel-edge box (x_min, y_min, x_max + 1, y_max + 1) of a boolean mask
    [H, W], or None when the mask is empty."""
    cols = np.flatnonzero(mask.any(axis=0))
    rows = np.flatnonzero(mask.any(axis=1))
    if not len(cols):
        return None
    return float(cols[0]), float(rows[0]), float(cols[-1] + 1), float(rows[-1] + 1)


def _check_batch_size(batch_size: Any, what: str) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{what} batch_size must be an integer >= 1, got {batch_size!r}")
    return batch_size


class Detector(ABC):
    """Images -> detections per image (module docstring). `classes` is the vocabulary
    (the class names its detections carry, what metadata is checked against), `device`
    where it runs, `batch_size` images per forward pass."""

    name: ClassVar[str]
    model_file: ClassVar[str] = "config.json"
    """The file that marks a model directory of this detector."""
    colours_objects: ClassVar[bool] = False
    """Whether its detections carry their colour (no colour classifier needed)."""
    classes: tuple[str, ...]
    device: torch.device
    batch_size: int = 8

    def detect(self, images: Sequence[ImageInput], min_score: float = 0.0) -> list[list[Detection]]:
        """Detections of each image, `batch_size` images per forward pass (module
        docstring); `DetectionError` names the images of a batch that failed."""
        pil = [to_pil(image) for image in images]
        out: list[list[Detection]] = []
        for start in range(0, len(pil), self.batch_size):
            batch = pil[start : start + self.batch_size]
            try:
                found = self.detect_batch(batch, min_score)
            except Exception as err:  # a model may fail in any way; name the images
                last = start + len(batch) - 1
                raise DetectionError(
                    f"{self.name} detector failed on images {start}..{last}: "
                    f"{type(err).__name__}: {err}"
                ) from err
            if len(found) != len(batch):
                raise DetectionError(
                    f"{self.name} detector returned {len(found)} results for {len(batch)} images"
                )
            out.extend(found)
        return out

    @abstractmethod
    def detect_batch(self, images: list[Image.Image], min_score: float) -> list[list[Detection]]:
        """Detections of each of `images` (RGB PIL), in one forward pass."""

    @classmethod
    def vocabulary(cls, path: str | Path) -> tuple[str, ...]:
        """The classes a detector built from `path` will have, read without loading it."""
        return COCO_CLASSES


class Mask2FormerDetector(Detector):
    """transformers Mask2Former instance segmentation (module docstring)."""

    name = "mask2former"

    def __init__(self, path: str | Path, device: str = "cpu", batch_size: int = 8) -> None:
        self.batch_size = _check_batch_size(batch_size, "mask2former")
        self.device = local_model_dir(path, device, "mask2former")
        from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation

        model = Mask2FormerForUniversalSegmentation.from_pretrained(str(path))
        self.model = model.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to in a decorator mypy reads as unbound
        self.processor = AutoImageProcessor.from_pretrained(str(path))
        config: Any = model.config  # transformers types id2label and num_labels loosely
        labels = config.id2label
        self.classes = tuple(
            LABEL_ALIASES.get(labels[i], labels[i]) for i in range(config.num_labels)
        )

    @classmethod
    def vocabulary(cls, path: str | Path) -> tuple[str, ...]:
        """The checkpoint's labels (config.json `id2label`), renamed by `LABEL_ALIASES`."""
        config = Path(path) / "config.json"
        try:
            labels = json.loads(config.read_text())["id2label"]
            names = [labels[str(i)] for i in range(len(labels))]
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path}: not a mask2former model directory (no config.json)"
            ) from None
        except (KeyError, ValueError, TypeError) as err:
            raise ValueError(
                f"{config}: no usable id2label ({type(err).__name__}: {err})"
            ) from None
        return tuple(LABEL_ALIASES.get(n, n) for n in names)

    @torch.no_grad()
    def detect_batch(self, images: list[Image.Image], min_score: float) -> list[list[Detection]]:
        inputs = self.processor(images=images, return_tensors="pt").to(self.device)
        outputs = self.model(**inputs)
        sizes = [(image.height, image.width) for image in images]
        results = self.processor.post_process_instance_segmentation(
            outputs, threshold=min_score, target_sizes=sizes, return_binary_maps=True
        )
        out = []
        for result in results:
            infos = result["segments_info"]
            maps = result["segmentation"]
            found = []
            if infos:
                masks = maps.detach().cpu().numpy() > 0.5
                for info, mask in zip(infos, masks):
                    box = mask_box(mask)
                    if box is None:
                        continue
                    found.append(
                        Detection(self.classes[info["label_id"]], float(info["score"]), box, mask)
                    )
            out.append(found)
        return out


class Owlv2Detector(Detector):
    """transformers OWLv2 open-vocabulary detection (module docstring)."""

    name = "owlv2"

    def __init__(
        self,
        path: str | Path,
        device: str = "cpu",
        batch_size: int = 8,
        classes: Sequence[str] = COCO_CLASSES,
    ) -> None:
        self.batch_size = _check_batch_size(batch_size, "owlv2")
        classes = tuple(classes)
        if not classes or not all(isinstance(c, str) and c.strip() for c in classes):
            raise ValueError("owlv2 classes must be a non-empty list of class names")
        if len(set(classes)) != len(classes):
            raise ValueError("owlv2 classes name a class twice")
        self.classes = classes
        self.device = local_model_dir(path, device, "owlv2")
        from transformers import Owlv2ForObjectDetection, Owlv2Processor

        model = Owlv2ForObjectDetection.from_pretrained(str(path))
        self.model = model.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to in a decorator mypy reads as unbound
        self.processor = Owlv2Processor.from_pretrained(str(path))

    @torch.no_grad()
    def detect_batch(self, images: list[Image.Image], min_score: float) -> list[list[Detection]]:
        queries = [list(self.classes)] * len(images)
        inputs = self.processor(text=queries, images=images, return_tensors="pt")
        outputs = self.model(**inputs.to(self.device))
        sizes = [(image.height, image.width) for image in images]
        # the processor pads each image to a square at the bottom and right; boxes scaled to
        # (height, width) are in the image's pixels (transformers scales by the longer side)
        results = self.processor.image_processor.post_process_object_detection(
            outputs, threshold=-1.0, target_sizes=sizes
        )
        out = []
        for result, (height, width) in zip(results, sizes):
            found = []
            for score, label, box in zip(
                result["scores"].tolist(), result["labels"].tolist(), result["boxes"].tolist()
            ):
                if score < min_score:
                    continue
                x1, x2 = (min(max(v, 0.0), float(width)) for v in (box[0], box[2]))
                y1, y2 = (min(max(v, 0.0), float(height)) for v in (box[1], box[3]))
                if x2 <= x1 or y2 <= y1:
                    continue
                found.append(Detection(self.classes[label], float(score), (x1, y1, x2, y2)))
            out.append(found)
        return out


INK = 0.25
"""A pixel is ink when its brightest channel reaches this; a cell with none is empty."""
DIGIT_DISTANCE = 0.3
"""A cell is digit-like within this RMS pixel distance of some digits train scan."""

_NAMES = tuple(WORLD_COLOURS)
_RGB = np.asarray([WORLD_COLOURS[n] for n in _NAMES], dtype=np.float64)


def stroke_colour(cell: np.ndarray, ink: np.ndarray, where: np.ndarray) -> str:
    """The world colour nearest to the ink-weighted mean hue of `cell` [8, 8, 3] over the
    pixels `where` (module docstring, step 4)."""
    w = ink[where].astype(np.float64)
    hue = cell[where].astype(np.float64) / w[:, None]
    mean = (hue * w[:, None]).sum(0) / w.sum()
    return _NAMES[int(np.argmin(((_RGB - mean) ** 2).sum(1)))]


class DigitsDetector(Detector):
    """Digits per 8x8 cell with their stroke colours (module docstring)."""

    name = "digits"
    model_file = CLASSIFIER_CONFIG
    colours_objects = True

    def __init__(
        self,
        path: str | Path | None = None,
        device: str = "cpu",
        batch_size: int = 64,
        classifier: DigitClassifier | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"digits batch_size must be an integer >= 1, got {batch_size!r}")
        if device != "cpu":
            raise ValueError(f"the digits detector runs on the CPU, got device {device!r}")
        if (path is None) == (classifier is None):
            raise ValueError("the digits detector needs a classifier directory or a classifier")
        self.batch_size = batch_size
        self.device = torch.device("cpu")
        self.classes = DIGITS
        if classifier is None:
            assert path is not None, "one of the two, checked above"
            classifier = DigitClassifier.from_pretrained(path)
        self.classifier = classifier
        scans = load_split("train").images
        self._scans = torch.from_numpy(scans.reshape(len(scans), -1)).double()

    def digit_like(self, inks: np.ndarray) -> np.ndarray:
        """bool [N]: whether each ink image [N, 8, 8] lies within `DIGIT_DISTANCE` (RMS)
        of some train-split scan."""
        x = torch.from_numpy(inks.reshape(len(inks), -1)).double()
        d2 = torch.cdist(x, self._scans).pow(2).min(dim=1).values / x.shape[1]
        return (d2.sqrt() <= DIGIT_DISTANCE).numpy()

    @classmethod
    def vocabulary(cls, path: str | Path) -> tuple[str, ...]:
        """The ten digit names; FileNotFoundError when `path` holds no classifier."""
        if not (Path(path) / CLASSIFIER_CONFIG).is_file():
            raise FileNotFoundError(
                f"{path}: not a digits classifier directory (no {CLASSIFIER_CONFIG})"
            )
        return DIGITS

    def cells(self, image: np.ndarray) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """(top, left, cell [8, 8, 3], ink [8, 8]) of each non-empty, digit-like cell, in raster order;
        ValueError for an image that is not a whole number of cells."""
        h, w = image.shape[:2]
        if h % CELL or w % CELL:
            raise ValueError(f"a digits canvas is a multiple of {CELL} pixels a side, got {h}x{w}")
        out = []
        for top in range(0, h, CELL):
            for left in range(0, w, CELL):
                cell = image[top : top + CELL, left : left + CELL]
                ink = cell.max(axis=-1)
                if float(ink.max()) >= INK:
                    out.append((top, left, cell, ink))
        if out:
            keep = self.digit_like(np.stack([c[3] for c in out]))
            out = [c for c, k in zip(out, keep) if k]
        return out

    def detect_batch(self, images: list[Image.Image], min_score: float) -> list[list[Detection]]:
        found = [self.cells(np.asarray(im, dtype=np.float32) / 255.0) for im in images]
        inks = [ink for cells in found for (_, _, _, ink) in cells]
        proba = np.zeros((0, len(DIGITS)), dtype=np.float32)
        if inks:
            proba = self.classifier.predict_proba(np.stack(inks)).numpy()
        k = 0
        out = []
        for image, cells in zip(images, found):
            dets = []
            for top, left, cell, ink in cells:
                p = proba[k]
                k += 1
                digit = int(np.argmax(p))
                score = float(p[digit])
                if score < min_score:
                    continue
                where = ink >= INK
                mask = np.zeros((image.height, image.width), dtype=bool)
                mask[top : top + CELL, left : left + CELL] = where
                box = mask_box(mask)
                assert box is not None, "a kept cell has ink (cells)"
                colour = stroke_colour(cell, ink, where)
                dets.append(Detection(DIGITS[digit], score, box, mask, colour))
            out.append(dets)
        return out


DETECTORS: dict[str, type[Detector]] = {
    "mask2former": Mask2FormerDetector,
    "owlv2": Owlv2Detector,
    "digits": DigitsDetector,
}
"""Detector name (`uniweave score --detector`, the `geneval` reward's `detector`) -> class."""


def load_detector(
    kind: str, path: str | Path, device: str = "cpu", batch_size: int = 8
) -> Detector:
    """The detector `kind` (`DETECTORS`) from the local model directory `path`;
    ValueError / FileNotFoundError (one line) for an unknown kind or a bad directory."""
    cls = DETECTORS.get(kind)
    if cls is None:
        raise ValueError(f"unknown detector {kind!r}; expected one of {', '.join(DETECTORS)}")
    return cls(path, device=device, batch_size=batch_size)  # type: ignore[call-arg]  # each registered detector takes these
