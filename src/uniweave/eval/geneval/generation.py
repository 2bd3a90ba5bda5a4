"""Draw GenEval's images with the model under evaluation (`uniweave eval --geneval`).

`generate_folder(cfg, model, rows, out, images_per_prompt, metadata)` writes GenEval's
folder layout for the metadata rows `rows` (read from the file `metadata`):

    <out>/generation.json              what drew the images (below)
    <out>/<index:05d>/metadata.jsonl   the prompt's row, as read from the metadata file
    <out>/<index:05d>/samples/NNNN.png image NNNN of the prompt, 0000 .. N-1

Image m of prompt i (i counts the metadata file's rows from 0) is one text-to-image
rollout of the row's prompt (the text alone, as `uniweave generate --draw` does) forced
onto the codec's grid with an exact count of H*W positions, sampled with the `rollout:`
parameters (temperature, top_k, top_p, guidance = the CFG scale, guidance_logprob,
bit_temperature; never greedy: GenEval's N images of a prompt are N draws) and the
stateless seed `seed_for(run.seed, 0, i, m)`. A row's tokens do not depend on the batch
it was decoded in (per-row seeds), so an image is the same whether it was drawn in one
run or after a resume. It is saved at the codec's image size as an 8-bit RGB PNG (a
greyscale codec's image repeated over the three channels), written atomically.

`generation.json` pins all of that: the metadata file, its SHA-256 and row count,
`images_per_prompt`, the model (kind, path, `weights_sha256` of the weights), the grid and
image size, the sampling parameters, `run.seed`, the seed rule and every image's seed,
the device and the uniweave version. Resume by image: on a folder that holds a
`generation.json`, an image whose PNG exists is kept and only the absent ones are drawn,
so a rerun on a complete folder generates nothing. The folder is reused only when its
`generation.json` equals this run's apart from the metadata file's path and the version
(another model, weights, sampling parameter, seed or metadata content is refused naming
the first field that differs), and a non-empty folder without one is refused: its images
were not drawn under settings this run can check.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from uniweave import __version__
from uniweave.config import COMMAND_LINE, ConfigError, UniweaveConfig
from uniweave.core.atomic import atomic_write, write_json_atomic
from uniweave.core.sample import Sample, TextPart
from uniweave.core.seeding import seed_for
from uniweave.eval.runner import weights_sha256
from uniweave.models.base import UnifiedModel
from uniweave.rewards.geneval.detectors import to_pil
from uniweave.rewards.geneval.metadata import MetadataRow
from uniweave.rewards.plugins import build_responses
from uniweave.rollout import RolloutEngine, RolloutRequest
from uniweave.rollout.config import sampling_params
from uniweave.rollout.params import SamplingParams

GENERATION = "generation.json"
SEED_RULE = "seed_for(run.seed, 0, prompt index, image number)"
_UNCOMPARED = ("metadata", "uniweave")
"""generation.json fields a rerun may change: the metadata file's path (its content is
pinned by metadata_sha256) and the version of uniweave."""


@dataclass(frozen=True)
class Generated:
    """What `generate_folder` did: images drawn now and images found already drawn."""

    drawn: int
    kept: int
    record: dict[str, Any]


def prompt_dir(out: Path, index: int) -> Path:
    return out / f"{index:05d}"


def sample_path(out: Path, index: int, number: int) -> Path:
    return prompt_dir(out, index) / "samples" / f"{number:04d}.png"


def image_params(cfg: UniweaveConfig, grid: tuple[int, int]) -> SamplingParams:
    """The sampling parameters of every image (module docstring)."""
    return sampling_params(
        cfg.rollout, max_new_tokens=grid[0] * grid[1], length_semantics="exact", greedy=False
    )


def generation_record(
    cfg: UniweaveConfig,
    model: UnifiedModel,
    rows: Sequence[MetadataRow],
    metadata: Path,
    images_per_prompt: int,
    digest: str,
) -> dict[str, Any]:
    """The content of generation.json for this run (module docstring)."""
    grid = tuple(model.codec.grid)
    params = image_params(cfg, grid)
    return {
        "uniweave": __version__,
        "metadata": str(metadata),
        "metadata_sha256": hashlib.sha256(metadata.read_bytes()).hexdigest(),
        "prompts": len(rows),
        "images_per_prompt": images_per_prompt,
        "model": {"kind": cfg.model.kind, "path": cfg.model.path, "weights_sha256": digest},
        "grid": list(grid),
        "image_size": list(model.codec.image_size),
        "sampling": {
            "greedy": params.greedy,
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "guidance": params.guidance,
            "guidance_logprob": params.guidance_logprob,
            "bit_temperature": params.bit_temperature,
            "max_new_tokens": params.max_new_tokens,
            "length_semantics": params.length_semantics,
        },
        "device": cfg.run.device,
        "run_seed": cfg.run.seed,
        "seed_rule": SEED_RULE,
        "seeds": [
            [seed_for(cfg.run.seed, 0, i, m) for m in range(images_per_prompt)]
            for i in range(len(rows))
        ],
    }


def _first_difference(held: Any, new: Any, where: str = "") -> str | None:
    if isinstance(held, dict) and isinstance(new, dict):
        for key in sorted(set(held) | set(new)):
            if not where and key in _UNCOMPARED:
                continue
            found = _first_difference(held.get(key), new.get(key), f"{where}.{key}".lstrip("."))
            if found:
                return found
        return None
    if held != new:
        shown = lambda v: json.dumps(v)[:60]  # noqa: E731
        return f"{where or 'generation'}: held {shown(held)}, this run {shown(new)}"
    return None


def check_out(out: Path) -> dict[str, Any] | None:
    """The generation.json `out` holds (None for a new or empty folder); refuses a
    non-empty folder without one (module docstring). Reads no model."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory", key="--out", source=COMMAND_LINE)
    path = out / GENERATION
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"{path}: cannot read ({err}); choose a new --out", key="--out", source=COMMAND_LINE
            ) from None
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(
            f"{out} is not empty and holds no {GENERATION}: its images were not drawn by "
            "'uniweave eval --geneval'; choose a new --out (or score it with 'uniweave score')",
            key="--out",
            source=COMMAND_LINE,
        )
    return None


def generate_folder(
    cfg: UniweaveConfig,
    model: UnifiedModel,
    rows: Sequence[MetadataRow],
    out: str | Path,
    images_per_prompt: int,
    metadata: str | Path,
) -> Generated:
    """Draw every absent image of the layout in `out` (module docstring)."""
    out, metadata = Path(out), Path(metadata)
    held = check_out(out)
    record = generation_record(cfg, model, rows, metadata, images_per_prompt, weights_sha256(model))
    if held is not None:
        differs = _first_difference(held, record)
        if differs:
            raise ConfigError(
                f"{out} holds images drawn with other settings ({differs}); choose a new --out",
                key="--out",
                source=COMMAND_LINE,
            )
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / GENERATION, record, indent=2)
    todo: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        folder = prompt_dir(out, i)
        (folder / "samples").mkdir(parents=True, exist_ok=True)
        meta = folder / "metadata.jsonl"
        if not meta.is_file():
            with atomic_write(meta, "w") as f:
                f.write(row.dumps() + "\n")
        todo += [(i, m) for m in range(images_per_prompt) if not sample_path(out, i, m).is_file()]
    grid = tuple(model.codec.grid)
    params = image_params(cfg, grid)
    engine = RolloutEngine(model, model.tokenizer)
    step = cfg.rollout.batch_size
    with torch.no_grad():
        for start in range(0, len(todo), step):
            chunk = todo[start : start + step]
            requests = [
                RolloutRequest(
                    Sample(id=f"{i:05d}", parts=[TextPart(rows[i].prompt)]).fork(m),
                    record["seeds"][i][m],
                    params,
                    image_grid=grid,
                )
                for i, m in chunk
            ]
            trajs = engine.generate(requests)
            parsed = [model.parse_response(t) for t in trajs]
            responses, _ = build_responses(parsed, model.codec.decode)
            for (i, m), response in zip(chunk, responses):
                images = [img for img in response.images if img is not None]
                if len(images) != 1:
                    raise RuntimeError(
                        f"prompt {i} ({rows[i].source}) image {m}: the rollout decoded to "
                        f"{len(images)} images, expected 1"
                    )
                with atomic_write(sample_path(out, i, m), "wb") as f:
                    to_pil(images[0]).save(f, format="PNG")
    total = len(rows) * images_per_prompt
    return Generated(len(todo), total - len(todo), record)
