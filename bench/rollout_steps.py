"""Decode steps, row-steps and attended key columns: static engine vs continuous batching.

Counts (not timings, so they do not depend on the machine's load) on `bench/rollout.py`'s
model and pinned varied-length mix (256 requests, log-normal targets, median cap / 4):
the static engine in chunks of S requests and `RolloutEngine(slots=S)` over all of them.
Per decode step it records the rows fed (free slots included) and the key columns each
row attends (the static batch's mask width; the slot window n + 1 - lo). A GPU decoding a
small model pays per decode step; a CPU pays per row-step times key columns.

    .venv/bin/python bench/rollout_steps.py [--requests 256] [--slots 32 64]
        [--max-new-tokens 96]

Last line: `result: steps_ratio_32=R keys_ratio_32=K ...` with R = static / continuous
decode steps and K = continuous / static key columns per row-step.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from uniweave.rollout import RolloutEngine
from uniweave.rollout.continuous import SlotBatch
from uniweave.rollout.decode_batch import DecodeBatch

_spec = importlib.util.spec_from_file_location(
    "rollout_bench", Path(__file__).with_name("rollout.py")
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


class Counter:
    """Wraps the two batch classes' `step` to count rows and attended key columns."""

    def __init__(self) -> None:
        self.steps = self.rows = self.keys = 0
        slot_step, static_step = SlotBatch.step, DecodeBatch.step
        counter = self

        def counted_slot(batch, inputs):
            counter.add(batch.S, batch.n + 1 - batch.lo)
            return slot_step(batch, inputs)

        def counted_static(batch, model, inputs):
            counter.add(batch.mask.shape[0], batch.mask.shape[1] + 1)
            return static_step(batch, model, inputs)

        SlotBatch.step, DecodeBatch.step = counted_slot, counted_static

    def add(self, rows: int, keys: int) -> None:
        self.steps += 1
        self.rows += rows
        self.keys += rows * keys

    def take(self) -> tuple[int, int, float]:
        out = (self.steps, self.rows, self.keys / max(self.rows, 1))
        self.steps = self.rows = self.keys = 0
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--slots", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, _ = bench.build()
    trajs = bench.prompts(model.tokenizer, args.requests)
    targets = bench.target_lengths(args.requests, args.max_new_tokens)
    print(f"varied mix, {args.requests} requests: {bench.describe(targets)}")
    counter = Counter()
    results = {}
    for S in args.slots:
        static = bench.run_engine(RolloutEngine(model), trajs, targets, S)
        s_steps, s_rows, s_keys = counter.take()
        cont = bench.run_engine(RolloutEngine(model, slots=S), trajs, targets, args.requests)
        c_steps, c_rows, c_keys = counter.take()
        if static != cont:
            raise SystemExit(f"static and continuous tokens differ at {S} slots")
        print(
            f"{S} slots: decode steps static {s_steps} / continuous {c_steps}; row-steps "
            f"{s_rows} / {c_rows}; key columns per row-step {s_keys:.1f} / {c_keys:.1f}; "
            "identical tokens: True"
        )
        results[f"steps_ratio_{S}"] = s_steps / c_steps
        results[f"keys_ratio_{S}"] = c_keys / s_keys
    print("result: " + " ".join(f"{k}={v:.2f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
