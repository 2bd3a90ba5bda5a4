"""IG's full view under BitFlip `partition: half`: `student_full_view` fused against
sequential (`algorithm.information_gain`, docs/numerics.md §3).

On one micro-batch of digits rows (draw_then_answer and t2i, half of them noised) with a
tiny BSQ body, the median time of `SFTObjective.loss` + backward for each mode, their
steps alternating in one process on one model (the first 2 steps of each left out).
Fused reads the clean IG rows' full scores from the SFT forward; sequential runs one more
backbone forward of those rows.

    .venv/bin/python bench/ig_full_view.py [--width 192] [--layers 4] [--rows 8]
        [--steps 12] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from uniweave.codecs import build_codec
from uniweave.config.algorithms import SFTConfig
from uniweave.core.seeding import seed_for
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.digits import make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.data.template import serialize
from uniweave.data.tokenizer import build_tokenizer
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.methods.sft.objective import SFTObjective


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="rows per task (2 tasks)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = build_tokenizer()
    codec = build_codec("bsq", latent_dim=4, entropy_group=4, hidden=16, epochs=1)
    codec.fit(load_split("train").images[:200])
    arch = TinyArchitecture(
        visual_head="bsq",
        hidden_size=args.width,
        num_layers=args.layers,
        num_heads=4,
        intermediate_size=4 * args.width,
        max_position_embeddings=512,
    )
    model = TinyUnifiedModel(arch, tok, codec).train()
    rows = [
        serialize(s, tok, encode_image=codec.encode, bits=model.n_visual_outputs)
        for task in ("draw_then_answer", "t2i")
        for s in make_task_samples(task, "train", args.rows, seed=1)
    ]
    rows = [dataclasses.replace(r, seed=seed_for(0, 3, k, 0)) for k, r in enumerate(rows)]
    batch = TrajectoryBatch.collate(rows, model.special_ids.pad)
    objectives = {}
    for view in ("fused", "sequential"):
        cfg = SFTConfig(
            bitflip={"probability": 0.2, "partition": "half"},
            information_gain={"weight": 1.0, "student_full_view": view},
        )
        objectives[view] = SFTObjective(cfg)
        objectives[view].begin_update(3, [batch], DistInfo())
    n = objectives["fused"].count(batch)
    times: dict[str, list[float]] = {view: [] for view in objectives}
    for step in range(args.steps):
        for view, objective in objectives.items():
            model.zero_grad()
            start = time.perf_counter()
            loss, _ = objective.loss(model, batch, n)
            loss.backward()
            if step >= 2:
                times[view].append(time.perf_counter() - start)
    med = {view: statistics.median(t) for view, t in times.items()}
    print(
        f"width {args.width}, layers {args.layers}, {len(rows)} rows, {args.threads} thread(s): "
        f"fused {med['fused'] * 1e3:.1f} ms, sequential {med['sequential'] * 1e3:.1f} ms "
        f"(sequential / fused {med['sequential'] / med['fused']:.2f}x)"
    )


if __name__ == "__main__":
    main()
