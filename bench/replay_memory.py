"""Replay peak memory and time vs a naive full-logits forward (vocabulary 102,400).

Both score the same batch of text trajectories (`--batch` rows of 512 positions, the
last `--response` of them policy-owned) with the same tiny model, whose tokenizer has
Janus-Pro's 102,400 ids. Naive: head on every position, [B, T, V] logits, log-softmax,
gather the targets at the policy positions (what `model(...).logits` leads to). uniweave:
`uniweave.replay.replay_logprobs` (heads only at policy positions, 128 at a time). The two
results are checked to agree.

Peak memory method: Linux's resident-set high-water mark. Before each call the script
resets it (`echo 5 > /proc/self/clear_refs`) and reads VmRSS; after the call it reads
VmHWM from /proc/self/status; peak = VmHWM - VmRSS(before). Large tensors are mmap'd and
returned to the OS on free, so the measurements in one process are independent; uniweave's
replay is measured before and after the naive forward and the larger value is kept.
Time: median of `--repeats` calls. `--grad` also measures forward + backward of the
summed log-probs (training-time scoring; replay checkpoints each chunk).

`--jsd` adds the JSD-to-reference path of GRPO (`kl.type: jsd`): the objective's loss on
the same rows (advantage 0, so the loss is the penalty: the full-vocabulary JSD to a
frozen, perturbed copy of the model at every scored position), forward + backward,
against plain replay's forward + backward. The reference's distributions are rebuilt per
chunk from its hidden states, so its peak should stay within 1.2x of plain replay's.

`--opd` adds on-policy distillation's loss (`uniweave.train.methods.opd.objective.OPDObjective`, teacher = a
frozen perturbed copy, top-K `--top-k` union with a tail, forward + backward) against
computing the full distributions of both models at once: [B, T, V] student log-probs with
gradient and [B, T, V] teacher log-probs, the dense generalised JSD (core's
`jsd_from_logp`) at the scored positions, backward. The teacher here is nearly uniform
over 102,400 ids (a random model), so the retained-mass guard would send every position
to the full vocabulary; the row is measured with `--retained-mass-min` 0 (pure union)
and with the default 0.95 (every position falls back: chunked full vocabulary). Target:
OPD's peak <= 0.2x the naive one.

    .venv/bin/python bench/replay_memory.py [--batch 4] [--grad] [--jsd] [--opd | --opd-only]
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import re
import statistics
import string
import time
from collections.abc import Callable

import torch

from uniweave.codecs import build_codec
from uniweave.config.algorithms import GRPOConfig, OPDConfig
from uniweave.core.distributions import jsd_from_logp
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.core.types import Owner
from uniweave.data.digits_images import load_split
from uniweave.data.tokenizer import build_tokenizer, build_vocab
from uniweave.forward import body_hidden
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.replay import replay_logprobs
from uniweave.rollout import SamplingParams, SamplingRecord
from uniweave.train.methods.grpo.objective import GRPOObjective, Reference, scored_mask
from uniweave.train.methods.opd.objective import OPDObjective
from uniweave.train.methods.opd.source import DistillRecord

VOCAB = 102_400
SEQ = 512


def janus_sized_tokenizer():
    """The embedded tokenizer grown to VOCAB ids with extra four-letter words."""
    vocab = set(build_vocab())
    words = ("".join(p) for p in itertools.product(string.ascii_lowercase, repeat=4))
    extra = list(itertools.islice((w for w in words if w not in vocab), VOCAB - len(vocab)))
    tokenizer = build_tokenizer([" ".join(extra)])
    assert len(tokenizer) == VOCAB, len(tokenizer)
    return tokenizer


def build(batch: int, response: int, mixer_kernel: int) -> tuple[TinyUnifiedModel, TrajectoryBatch]:
    tokenizer = janus_sized_tokenizer()
    codec = build_codec("vq", codebook_size=16, n_init=1, max_iter=3)
    codec.fit(load_split("train").images[:100])
    torch.manual_seed(0)
    config = TinyArchitecture(
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        max_position_embeddings=SEQ,
        mixer_kernel=mixer_kernel,
    )
    model = TinyUnifiedModel(config, tokenizer, codec).eval()
    trajs = []
    for _ in range(batch):
        owner = torch.full((SEQ,), int(Owner.PROMPT))
        owner[SEQ - response :] = int(Owner.POLICY)
        trajs.append(
            Trajectory(
                token_ids=torch.randint(16, VOCAB, (SEQ,)),
                modality=torch.zeros(SEQ, dtype=torch.long),
                owner=owner,
                visual_codes=torch.full((SEQ,), -1),
                image_grids=[],
            )
        )
    return model, TrajectoryBatch.collate(trajs, tokenizer.pad_token_id)


def naive_logprobs(model: TinyUnifiedModel, batch: TrajectoryBatch) -> torch.Tensor:
    """Full-sequence logits [B, T, V] -> log-softmax -> targets at the policy positions."""
    hidden = body_hidden(model, batch)
    logp_all = torch.log_softmax(model.text_logits(hidden[:, :-1]).float(), dim=-1)
    target = logp_all.gather(-1, batch.token_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(target, (1, 0)) * batch.policy_mask


def _status() -> dict[str, int]:
    text = open("/proc/self/status").read()
    return {
        k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")
    }


def peak_bytes(fn: Callable[[], object]) -> int:
    """Resident-memory high-water mark of fn() above the resident size before it."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status()["VmRSS"]
    result = fn()
    peak = _status()["VmHWM"]
    del result
    gc.collect()
    return peak - before


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(name: str, fns: dict[str, Callable[[], object]], repeats: int) -> None:
    mem = {"replay": peak_bytes(fns["replay"]), "naive": peak_bytes(fns["naive"])}
    mem["replay"] = max(mem["replay"], peak_bytes(fns["replay"]))
    sec = {k: median_seconds(fn, repeats) for k, fn in fns.items()}
    print(f"\n[{name}]")
    for k in ("naive", "replay"):
        print(f"  {k:7s} peak {mem[k] / 2**20:8.1f} MiB   time {sec[k] * 1e3:8.1f} ms")
    print(f"  ratio replay / naive peak memory: {mem['replay'] / mem['naive']:.3f}x")
    print(f"  ratio replay / naive time:        {sec['replay'] / sec['naive']:.3f}x")


def jsd_row(model: TinyUnifiedModel, batch: TrajectoryBatch, chunk: int, repeats: int) -> None:
    """Peak memory and time of GRPO's JSD-to-reference loss vs plain replay, both with
    backward (module docstring)."""
    reference = Reference(model, lora=False)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in reference.frozen.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    algo = GRPOConfig(old_logp_source="rollout", kl={"type": "jsd", "coef": 1.0}, chunk_size=chunk)
    objective = GRPOObjective(algo, reference)
    records = [SamplingRecord(SamplingParams())] * len(batch)
    rows = copy.copy(batch)
    rows.sampling = records
    rows.advantages = torch.zeros(len(batch))
    rows.rollout_logp = torch.zeros(batch.token_ids.shape)
    n = int(scored_mask(rows).sum())

    def jsd() -> None:
        model.zero_grad(set_to_none=True)
        objective.loss(model, rows, n)[0].backward()

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        replay_logprobs(model, batch, records, chunk_size=chunk).logp.sum().backward()

    mem = {"plain": peak_bytes(plain), "jsd": peak_bytes(jsd)}
    mem["plain"] = max(mem["plain"], peak_bytes(plain))
    sec = {"plain": median_seconds(plain, repeats), "jsd": median_seconds(jsd, repeats)}
    print("\n[JSD to reference, forward + backward]")
    for k, label in (("plain", "plain replay"), ("jsd", "JSD to ref")):
        print(f"  {label:12s} peak {mem[k] / 2**20:8.1f} MiB   time {sec[k] * 1e3:8.1f} ms")
    print(f"  ratio JSD / plain replay peak memory: {mem['jsd'] / mem['plain']:.3f}x")
    print(f"  ratio JSD / plain replay time:        {sec['jsd'] / sec['plain']:.3f}x")


def perturbed_copy(model: TinyUnifiedModel) -> TinyUnifiedModel:
    """A frozen copy of `model` with N(0, 0.02) added to every weight (a teacher)."""
    teacher = copy.deepcopy(model).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
            p.requires_grad_(False)
    return teacher


def opd_row(model: TinyUnifiedModel, batch: TrajectoryBatch, args: argparse.Namespace) -> None:
    """Peak memory and time of the OPD loss vs both models' full distributions at once,
    forward + backward (module docstring)."""
    teacher = perturbed_copy(model)
    rows = copy.copy(batch)
    rows.sampling = [DistillRecord(SamplingParams())] * len(batch)
    rows.finish_reasons = ["eos"] * len(batch)
    scored = scored_mask(rows)

    def naive() -> None:
        model.zero_grad(set_to_none=True)
        hidden = body_hidden(model, batch)
        logp = torch.log_softmax(model.text_logits(hidden[:, :-1]).float(), -1)
        with torch.no_grad():
            logq = torch.log_softmax(teacher.text_logits(body_hidden(teacher, batch)[:, :-1]), -1)
        mask = scored[:, 1:]
        jsd_from_logp(logp[mask], logq[mask], 0.5).sum().backward()

    mem = {"naive": peak_bytes(naive)}
    sec = {"naive": median_seconds(naive, args.repeats)}
    print(f"\n[OPD: top-{args.top_k} union vs both models' full distributions, forward + backward]")
    print(
        f"  {'both full':22s} peak {mem['naive'] / 2**20:8.1f} MiB   time {sec['naive'] * 1e3:8.1f} ms"
    )
    for floor in (0.0, args.retained_mass_min):
        algo = OPDConfig(teacher={"path": "bench"}, top_k=args.top_k, retained_mass_min=floor,
                         chunk_size=args.chunk_size)  # fmt: skip
        objective = OPDObjective(algo, teacher, {})
        n = objective.count(rows)
        stats: dict[str, float] = {}

        def opd(objective=objective, n=n, stats=stats) -> None:
            model.zero_grad(set_to_none=True)
            loss, s = objective.loss(model, rows, n)
            loss.backward()
            stats.update(s)

        peak = max(peak_bytes(opd), peak_bytes(opd))
        t = median_seconds(opd, args.repeats)
        label = f"OPD guard {floor:.2f}"
        fallback = stats["fallback_sum"] / max(stats["n_categorical"], 1.0)
        print(f"  {label:22s} peak {peak / 2**20:8.1f} MiB   time {t * 1e3:8.1f} ms   "
              f"fallback {fallback:.2f}, retained {stats['retained_sum'] / n_pos(stats):.3f}")  # fmt: skip
        print(
            f"  ratio OPD (guard {floor:.2f}) / both full peak memory: {peak / mem['naive']:.3f}x"
        )


def n_pos(stats: dict[str, float]) -> float:
    return max(stats["n_categorical"], 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--response", type=int, default=384)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--grad", action="store_true")
    parser.add_argument("--jsd", action="store_true")
    parser.add_argument("--opd", action="store_true")
    parser.add_argument("--opd-only", action="store_true", help="only the OPD row")
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--retained-mass-min", type=float, default=0.95)
    parser.add_argument(
        "--mixer-kernel",
        type=int,
        default=4,
        help="the tiny body's conv prior (0 = off, as before it existed)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, batch = build(args.batch, args.response, args.mixer_kernel)
    records = [SamplingRecord(SamplingParams())] * len(batch)
    logits_mib = len(batch) * (SEQ - 1) * VOCAB * 4 / 2**20
    print(
        f"vocab {VOCAB}, batch {len(batch)} x {SEQ} positions, {batch.n_scored()} scored, "
        f"chunk {args.chunk_size}; one fp32 [B, T, V] logits tensor = {logits_mib:.0f} MiB"
    )

    if args.opd_only:
        opd_row(model, batch, args)
        return

    def replay() -> torch.Tensor:
        return replay_logprobs(model, batch, records, chunk_size=args.chunk_size).logp

    with torch.no_grad():
        diff = (replay() - naive_logprobs(model, batch)).abs().max().item()
        print(f"max |replay - naive| log-prob: {diff:.2e}")
        report(
            "no grad (old log-probs)",
            {"replay": replay, "naive": lambda: naive_logprobs(model, batch)},
            args.repeats,
        )
    if args.grad:

        def backward(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
            def run() -> None:
                model.zero_grad(set_to_none=True)
                fn().sum().backward()

            return run

        report(
            "forward + backward (new log-probs)",
            {"replay": backward(replay), "naive": backward(lambda: naive_logprobs(model, batch))},
            args.repeats,
        )

    if args.jsd:
        jsd_row(model, batch, args.chunk_size, args.repeats)
    if args.opd:
        opd_row(model, batch, args)


if __name__ == "__main__":
    main()
