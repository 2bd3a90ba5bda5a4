"""`unirl generate`: draw answers and images for one prompt and save them for a person.

The model is `model.path` (e.g. a run's `model/` directory) or, without one, a freshly
initialised tiny model. Each of the `n` samples uses the stateless seed
`seed_for(run.seed, 0, 0, member)`. With `--image` (or a prompt starting "draw") the
request forces text-to-image on the codec's grid; otherwise the model answers in text and
may draw on its own (`generate image H W` header). Output: `generations.png` (every drawn
image, upscaled with nearest-neighbour so the 8x8 digits are visible) and
`generations.json` (the text of each sample and its finish reason).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from unirl.config import UnirlConfig
from unirl.core.atomic import atomic_write, write_json_atomic
from unirl.core.sample import ImagePart, Sample, TextPart
from unirl.core.seeding import seed_for
from unirl.rewards.plugins import build_responses, parse_response
from unirl.rollout import RolloutEngine, RolloutRequest
from unirl.rollout.config import sampling_params
from unirl.train.engine.build import build_model, resolve_device

SCALE = 16


def image_grid_png(images: list[np.ndarray], path: Path, scale: int = SCALE, cols: int = 8) -> Path:
    """Tile grayscale images in [0, 1] into one PNG, each upscaled `scale`x (nearest)."""
    if not images:
        raise ValueError("no images to write")
    h, w = images[0].shape[:2]
    rows = (len(images) + cols - 1) // cols
    ncols = min(cols, len(images))
    pad = max(2, scale // 2)
    canvas = np.ones((rows * (h * scale + pad) + pad, ncols * (w * scale + pad) + pad))
    for k, img in enumerate(images):
        r, c = divmod(k, cols)
        big = np.kron(np.clip(img, 0.0, 1.0), np.ones((scale, scale)))
        y, x = pad + r * (h * scale + pad), pad + c * (w * scale + pad)
        canvas[y : y + h * scale, x : x + w * scale] = 1.0 - big
    with atomic_write(path, "wb") as f:
        Image.fromarray((canvas * 255).round().astype(np.uint8), mode="L").save(f, format="PNG")
    return path


@torch.no_grad()
def generate(cfg: UnirlConfig, prompt: str, n: int, out_dir: Path, image: bool) -> dict:
    """Sample `n` responses to `prompt`; write the PNG grid and JSON; return the summary."""
    model = build_model(cfg).to(resolve_device(cfg.run.device)).eval()
    sample = Sample(id="prompt", parts=[TextPart(prompt)])
    grid = tuple(model.codec.grid) if image else None
    if grid is None:
        params = sampling_params(cfg.rollout, length_semantics="cap")
    else:
        params = sampling_params(
            cfg.rollout, max_new_tokens=grid[0] * grid[1], length_semantics="exact"
        )
    requests = [
        RolloutRequest(sample.fork(m), seed_for(cfg.run.seed, 0, 0, m), params, image_grid=grid)
        for m in range(n)
    ]
    trajs = RolloutEngine(model, model.tokenizer).generate(requests)
    parsed = [parse_response(t, model.tokenizer) for t in trajs]
    responses, _ = build_responses(parsed, model.codec.decode)
    images, records = [], []
    for traj, parts, response in zip(trajs, parsed, responses):
        n_img = sum(isinstance(p, ImagePart) for p in parts or [])
        images.extend(img.numpy() for img in response.images if img is not None)
        records.append(
            {
                "id": traj.sample_id,
                "text": response.text,
                "images": n_img,
                "finish_reason": traj.finish_reason,
            }
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"prompt": prompt, "samples": records, "png": None}
    if images:
        summary["png"] = str(image_grid_png(images, out_dir / "generations.png"))
    write_json_atomic(out_dir / "generations.json", summary, indent=2)
    return summary
