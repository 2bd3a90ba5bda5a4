"""SFT step throughput of the tiny model against this machine's measured GEMM peak,
with sequence packing off and on (`trainer.packing`, `uniweave.train.engine.batching`).

Prints, for the same mixed digits batch (one micro-batch) collated plainly (right-padded
to the longest row) and packed (first-fit into rows as long as the longest, block-causal
attention), alternating in one process: the padded-token fraction, step time (forward +
backward + AdamW), tokens/s and the model-FLOPs utilisation: useful model FLOP/s divided
by the FLOP/s of a large fp32 matrix multiply measured in the same process (the
baseline). Useful FLOPs per step (padding excluded, the same for both layouts):
6 · N_matmul · tokens (weights, forward + backward) + 12 · layers · d · Σ_rows T_row²
(attention scores and values, forward + backward) + 6 · n_mixers · k · d · tokens (the
depthwise causal conv prior, `model.tiny.mixer_kernel` = k), with N_matmul the parameters
of the decoder's linear layers plus the heads at the scored positions.

    .venv/bin/python bench/sft_step.py [--width 192] [--layers 4] [--steps 20] [--batch 32]
        [--threads 2] [--mixer-kernel 4] [--deterministic on|off]

The defaults are the default tiny body; `--width 512 --layers 8` is a larger one.
`--deterministic` is `run.deterministic` (default on, as in `uniweave train`): compare the
two to see what deterministic kernels cost on this machine.

`--ig` instead compares Information Gain against vanilla SFT on the same batch, both
through `SFTObjective` (`algorithm.information_gain`: weight 1, `--ig-selection`,
`--ig-chunk` blind views per forward): the median step time of each, their steps
alternating in one process on two copies of one model, and the peak memory of a step,
each mode in its own fresh process (peak RSS during 3 steps minus the RSS after setup,
Linux VmHWM reset after setup; both processes build the same model and batch).
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from uniweave.codecs import build_codec
from uniweave.config.algorithms import SFTConfig
from uniweave.core.determinism import set_determinism
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.data.digits import TASKS, make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.data.template import serialize
from uniweave.data.tokenizer import SpecialIds, build_tokenizer
from uniweave.forward import forward_interleaved
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.batching import pack, padded_fraction
from uniweave.train.methods.sft.objective import SFTObjective


def body_config(args: argparse.Namespace) -> TinyArchitecture:
    """The tiny body of `--width` / `--layers` (heads of width 48 where that divides the
    width, else 64; MLP 8/3 x width)."""
    return TinyArchitecture(
        hidden_size=args.width,
        num_layers=args.layers,
        num_heads=args.width // 48 if args.width % 48 == 0 else max(1, args.width // 64),
        intermediate_size=args.width * 8 // 3,
        mixer_kernel=args.mixer_kernel,
    )


def gemm_peak(n: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of an fp32 n x n matrix multiply (best of `repeats`)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def model_flops(model: TinyUnifiedModel, lengths: list[int], n_scored: int) -> float:
    """Useful FLOPs of one step (module docstring): padding excluded."""
    cfg = model.config
    linear = sum(
        m.weight.numel()
        for name, m in model.decoder.named_modules()
        if isinstance(m, torch.nn.Linear)
    )
    tokens = sum(lengths)
    head = model.text_head.weight.numel()
    attention = 12 * cfg.num_layers * cfg.hidden_size * float(sum(n * n for n in lengths))
    mixers = 6.0 * 2 * cfg.num_layers * cfg.mixer_kernel * cfg.hidden_size * tokens
    return 6.0 * linear * tokens + 6.0 * head * n_scored + attention + mixers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mixer-kernel", type=int, default=4)
    parser.add_argument("--deterministic", choices=("on", "off"), default="on")
    parser.add_argument("--ig", action="store_true", help="IG vs vanilla SFT (see docstring)")
    parser.add_argument("--ig-selection", choices=("cycle", "all"), default="cycle")
    parser.add_argument("--ig-chunk", type=int, default=8)
    args = parser.parse_args()
    if args.ig:
        compare_ig(args)
        return
    model, trajs, pad = _setup(args, args.batch // len(TASKS))
    config = model.config
    batches = {"off": TrajectoryBatch.collate(trajs, pad), "on": pack(trajs, pad)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch: TrajectoryBatch) -> int:
        out = forward_interleaved(model, batch)
        loss = torch.nn.functional.cross_entropy(out.text_logits, out.text_targets, reduction="sum")
        loss = loss + torch.nn.functional.cross_entropy(
            out.visual_logits, out.visual_targets, reduction="sum"
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        return len(out.text_targets) + len(out.visual_targets)

    for batch in batches.values():
        n_scored = step(batch)
    wall: dict[str, list[float]] = {k: [] for k in batches}
    cpu: dict[str, list[float]] = {k: [] for k in batches}
    for _ in range(args.steps):
        for key, batch in batches.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step(batch)
            wall[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
    peak = gemm_peak()
    lengths = [len(t) for t in trajs]
    flops = model_flops(model, lengths, n_scored)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"body: width {args.width}, {args.layers} layers, {config.num_heads} heads, mixer "
        f"kernel {args.mixer_kernel} ({n_params / 1e6:.2f} M parameters); deterministic "
        f"{args.deterministic}; threads {torch.get_num_threads()}; {args.steps} steps each, "
        "alternating"
    )
    print(f"rows {len(trajs)}, {sum(lengths)} real tokens, useful GFLOP/step {flops / 1e9:.2f}")
    print(f"GEMM peak GFLOP/s {peak / 1e9:8.2f}   (fp32 1024x1024 matmul, same process)")
    print(
        f"  {'packing':8s} {'B x T':>9s} {'padded':>7s} {'step ms':>8s} {'CPU ms':>8s} "
        f"{'tokens/s':>9s} {'GFLOP/s':>8s} {'of peak':>8s}"
    )
    for key, batch in batches.items():
        seconds = statistics.median(wall[key])
        print(
            f"  {key:8s} {len(batch):>4d} x {batch.max_length:<3d} "
            f"{padded_fraction(batch):7.3f} {seconds * 1e3:8.1f} "
            f"{statistics.median(cpu[key]) * 1e3:8.1f} {sum(lengths) / seconds:9.0f} "
            f"{flops / seconds / 1e9:8.2f} {flops / seconds / peak:8.3f}"
        )
    ratio = statistics.median(wall["off"]) / statistics.median(wall["on"])
    print(f"  speed-up of packing (step time off / on): {ratio:.2f}x")


def _setup(
    args: argparse.Namespace, per_task: int
) -> tuple[TinyUnifiedModel, list[Trajectory], int]:
    """The tiny model (`--width`, `--layers`), `per_task` rows of each digits task
    serialised, and the pad id (threads, determinism and the seed set from `args`)."""
    torch.set_num_threads(args.threads)
    set_determinism(args.deterministic == "on", torch.device("cpu"))
    torch.manual_seed(0)
    codec = build_codec("vq", codebook_size=32).fit(load_split("train").images[:400])
    tokenizer = build_tokenizer()
    model = TinyUnifiedModel(body_config(args), tokenizer, codec).train()
    samples = [s for t in TASKS for s in make_task_samples(t, "train", per_task)]
    trajs = [serialize(s, tokenizer, encode_image=codec.encode) for s in samples]
    return model, trajs, SpecialIds.from_tokenizer(tokenizer).pad


def _ig_setup(args: argparse.Namespace) -> tuple[TinyUnifiedModel, TrajectoryBatch]:
    """The IG comparison's model and its one mixed batch (`--batch` // 4 rows per task)."""
    model, trajs, pad = _setup(args, args.batch // 4)
    return model, TrajectoryBatch.collate(trajs, pad)


def _status_mib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: current, VmHWM: peak) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


class _Mode:
    """One SFT objective (IG weight `weight`) on its own copy of the model."""

    def __init__(self, args: argparse.Namespace, model: TinyUnifiedModel, weight: float):
        ig = {"weight": weight, "event_selection": args.ig_selection,
              "blind_view_chunk_size": args.ig_chunk}  # fmt: skip
        self.objective = SFTObjective(SFTConfig(information_gain=ig))
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(self, batch: TrajectoryBatch, update: int) -> float:
        t0 = time.perf_counter()
        self.objective.begin_update(update, [batch], DistInfo())
        loss, _ = self.objective.loss(self.model, batch, self.objective.count(batch))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t0


def _peak_memory(args: argparse.Namespace, weight: float, queue: mp.Queue) -> None:
    """In a fresh process: the peak RSS of 3 steps above the RSS after setup (MiB); the
    peak (VmHWM) is reset after setup (`/proc/self/clear_refs` 5), so the setup's own
    peak (codec fitting) does not hide the steps'."""
    model, batch = _ig_setup(args)
    mode = _Mode(args, model, weight)
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_mib("VmRSS")
    for u in range(3):
        mode.step(batch, u)
    queue.put(_status_mib("VmHWM") - base)


def compare_ig(args: argparse.Namespace) -> None:
    """Step times of vanilla and IG, alternating on two copies of one model in this
    process (so a busy machine slows both alike); peak step memory of each in a fresh
    process. Prints medians, memory and the ratios."""
    model, batch = _ig_setup(args)
    modes = {"vanilla": _Mode(args, copy.deepcopy(model), 0.0), "ig": _Mode(args, model, 1.0)}
    times: dict[str, list[float]] = {"vanilla": [], "ig": []}
    for u in range(3 + args.steps):
        for name, mode in modes.items():
            seconds = mode.step(batch, u)
            if u >= 3:
                times[name].append(seconds)
    tv, ti = (statistics.median(times[k]) for k in ("vanilla", "ig"))
    ctx = mp.get_context("spawn")
    memory = {}
    for name, weight in (("vanilla", 0.0), ("ig", 1.0)):
        queue = ctx.Queue()
        proc = ctx.Process(target=_peak_memory, args=(args, weight, queue))
        proc.start()
        memory[name] = queue.get()
        proc.join()
    mv, mi = memory["vanilla"], memory["ig"]
    print(f"IG: selection {args.ig_selection}, {args.ig_chunk} blind views per forward; "
          f"{len(batch)} mixed digits rows, {args.threads} threads, {args.steps} steps each")  # fmt: skip
    print(f"step time (median) vanilla {tv * 1e3:8.1f} ms   IG {ti * 1e3:8.1f} ms   "
          f"ratio {ti / tv:5.2f}")  # fmt: skip
    print(f"peak step memory (RSS above setup) vanilla {mv:7.1f} MiB   IG {mi:7.1f} MiB   "
          f"ratio {mi / max(mv, 1e-9):5.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
