"""CLIP / PickScore-style text-image reward on transformers' `CLIPModel` + `CLIPProcessor`.

For a row with prompt text y and generated image x, with e_t = text_projection(E_text(y))
and e_i = visual_projection(E_image(x)) (CLIP's projected embeddings) and
cos = e_t . e_i / (|e_t| |e_i|):

- mode "pickscore" (default): s = exp(logit_scale) * cos, the logit CLIP is trained on and
  the score PickScore (Kirstain et al., 2023) reports;
- mode "clipscore": s = 2.5 * max(cos, 0) (CLIPScore, Hessel et al., 2021).

The prompt text is `sample.meta["caption"]` when set, else the sample's non-assistant
text parts joined by " ". Images are the decoded pixels (float [H, W] or [H, W, 3] in
[0, 1]); the processor resizes, crops and normalises them. A row without exactly one
decodable image is invalid (score 0). The model is loaded from a local directory
(`CLIPModel.from_pretrained`, never remote code) and runs on `device` ("cpu" | "cuda"),
`batch_size` rows at a time, without gradients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from uniweave.config.errors import ConfigError
from uniweave.config.schema import RewardPluginConfig
from uniweave.core.sample import Sample, TextPart
from uniweave.rewards.base import Response, RewardPlugin, local_model_dir

Mode = Literal["pickscore", "clipscore"]
MODES: tuple[str, ...] = ("pickscore", "clipscore")
CLIPSCORE_WEIGHT = 2.5


def prompt_text(sample: Sample) -> str:
    """meta["caption"], else the non-assistant text parts joined by " "."""
    caption = sample.meta.get("caption")
    if isinstance(caption, str) and caption.strip():
        return caption
    texts = [p.text for p in sample.parts if isinstance(p, TextPart) and p.role != "assistant"]
    return " ".join(t.strip() for t in texts if t.strip())


def one_image(response: Response) -> np.ndarray | None:
    """The response's only decoded image as float32 [H, W, 3], or None."""
    if not response.parsed or len(response.images) != 1 or response.images[0] is None:
        return None
    px = np.asarray(response.images[0], dtype=np.float32)
    if px.ndim == 2:
        px = np.repeat(px[:, :, None], 3, axis=2)
    return px if px.ndim == 3 and px.shape[2] == 3 else None


class ClipScore(RewardPlugin):
    """Text-image agreement under a CLIP model (module docstring)."""

    name = "clip_score"
    needs_images = True
    config_kwargs = frozenset({"device", "mode", "batch_size"})

    def __init__(
        self, path: str | Path, device: str = "cpu", mode: Mode = "pickscore", batch_size: int = 32
    ) -> None:
        path = Path(path)
        if mode not in MODES:
            raise ValueError(f"clip_score mode must be one of {', '.join(MODES)}, got {mode!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"clip_score batch_size must be >= 1, got {batch_size}")
        self.device = local_model_dir(path, device, "clip_score")
        from transformers import CLIPModel, CLIPProcessor

        self.model = CLIPModel.from_pretrained(str(path)).to(self.device).eval()  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to in a decorator mypy reads as unbound
        self.model.requires_grad_(False)
        self.processor = CLIPProcessor.from_pretrained(str(path))
        self.mode = mode
        self.batch_size = int(batch_size)

    @classmethod
    def from_config(
        cls, cfg: RewardPluginConfig, key: str, resources: Mapping[str, Any] | None = None
    ) -> ClipScore:
        """Build from `reward.plugins.N` (path required; kwargs device, mode, batch_size)."""
        if cfg.path is None:
            raise ConfigError(
                "plugin 'clip_score' needs a local CLIP model directory",
                key=f"{key}.path",
                expected="a directory holding a CLIPModel and its CLIPProcessor",
            )
        kwargs: dict[str, Any] = {  # user values: the constructor checks them
            k: cfg.kwargs[k] for k in ("device", "mode", "batch_size") if k in cfg.kwargs
        }
        try:
            return cls(cfg.path, **kwargs)
        except FileNotFoundError as err:
            raise ConfigError(str(err), key=f"{key}.path") from err
        except (TypeError, ValueError) as err:
            raise ConfigError(str(err), key=f"{key}.kwargs") from err

    @torch.no_grad()
    def similarity(self, texts: Sequence[str], images: Sequence[np.ndarray]) -> torch.Tensor:
        """cos(e_t, e_i) [n] of aligned texts and images (float [H, W, 3] in [0, 1])."""
        out = []
        for s in range(0, len(texts), self.batch_size):
            inputs = self.processor(
                text=list(texts[s : s + self.batch_size]),
                images=list(images[s : s + self.batch_size]),
                return_tensors="pt",
                padding=True,
                truncation=True,
                do_rescale=False,
            ).to(self.device)
            text = self.model.get_text_features(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
            ).pooler_output
            image = self.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
            cos = torch.nn.functional.cosine_similarity(text.float(), image.float(), dim=-1)
            out.append(cos.cpu())
        return torch.cat(out) if out else torch.zeros(0)

    @torch.no_grad()
    def image_features(self, images: Sequence[np.ndarray]) -> torch.Tensor:
        """CLIP's projected image embeddings e_i, float32 [n, projection_dim]."""
        out = []
        for s in range(0, len(images), self.batch_size):
            inputs = self.processor(
                images=list(images[s : s + self.batch_size]), return_tensors="pt", do_rescale=False
            ).to(self.device)
            image = self.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
            out.append(image.float().cpu())
        return torch.cat(out)

    def features(self, samples: Sequence[Sample], responses: Sequence[Response]) -> torch.Tensor:
        """CLIP's image embeddings of each row's image, float32 [n, projection_dim]; NaN
        rows where `one_image` is None."""
        images = [one_image(r) for r in responses]
        out = torch.full((len(samples), self.model.config.projection_dim), float("nan"))
        valid = [i for i, img in enumerate(images) if img is not None]
        if valid:
            out[valid] = self.image_features([img for img in images if img is not None])
        return out

    def score(self, samples: Sequence[Sample], responses: Sequence[Response]) -> torch.Tensor:
        images = [one_image(r) for r in responses]
        out = torch.zeros(len(samples), dtype=torch.float32)
        valid = [i for i, img in enumerate(images) if img is not None]
        if valid:
            cos = self.similarity(
                [prompt_text(samples[i]) for i in valid], [img for img in images if img is not None]
            )
            if self.mode == "pickscore":
                value = self.model.logit_scale.exp().float().cpu() * cos
            else:
                value = CLIPSCORE_WEIGHT * cos.clamp(min=0.0)
            out[valid] = value.detach()
        return out

    def invalid_format(
        self, samples: Sequence[Sample], responses: Sequence[Response]
    ) -> list[bool]:
        return [one_image(r) is None for r in responses]
