"""Rollout wall time over 2 ranks: `rollout.assignment` dynamic vs static, same process.

Two gloo processes on CPU (one thread each) hold the same tiny model (rank 0's weights
broadcast) and sample the same requests with `RolloutService.generate_assigned` +
`gather_assigned`, once per assignment, alternating, `--repeats` times; the time of one
round is rank 0's wall time from a barrier to the end of the gather (a collective, so it
waits for the slower rank). Both assignments use engine batches of one row
(`rollout.batch_size: 1`, a claim = one row), so the only difference is who samples what.

Straggler-heavy length mix: `--rows` text rows, one in `--every` of them with a budget
of `--long` new tokens, the rest `--short` (EOS and the cycle detector off, so a row runs
to its budget). Two placements of the long rows:
- `aligned`: at indices 0, every, 2·every, ...: round-robin gives every long row to
  rank 0 (the worst case for static; it happens when lengths follow the index parity).
- `shuffled`: at seeded random indices (what a batch of mixed tasks looks like).
The gathered trajectories are checked equal between the assignments (token ids).
Also printed: the busiest rank's CPU time (`process_time` of its sampling, max over
ranks), the critical path on a machine with a free core per rank; on an oversubscribed
machine the wall time cannot show the balance (both ranks share the same cores). The
last line is the shuffled mix's median dynamic / static wall-time ratio.

    .venv/bin/python bench/queues.py [--rows 16] [--every 4] [--long 96] [--short 8]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from uniweave.codecs import build_codec
from uniweave.data.digits import make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.data.template import serialize
from uniweave.data.tokenizer import SpecialIds, build_tokenizer
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.rollout import RolloutRequest, RolloutService, SamplingParams


def build_model() -> TinyUnifiedModel:
    tokenizer = build_tokenizer()
    codec = build_codec("vq", codebook_size=32, n_init=1, max_iter=5)
    codec.fit(load_split("train").images[:200])
    torch.manual_seed(0)
    model = TinyUnifiedModel(TinyArchitecture(hidden_size=192), tokenizer, codec).eval()
    for value in model.state_dict().values():  # every rank: rank 0's weights
        dist.broadcast(value, 0)
    eos = SpecialIds.from_tokenizer(tokenizer).eos
    with torch.no_grad():  # EOS never wins: a row runs to its budget
        model.text_head.weight[eos] = 0.0
        if getattr(model.text_head, "bias", None) is not None:
            model.text_head.bias[eos] = -1e4
    return model


def requests(model, budgets: list[int]) -> list[RolloutRequest]:
    samples = make_task_samples("t2i", "val", len(budgets), seed=0)
    out = []
    for k, (s, n) in enumerate(zip(samples, budgets)):
        prompt = serialize(s, model.tokenizer, add_generation_prompt=True)
        params = SamplingParams(
            max_new_tokens=n, cycle_max_period=0, on_invalid_header="text", length_semantics="cap"
        )
        out.append(RolloutRequest(prompt, seed=1000 + k, params=params))
    return out


def budgets(args, placement: str) -> list[int]:
    n_long = args.rows // args.every
    if placement == "aligned":
        long_rows = set(range(0, args.rows, args.every))
    else:
        long_rows = set(random.Random(0).sample(range(args.rows), n_long))
    return [args.long if i in long_rows else args.short for i in range(args.rows)]


def worker(rank: int, world: int, port: int, args, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        model = build_model()
        services = {
            a: RolloutService(model, 1, rank, world, assignment=a, queue_name=f"bench-{a}")
            for a in ("static", "dynamic")
        }
        results = {}
        for placement in ("aligned", "shuffled"):
            reqs = requests(model, budgets(args, placement))
            times: dict[str, list[float]] = {a: [] for a in services}
            busy: dict[str, list[float]] = {a: [] for a in services}
            tokens = {}
            for _ in range(args.repeats):
                for a, service in services.items():
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    indices, local = service.generate_assigned(reqs)
                    cpu = time.process_time() - c0
                    trajs = service.gather_assigned(indices, local, len(reqs))
                    times[a].append(time.perf_counter() - t0)
                    per_rank: list = [None] * world
                    dist.all_gather_object(per_rank, cpu)
                    busy[a].append(max(per_rank))
                    tokens[a] = [t.token_ids.tolist() for t in trajs]
            assert tokens["static"] == tokens["dynamic"], placement
            new = [len(t) - len(r.prompt) for t, r in zip(tokens["static"], reqs)]
            results[placement] = (times, busy, new)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--long", type=int, default=96)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/times.pt"
        mp.start_processes(
            worker, args=(2, port, args, out), nprocs=2, join=True, start_method="spawn"
        )
        results = torch.load(out)
    print(
        f"2 gloo ranks, CPU, 1 thread each; {args.rows} rows, 1 in {args.every} with "
        f"{args.long} new tokens, the rest {args.short}; engine batches of 1 row; "
        f"median of {args.repeats}"
    )
    ratio = 0.0
    for placement, (times, busy, new) in results.items():
        med = {a: statistics.median(v) for a, v in times.items()}
        crit = {a: statistics.median(v) for a, v in busy.items()}
        ratio = med["dynamic"] / med["static"]
        print(
            f"{placement:9s} wall: static {med['static']:.3f}s dynamic {med['dynamic']:.3f}s "
            f"ratio {ratio:.3f} | busiest rank's CPU time: static {crit['static']:.3f}s "
            f"dynamic {crit['dynamic']:.3f}s ratio {crit['dynamic'] / crit['static']:.3f}"
        )
        print(f"{'':9s} new tokens per row: {new}")
    print(f"result: dynamic_vs_static={ratio:.3f}")


if __name__ == "__main__":
    main()
