"""`uniweave generate`: draw answers and images for one prompt and save them for a person.

The model is `model.path` (e.g. a run's `model/` directory) or, with `--random-init`, a
freshly initialised one. Each of the `n` samples uses the stateless seed
`seed_for(run.seed, 0, 0, member)`. The prompt is the user's text, after the image at
`image` when one is given (an image-to-text question: read as a dataset row's image is,
through the model's processor at its codec's image size). With `draw` (`--draw`, or a
prompt starting "draw" without `--no-draw`) the request forces text-to-image on the
codec's grid; otherwise the model answers in text and may draw on its own (`generate
image H W` header).

Scoring (`task`, `answer`): the samples are scored as `uniweave eval` scores a row of task
`task` whose answer is `answer` (`uniweave.rewards.evaluation_reward`: the `reward:` plugins,
else the task's default verifier; the digits classifier of t2i from
<run.output_dir>/classifier, fitted there on first use).

Output in `out_dir`: `generations.png` (every drawn image, upscaled with nearest-neighbour
so the 8x8 digits are visible), `sample-<m>-<k>.png` (image k of sample m, upscaled the
same way) and `generations.json` (each sample's text, finish reason, image files and,
when scored, its score).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from uniweave.config import ConfigError, UniweaveConfig
from uniweave.config.errors import COMMAND_LINE
from uniweave.config.resolved import run_dir
from uniweave.core.atomic import atomic_write, write_json_atomic
from uniweave.core.sample import ImagePart, Part, Sample, TextPart
from uniweave.core.seeding import seed_for
from uniweave.data.images import processor_for, read_rgb
from uniweave.models.build import build_model, resolve_device
from uniweave.rewards.plugins import build_responses
from uniweave.rollout import RolloutEngine, RolloutRequest
from uniweave.rollout.config import sampling_params

SCALE = 16


def image_grid_png(images: list[np.ndarray], path: Path, scale: int = SCALE, cols: int = 8) -> Path:
    """Tile images in [0, 1] into one PNG. Greyscale [H, W] (the tiny model's digits, bright
    strokes on black) are drawn dark on white and upscaled `scale`x (nearest); colour
    [H, W, 3] (Janus-Pro, UniAR) keep their colours, upscaled only when smaller than 64
    pixels. ValueError for a mix of the two or another shape (never a dropped channel)."""
    if not images:
        raise ValueError("no images to write")
    colour = images[0].ndim == 3
    for img in images:
        if img.shape != images[0].shape or (img.ndim == 3 and img.shape[-1] != 3):
            raise ValueError(f"images of shapes {images[0].shape} and {img.shape}: one grid "
                             "takes one shape, [H, W] or [H, W, 3]")  # fmt: skip
    h, w = images[0].shape[:2]
    if colour and max(h, w) >= 64:
        scale = 1
    rows = (len(images) + cols - 1) // cols
    ncols = min(cols, len(images))
    pad = max(2, scale // 2)
    shape = (rows * (h * scale + pad) + pad, ncols * (w * scale + pad) + pad)
    canvas = np.ones(shape + ((3,) if colour else ()))
    for k, img in enumerate(images):
        r, c = divmod(k, cols)
        clipped = np.clip(img, 0.0, 1.0)
        if colour:
            big = np.kron(clipped, np.ones((scale, scale, 1)))
        else:
            big = 1.0 - np.kron(clipped, np.ones((scale, scale)))
        y, x = pad + r * (h * scale + pad), pad + c * (w * scale + pad)
        canvas[y : y + h * scale, x : x + w * scale] = big
    mode = "RGB" if colour else "L"
    with atomic_write(path, "wb") as f:
        Image.fromarray((canvas * 255).round().astype(np.uint8), mode=mode).save(f, format="PNG")
    return path


def read_prompt_image(
    cfg: UniweaveConfig, path: str, image_size: tuple[int, int], channels: int = 1
) -> ImagePart:
    """The image at `path` (`--image`) as the model reads a dataset row's image; a
    ConfigError naming `--image` when it is missing, unreadable or of the wrong size."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{path}: image file not found", key="--image", source=COMMAND_LINE)
    try:
        rgb = read_rgb(file)
        processor = processor_for(cfg.model.kind, image_size, cfg.data.image_resize, channels)
        pixels = processor(rgb, path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: {err}", key="--image", source=COMMAND_LINE) from None
    return ImagePart(pixels=pixels)


def scorer(cfg: UniweaveConfig, task: str):
    """The reward service `uniweave eval` would score rows of `task` with (module docstring)."""
    from uniweave.eval.runner import eval_rewards

    data = cfg.data.model_copy(update={"tasks": [task]})
    return lambda model: eval_rewards(
        cfg.model_copy(update={"data": data}),
        model,
        run_dir(cfg) / "classifier",
    )


def generate(
    cfg: UniweaveConfig,
    prompt: str,
    n: int,
    out_dir: Path,
    draw: bool,
    image: str | None = None,
    task: str | None = None,
    answer: str | None = None,
) -> dict:
    """Sample `n` responses to `prompt` (after the image at `image`, if any); score them
    as task `task` with answer `answer` when `task` is given; write the PNGs and JSON;
    return the summary (module docstring)."""
    model = build_model(cfg).to(resolve_device(cfg.run.device)).eval()
    rewards = scorer(cfg, task)(model) if task is not None else None  # may fit a classifier
    with torch.no_grad():
        return _generate(cfg, model, prompt, n, out_dir, draw, image, task, answer, rewards)


def _generate(cfg, model, prompt, n, out_dir, draw, image, task, answer, rewards) -> dict:
    parts: list[Part] = []
    if image is not None:
        channels = int(getattr(model.codec, "channels", 1))
        parts.append(read_prompt_image(cfg, image, tuple(model.codec.image_size), channels))
    parts.append(TextPart(prompt))
    sample = Sample(id="prompt", parts=parts, answer=answer, task=task)
    grid = tuple(model.codec.grid) if draw else None
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
    parsed = [model.parse_response(t) for t in trajs]  # the model's own template
    responses, _ = build_responses(parsed, model.codec.decode)
    scores = None
    if rewards is not None:
        forked = [sample.fork(m) for m in range(n)]
        scores = rewards.score(forked, trajs, parsed, alarm=False).total.tolist()
    out_dir.mkdir(parents=True, exist_ok=True)
    images, records = [], []
    for m, (traj, response) in enumerate(zip(trajs, responses)):
        files = []
        for k, img in enumerate(i for i in response.images if i is not None):
            pixels = img.float().cpu().numpy()
            images.append(pixels)
            files.append(str(image_grid_png([pixels], out_dir / f"sample-{m}-{k}.png", cols=1)))
        record: dict[str, Any] = {
            "id": traj.sample_id,
            "text": response.text,
            "images": files,
            "finish_reason": traj.finish_reason,
        }
        if scores is not None:
            record["score"] = float(scores[m])
        records.append(record)
    summary = {
        "prompt": prompt,
        "image": image,
        "task": task,
        "answer": answer,
        "samples": records,
        "png": None,
    }
    if images:
        summary["png"] = str(image_grid_png(images, out_dir / "generations.png"))
    write_json_atomic(out_dir / "generations.json", summary, indent=2)
    return summary
