"""SFT step throughput of the tiny model against this machine's measured GEMM peak.

Prints tokens/s of full SFT steps (forward + backward + AdamW on a mixed digits batch)
and the model-FLOPs utilisation: achieved model FLOP/s divided by the FLOP/s of a large
fp32 matrix multiply measured in the same process (the baseline). Model FLOPs per step:
6 · N_matmul · tokens (weights, forward + backward) + 12 · layers · d · Σ_rows T_row²
(attention scores and values, forward + backward) + 6 · n_mixers · k · d · tokens (the
depthwise causal conv prior, `model.tiny.mixer_kernel` = k), with N_matmul the parameters
of the decoder's linear layers plus the heads at the scored positions. Run it with
`--mixer-kernel 0` and with the default to read the prior's throughput cost.

    .venv/bin/python bench/sft_step.py [--steps 20] [--batch 32] [--threads 2]
        [--mixer-kernel 4] [--deterministic on|off]

`--deterministic` is `run.deterministic` (default on, as in `unirl train`): compare the
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

from unirl.codecs import build_codec
from unirl.config.algorithms import SFTConfig
from unirl.core.trajectory import TrajectoryBatch
from unirl.data.digits import TASKS, make_task_samples
from unirl.data.digits_images import load_split
from unirl.data.template import serialize
from unirl.data.tokenizer import SpecialIds, build_tokenizer
from unirl.forward import forward_interleaved
from unirl.models.tiny import TinyModelConfig, TinyUnifiedModel
from unirl.train.build import set_determinism
from unirl.train.distributed import DistInfo
from unirl.train.sft import SFTObjective


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


def model_flops(model: TinyUnifiedModel, batch: TrajectoryBatch, n_scored: int) -> float:
    cfg = model.config
    linear = sum(
        m.weight.numel()
        for name, m in model.decoder.named_modules()
        if isinstance(m, torch.nn.Linear)
    )
    tokens = int(batch.attention_mask.sum())
    head = model.text_head.weight.numel()
    attention = 12 * cfg.num_layers * cfg.hidden_size * float((batch.lengths.float() ** 2).sum())
    mixers = 6.0 * 2 * cfg.num_layers * cfg.mixer_kernel * cfg.hidden_size * tokens
    return 6.0 * linear * tokens + 6.0 * head * n_scored + attention + mixers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mixer-kernel", type=int, default=TinyModelConfig.mixer_kernel)
    parser.add_argument("--deterministic", choices=("on", "off"), default="on")
    parser.add_argument("--ig", action="store_true", help="IG vs vanilla SFT (see docstring)")
    parser.add_argument("--ig-selection", choices=("cycle", "all"), default="cycle")
    parser.add_argument("--ig-chunk", type=int, default=8)
    args = parser.parse_args()
    if args.ig:
        compare_ig(args)
        return
    torch.set_num_threads(args.threads)
    set_determinism(args.deterministic == "on", torch.device("cpu"))
    torch.manual_seed(0)
    codec = build_codec("vq", codebook_size=32).fit(load_split("train").images[:400])
    tokenizer = build_tokenizer()
    model = TinyUnifiedModel(
        TinyModelConfig(hidden_size=128, mixer_kernel=args.mixer_kernel), tokenizer, codec
    ).train()
    samples = [s for t in TASKS for s in make_task_samples(t, "train", args.batch // 4)]
    trajs = [serialize(s, tokenizer, encode_image=codec.encode) for s in samples]
    batch = TrajectoryBatch.collate(trajs, SpecialIds.from_tokenizer(tokenizer).pad)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> int:
        out = forward_interleaved(model, batch)
        loss = torch.nn.functional.cross_entropy(out.text_logits, out.text_targets, reduction="sum")
        loss = loss + torch.nn.functional.cross_entropy(
            out.visual_logits, out.visual_targets, reduction="sum"
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        return len(out.text_targets) + len(out.visual_targets)

    for _ in range(3):
        n_scored = step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - t0) / args.steps
    peak = gemm_peak()
    flops = model_flops(model, batch, n_scored)
    tokens = int(batch.attention_mask.sum())
    print(f"mixer kernel {args.mixer_kernel} (0 = no sequence-mixing prior)")
    print(f"deterministic        {args.deterministic}")
    print(f"batch {len(batch)} rows, {tokens} tokens ({batch.max_length} padded length)")
    print(f"step time            {seconds * 1e3:8.1f} ms")
    print(f"tokens/s             {tokens / seconds:8.0f}")
    print(f"model GFLOP/s        {flops / seconds / 1e9:8.2f}")
    print(f"GEMM peak GFLOP/s    {peak / 1e9:8.2f}   (fp32 1024x1024 matmul, same process)")
    print(f"fraction of peak     {flops / seconds / peak:8.3f}")


def _setup(args: argparse.Namespace) -> tuple[TinyUnifiedModel, TrajectoryBatch]:
    """The tiny model (width 128) and the default bench's mixed digits batch."""
    torch.set_num_threads(args.threads)
    set_determinism(args.deterministic == "on", torch.device("cpu"))
    torch.manual_seed(0)
    codec = build_codec("vq", codebook_size=32).fit(load_split("train").images[:400])
    tokenizer = build_tokenizer()
    config = TinyModelConfig(hidden_size=128, mixer_kernel=args.mixer_kernel)
    model = TinyUnifiedModel(config, tokenizer, codec).train()
    samples = [s for t in TASKS for s in make_task_samples(t, "train", args.batch // 4)]
    trajs = [serialize(s, tokenizer, encode_image=codec.encode) for s in samples]
    return model, TrajectoryBatch.collate(trajs, SpecialIds.from_tokenizer(tokenizer).pad)


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
    model, batch = _setup(args)
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
    model, batch = _setup(args)
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
