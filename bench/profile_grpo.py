"""Where one uniweave GRPO update's time goes: a torch profiler table per phase.

Builds the update of `bench/grpo_vs_trl.py` (the tiny model's Llama body and text head,
text-only prompts, P prompts x G, `max_new_tokens`, no reference, replay anchoring), runs
`--warmup` untimed updates, then profiles one update with each phase under its own
`record_function` label — rollout, reward + advantages, old log-probs (none under replay
anchoring with one update per batch), update (forward + backward + AdamW) — and prints
the phase totals and the top operators (self CPU time) of each phase.

    OMP_NUM_THREADS=1 .venv/bin/python bench/profile_grpo.py [--prompts 16] [--group 8]
        [--max-new-tokens 20] [--rows 15]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_vs_trl import UniweaveSide, build_model, text_prompts  # noqa: E402

from uniweave.data.tokenizer import SpecialIds  # noqa: E402

PHASES = ("rollout", "reward+advantages", "old log-probs", "update (fwd+bwd+AdamW)")


def _phase_of(evt_name: str) -> str | None:
    return evt_name.removeprefix("phase: ") if evt_name.startswith("phase: ") else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--unshared", action="store_true", help="every row prefilled and replayed on its own"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.n_prompts = args.prompts
    model = build_model(args)
    tok = model.tokenizer
    args.pad = SpecialIds.from_tokenizer(tok).pad
    args.digit_ids = frozenset(i for w, i in tok.get_vocab().items() if w.isdigit())
    samples = text_prompts(tok, 64)
    with tempfile.TemporaryDirectory() as tmp:
        side = UniweaveSide(
            model,
            args,
            tmp,
            phase=lambda name: record_function(f"phase: {name}"),
            share=not args.unshared,
        )
        for u in range(args.warmup):
            side.update(samples[u * args.prompts : (u + 1) * args.prompts], u)
        u = args.warmup
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            side.update(samples[u * args.prompts : (u + 1) * args.prompts], u)
    events = prof.events()
    print(
        f"\none uniweave GRPO update: {args.prompts} prompts x G={args.group}, max_new_tokens "
        f"{args.max_new_tokens}, mean generated length {side.timings.lengths[-1]:.1f}, "
        f"threads {torch.get_num_threads()}"
    )
    totals = {e.name: e.cpu_time_total / 1e3 for e in events if _phase_of(e.name)}
    whole = sum(totals.values())
    for name in PHASES:
        ms = totals.get(f"phase: {name}", 0.0)
        print(f"  {name:26s} {ms:9.1f} ms  {ms / max(whole, 1e-9):6.1%}")
    for name in PHASES:
        key = f"phase: {name}"
        if totals.get(key, 0.0) < 1.0:
            continue
        phase_events = [e for e in events if e.name == key]
        start = min(e.time_range.start for e in phase_events)
        end = max(e.time_range.end for e in phase_events)
        inside = [
            e
            for e in events
            if e.time_range.start >= start and e.time_range.end <= end and e.name != key
        ]
        by_op: dict[str, list[float]] = {}
        for e in inside:
            acc = by_op.setdefault(e.name, [0.0, 0])
            acc[0] += e.self_cpu_time_total / 1e3
            acc[1] += 1
        print(f"\n[{name}] top operators by self CPU time (of {totals[key]:.1f} ms)")
        print(f"  {'operator':48s} {'self ms':>9s} {'calls':>7s}")
        for op, (ms, calls) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[: args.rows]:
            print(f"  {op[:48]:48s} {ms:9.1f} {calls:7d}")


if __name__ == "__main__":
    main()
