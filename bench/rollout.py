"""Rollout throughput: unirl's engine vs transformers' `generate` on the same decoder body.

Like for like: one tiny model (a transformers `LlamaModel` body + text head); the
baseline is a `LlamaForCausalLM` that *shares* that body and head (same weights, same
sdpa attention, same DynamicCache), so both decode the same text-only, left-padded
prompts greedily with EOS `<|im_end|>`, and the script checks that they produce the same
tokens. The engine runs with its cycle detector off and `<|vision_start|>` treated as
text, so it does exactly what `generate` does. Useful tokens/s = generated tokens of all
rows / wall time (median of `--repeats` alternating runs).

`engine_compact` is the default engine; `engine_unshared` prefills every row on its own
instead of each distinct prompt once, and `engine_generic` runs each decode step through
the body's transformers forward instead of the lean step (one-process A/Bs of those
levers).

Two scenarios: "varied" (the model's EOS head row is scaled so that greedy rows end at
different lengths, as a trained model's rows do) and "all-cap" (no row emits EOS, every
row runs to `--max-new-tokens`: only per-step overhead differs). The engine's two
finished-row policies (compact vs mask) are timed in the same process.

    .venv/bin/python bench/rollout.py [--batch 32 64] [--max-new-tokens 96] [--threads 1]
        [--device cuda|cpu]   (default cuda when available; prints peak GPU memory there)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GenerationConfig, LlamaForCausalLM

from unirl.codecs import build_codec
from unirl.data.digits import make_task_samples
from unirl.data.digits_images import load_split
from unirl.data.template import serialize
from unirl.data.tokenizer import SpecialIds, build_tokenizer
from unirl.models.tiny import TinyArchitecture, TinyUnifiedModel
from unirl.rollout import RolloutEngine, RolloutRequest, SamplingParams


def build(eos_scale: float) -> tuple[TinyUnifiedModel, LlamaForCausalLM]:
    tokenizer = build_tokenizer()
    codec = build_codec("vq", codebook_size=32, n_init=1, max_iter=5)
    codec.fit(load_split("train").images[:200])
    torch.manual_seed(0)
    # A plain Llama body (no conv prior): generate runs the very same decoder modules.
    config = TinyArchitecture(hidden_size=192, initializer_range=0.05, mixer_kernel=0)
    model = TinyUnifiedModel(config, tokenizer, codec).eval()
    eos = SpecialIds.from_tokenizer(tokenizer).eos
    with torch.no_grad():
        model.text_head.weight[eos] *= eos_scale
    hf = LlamaForCausalLM(model.decoder.config)
    hf.model, hf.lm_head = model.decoder, model.text_head
    return model, hf.eval()


def prompts(tokenizer, n: int) -> list:
    """Text-only prompts: the t2i questions (draw-then-answer now shows an image)."""
    samples = make_task_samples("t2i", "val", n, seed=0)
    return [serialize(s, tokenizer, add_generation_prompt=True) for s in samples]


def run_hf(hf: LlamaForCausalLM, trajs, pad: int, eos: int, n_new: int) -> list[list[int]]:
    P = max(len(t) for t in trajs)
    ids = torch.full((len(trajs), P), pad, dtype=torch.long)
    mask = torch.zeros(len(trajs), P, dtype=torch.long)
    for r, t in enumerate(trajs):
        ids[r, P - len(t) :] = t.token_ids
        mask[r, P - len(t) :] = 1
    config = GenerationConfig(
        max_new_tokens=n_new, do_sample=False, eos_token_id=eos, pad_token_id=pad
    )
    device = hf.device
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config
        )
    rows = []
    for r in out[:, P:].tolist():
        rows.append(r[: r.index(eos) + 1] if eos in r else r)
    return rows


def run_engine(engine: RolloutEngine, trajs, n_new: int) -> list[list[int]]:
    params = SamplingParams(
        greedy=True, max_new_tokens=n_new, cycle_max_period=0, on_invalid_header="text"
    )
    requests = [RolloutRequest(t, seed=k, params=params) for k, t in enumerate(trajs)]
    out = engine.generate(requests)
    return [o.token_ids[len(t) :].tolist() for o, t in zip(out, trajs)]


def timed(fn) -> tuple[float, float, object]:
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - t0, time.process_time() - c0, result


def scenario(name: str, eos_scale: float, args: argparse.Namespace) -> None:
    model, hf = build(eos_scale)
    model.to(args.device)
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    tok = model.tokenizer
    sp = SpecialIds.from_tokenizer(tok)
    trajs = prompts(tok, args.batch)
    runners = {
        "hf_generate": lambda: run_hf(hf, trajs, sp.pad, sp.eos, args.max_new_tokens),
        "engine_compact": lambda: run_engine(
            RolloutEngine(model, finished="compact"), trajs, args.max_new_tokens
        ),
        "engine_mask": lambda: run_engine(
            RolloutEngine(model, finished="mask"), trajs, args.max_new_tokens
        ),
        # A/B of one engine lever (on in engine_compact): every row prefilled on its own
        "engine_unshared": lambda: run_engine(
            RolloutEngine(model, share_prefill=False), trajs, args.max_new_tokens
        ),
        # A/B of the lean decode step (on in engine_compact): the body's own forward
        "engine_generic": lambda: run_engine(
            RolloutEngine(model, lean=False), trajs, args.max_new_tokens
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    outputs = {}
    for _ in range(args.repeats):
        for key, fn in runners.items():
            seconds, cpu_seconds, outputs[key] = timed(fn)
            times[key].append(seconds)
            cpu[key].append(cpu_seconds)
    reference = outputs["hf_generate"]
    same = all(outputs[k] == reference for k in runners)
    lengths = [len(r) for r in reference]
    n_tokens = sum(lengths)
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: n_tokens / v for k, v in med.items()}
    print(
        f"\n[{name}] batch {args.batch}, max_new_tokens {args.max_new_tokens}, "
        f"threads {torch.get_num_threads()}, repeats {args.repeats}"
    )
    print(
        f"  row lengths: min {min(lengths)} median {statistics.median(lengths)} "
        f"max {max(lengths)}; total {n_tokens} tokens; identical tokens: {same}; "
        f"distinct prompts {len({tuple(t.token_ids.tolist()) for t in trajs})}"
    )
    for key in runners:
        cpu_ms = statistics.median(cpu[key]) * 1e3
        print(f"  {key:15s} {med[key] * 1e3:8.1f} ms  {tps[key]:8.0f} tok/s  CPU {cpu_ms:8.1f} ms")
    print(
        f"  ratio engine_compact / hf_generate tokens/s: "
        f"{tps['engine_compact'] / tps['hf_generate']:.2f}x"
    )
    print(
        f"  ratio engine_mask / hf_generate tokens/s:    "
        f"{tps['engine_mask'] / tps['hf_generate']:.2f}x"
    )
    for other in ("engine_mask", "engine_unshared", "engine_generic"):
        print(
            f"  ratio engine_compact / {other} tokens/s: {tps['engine_compact'] / tps[other]:.2f}x"
        )
    if model.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(model.device) / 2**20
        print(f"  peak GPU memory (all runs of this scenario): {peak:.0f} MiB")
    if not same:
        raise SystemExit("engine and generate disagree on the tokens: not a like-for-like run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eos-scale", type=float, default=2.5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for batch in args.batch:
        scenario(
            "varied lengths", args.eos_scale, argparse.Namespace(**{**vars(args), "batch": batch})
        )
    scenario("all-cap", 0.0, argparse.Namespace(**{**vars(args), "batch": args.batch[0]}))


if __name__ == "__main__":
    main()
