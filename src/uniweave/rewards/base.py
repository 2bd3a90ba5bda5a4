"""The reward plugin interface: what a plugin reads of a rollout row (`Response`), the
plugin contract (`RewardPlugin`), and `build_responses`, which decodes the images of
parsed responses once for every plugin.

Built-in plugins live in `uniweave.rewards.plugins` (and modules such as
`uniweave.rewards.clip_score`), all written against this module alone.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from uniweave.core.sample import ImagePart, Part, Sample, TextPart
from uniweave.data.template import response_parts

DecodeImages = Callable[[torch.Tensor], torch.Tensor]
"""codes VQ long [N, gh, gw] | BSQ float [N, gh, gw, L] -> pixels float [N, H, W] in [0, 1];
raises ValueError for codes it cannot decode (e.g. a grid the codec does not have)."""


@dataclass(frozen=True, eq=False)
class Response:
    """What a plugin reads of one rollout row.

    parts: the response parts in order (empty when the row could not be parsed);
    images: decoded pixels float [H, W] (or [H, W, C]) of each ImagePart of `parts`, in
    order, None where it could not be decoded; parsed: False when parsing failed.
    """

    parts: tuple[Part, ...] = ()
    images: tuple[torch.Tensor | None, ...] = ()
    parsed: bool = True

    @property
    def texts(self) -> list[str]:
        """The text of every TextPart, in order."""
        return [p.text for p in self.parts if isinstance(p, TextPart)]

    @property
    def text(self) -> str:
        """All response text concatenated."""
        return "".join(self.texts)

    @property
    def n_images(self) -> int:
        return sum(isinstance(p, ImagePart) for p in self.parts)

    def text_after_last_image(self) -> str | None:
        """Concatenated text after the last image, or None without an image."""
        last = max((k for k, p in enumerate(self.parts) if isinstance(p, ImagePart)), default=-1)
        if last < 0:
            return None
        return "".join(p.text for p in self.parts[last + 1 :] if isinstance(p, TextPart))


class RewardPlugin(ABC):
    """A batched scorer: `score(samples, responses)` -> one float per row.

    `invalid_format` flags rows whose response does not have the expected format (they
    also score 0). Plugins that read pixels set `needs_images` (the service then needs a
    `decode_images`); plugins that read `Sample.answer` set `requires_answer`.
    Raising, returning non-finite or too few/many scores are errors.
    """

    name: ClassVar[str]
    needs_images: bool = False
    requires_answer: ClassVar[bool] = False
    """Whether `score` compares responses with `Sample.answer` (every row it scores
    must carry one; `uniweave.rewards.answers.check_answers`)."""

    @classmethod
    def answer_problem(cls, answer: str) -> str | None:
        """Why `answer` cannot be verified by this plugin (None: it can)."""
        return None

    @abstractmethod
    def score(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> Sequence[float] | torch.Tensor | np.ndarray:
        """Scores [n] for n rows."""

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        """Per-row invalid-format flags [n] (default: none)."""
        return [False] * len(samples)

    def features(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> torch.Tensor | None:
        """The scorer's feature vector of each row's response, float [n, d], a row of NaN
        where the response has none (e.g. no decodable image); None (the default): this
        plugin has no features. GRPO's diversity metrics (the Vendi score) read them."""
        return None

    def pop_counts(self) -> dict[str, float]:
        """Summable counts of what the plugin did since the last call (then reset), logged
        as `reward/<plugin>/<name>` and, with `n_rows` among them, `<x>_frac` for each
        `n_<x>` (e.g. answer_judge's n_judged -> judged_frac), and `<x>_mean` for each
        `sum_<x>` beside an `n_<x>` (geneval's per-tag means). Default: none."""
        return {}


def build_responses(
    responses: Sequence[Sequence[Part] | None], decode_images: DecodeImages | None
) -> tuple[list[Response], int]:
    """`Response`s with decoded images, and the number of images that could not be decoded.

    Pixels come from `ImagePart.pixels` when set, else from `decode_images`, called once
    per distinct code shape; a ValueError from it marks those images undecodable (None,
    counted). Without `decode_images`, code-only images are None (not counted).
    """
    parts_list = [None if r is None else response_parts(r) for r in responses]
    pixels: dict[tuple[int, int], torch.Tensor | None] = {}
    pending: dict[tuple, list[tuple[int, int]]] = {}
    n_bad = 0
    for i, parts in enumerate(parts_list):
        for k, part in enumerate(parts or []):
            if not isinstance(part, ImagePart):
                continue
            if part.pixels is not None:
                pixels[(i, k)] = torch.from_numpy(np.asarray(part.pixels, dtype=np.float32))
            elif decode_images is None or part.codes is None:
                pixels[(i, k)] = None
            else:
                shape = (tuple(part.codes.shape), part.codes.dtype)
                pending.setdefault(shape, []).append((i, k))
    for where in pending.values():
        assert decode_images is not None, "codes are pending only with a decoder"
        codes = torch.stack([_codes(parts_list[i], k) for i, k in where])
        try:
            decoded = decode_images(codes)
        except ValueError:
            decoded = None
            n_bad += len(where)
        if decoded is not None and len(decoded) != len(where):
            raise ValueError(f"decode_images returned {len(decoded)} images for {len(where)}")
        for n, ik in enumerate(where):
            pixels[ik] = None if decoded is None else decoded[n].detach().float().cpu()
    out = []
    for i, parts in enumerate(parts_list):
        if parts is None:
            out.append(Response(parsed=False))
            continue
        images = tuple(pixels[(i, k)] for k, p in enumerate(parts) if isinstance(p, ImagePart))
        out.append(Response(tuple(parts), images))
    return out, n_bad


def local_model_dir(path: str | Path, device: str, what: str) -> torch.device:
    """Check a reward model's local transformers directory before loading it (the CLIP
    scorer, the local judge): `device` is cpu or cuda (cuda available), `path` holds a
    config.json, and the config asks for no remote code (`auto_map`). The torch device;
    ValueError / FileNotFoundError naming `what` otherwise."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"{what} device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} device 'cuda' requested but CUDA is not available")
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path}: not a {what} model directory (missing config.json)")
    if "auto_map" in json.loads(config.read_text()):
        raise ValueError(f"{config}: asks for remote code (auto_map); refusing to run it")
    return torch.device(device)


def _codes(parts: Sequence[Part] | None, k: int) -> torch.Tensor:
    """The codes of image part `k` of `parts` (`build_responses` pends only such parts)."""
    part = None if parts is None else parts[k]
    assert isinstance(part, ImagePart) and part.codes is not None
    return part.codes
