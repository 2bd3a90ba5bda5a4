"""A custom colour-square dataset and an `uniweave eval` config for it, shared by the eval and
own-data tests (not collected: no test_ prefix)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (20, 40, 230)}


def make_dataset(root: Path, n: int) -> Path:
    """n colour-square questions (words outside the digits vocabulary), split train/test."""
    (root / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        name = list(COLOURS)[i % 3]
        pixels = np.zeros((8, 8, 3), dtype=np.uint8)
        pixels[1 + i % 3 : 7, 2:7] = COLOURS[name]
        Image.fromarray(pixels).save(root / "img" / f"{i}.png")
        rows.append(
            {
                "id": f"sq{i}",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "path": f"img/{i}.png"},
                            {"type": "text", "text": "Which colour is the square?"},
                        ],
                    },
                    {"role": "assistant", "content": name},
                ],
                "answer": name,
                "task": "colour_qa",
                "split": "test" if i % 2 else "train",
            }
        )
    path = root / "colours.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_config(tmp_path: Path, data: Path, extra: str = "") -> Path:
    """`tmp_path/eval.yaml`: a one-layer tiny model on the colour dataset `data`, exact-text
    reward, run directory `tmp_path/run`; `extra` YAML appended."""
    path = tmp_path / "eval.yaml"
    path.write_text(
        f"run: {{output_dir: {tmp_path / 'run'}, device: cpu}}\n"
        f"model: {{tiny: {{hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}}}\n"
        f"data: {{path: {data}, tasks: [colour_qa], image_resize: error}}\n"
        "rollout: {max_new_tokens: 12, batch_size: 4}\n"
        "reward: {plugins: [{name: text_exact, tasks: [colour_qa]}]}\n" + extra
    )
    return path
