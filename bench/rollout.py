"""Rollout throughput: uniweave's engine vs transformers' `generate` on the same decoder body.

Like for like: one tiny model (a transformers `LlamaModel` body + text head); the
baseline is a `LlamaForCausalLM` that *shares* that body and head (same weights, same
sdpa attention), so both decode the same text-only, left-padded prompts greedily, and
the script checks that every runner produces the same tokens.

Pinned length mix: each request gets a target length drawn from a seeded log-normal
(median max_new_tokens / 4, sigma 0.9, clipped to [1, max_new_tokens]: a tail that
reaches the cap, as GRPO answers have), independent of the vocabulary and the weights.
The engine ends a row at its target (`max_new_tokens` per request); `generate` ends it by
a per-row stopping criterion, and, as TRL runs it, decodes the requests in chunks of the
slot count (a chunk runs until its longest row ends). EOS has its head row zeroed (logit
0); a row that still emits it ends there in every runner (the generated mix is printed
next to the targets).

Runners: `hf_generate` (chunks of S), `engine_static` (the engine in chunks of S, the
default before continuous batching), `engine_continuous` (S decode slots over all
requests, `RolloutEngine(slots=S)`). Useful tokens/s = generated tokens of all rows /
wall time (median of `--repeats` alternating runs). Scenarios: (a) "varied" at each
`--slots`, (b) "cap": every row to max_new_tokens at the first slot count.

    .venv/bin/python bench/rollout.py [--requests 256] [--slots 32 64] [--max-new-tokens 96]
        [--cap-requests 64] [--repeats 1] [--threads 1] [--device cuda|cpu] [--levers]

`--levers` also times the static engine's A/Bs (finished="mask", share_prefill=False,
lean=False) in the varied scenario at the first slot count. The last line reads
`result: varied_32=R varied_64=R cap_32=R` with R = engine_continuous / hf_generate
useful tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from transformers import GenerationConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

from uniweave.codecs import build_codec
from uniweave.data.digits import make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.data.template import serialize
from uniweave.data.tokenizer import SpecialIds, build_tokenizer
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.rollout import RolloutEngine, RolloutRequest, SamplingParams


def build() -> tuple[TinyUnifiedModel, LlamaForCausalLM]:
    tokenizer = build_tokenizer()
    codec = build_codec("vq", codebook_size=32, n_init=1, max_iter=5)
    codec.fit(load_split("train").images[:200])
    torch.manual_seed(0)
    # A plain Llama body (no conv prior): generate runs the very same decoder modules.
    config = TinyArchitecture(hidden_size=192, initializer_range=0.05, mixer_kernel=0)
    model = TinyUnifiedModel(config, tokenizer, codec).eval()
    sp = SpecialIds.from_tokenizer(tokenizer)
    with torch.no_grad():  # EOS logit 0: rows end at their pinned target lengths
        model.text_head.weight[sp.eos] = 0.0
    hf = LlamaForCausalLM(model.decoder.config)
    hf.model, hf.lm_head = model.decoder, model.text_head
    return model, hf.eval()


def target_lengths(n: int, cap: int, seed: int = 0) -> list[int]:
    """The pinned mix: seeded log-normal, median cap/4, sigma 0.9, clipped to [1, cap]."""
    rng = np.random.default_rng(seed)
    raw = np.exp(rng.normal(np.log(cap / 4), 0.9, size=n))
    return [int(v) for v in np.clip(np.round(raw), 1, cap)]


def describe(lengths: list[int]) -> str:
    q = np.percentile(lengths, [50, 90])
    return (
        f"min {min(lengths)} / median {q[0]:g} / p90 {q[1]:g} / max {max(lengths)}; "
        f"total {sum(lengths)}"
    )


def prompts(tokenizer, n: int) -> list:
    """Text-only prompts: the t2i questions (distinct prompts)."""
    samples = make_task_samples("t2i", "val", n, seed=0)
    return [serialize(s, tokenizer, add_generation_prompt=True) for s in samples]


class RowTargets(StoppingCriteria):
    """Ends each row of a `generate` call at its own target length (as EOS would)."""

    def __init__(self, prompt_width: int, targets: list[int], device) -> None:
        self.width = prompt_width
        self.targets = torch.tensor(targets, device=device)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.width) >= self.targets


def run_hf(hf, trajs, targets, pad: int, eos: int, slots: int) -> list[list[int]]:
    rows: list[list[int]] = []
    device = hf.device
    for s in range(0, len(trajs), slots):
        chunk, want = trajs[s : s + slots], targets[s : s + slots]
        P = max(len(t) for t in chunk)
        ids = torch.full((len(chunk), P), pad, dtype=torch.long)
        mask = torch.zeros(len(chunk), P, dtype=torch.long)
        for r, t in enumerate(chunk):
            ids[r, P - len(t) :] = t.token_ids
            mask[r, P - len(t) :] = 1
        config = GenerationConfig(
            max_new_tokens=max(want), do_sample=False, eos_token_id=eos, pad_token_id=pad
        )
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([RowTargets(P, want, device)]),
            )
        for r, n in zip(out[:, P:].tolist(), want):
            r = r[:n]
            rows.append(r[: r.index(eos) + 1] if eos in r else r)
    return rows


def requests_for(trajs, targets) -> list[RolloutRequest]:
    out = []
    for k, (t, n) in enumerate(zip(trajs, targets)):
        params = SamplingParams(
            greedy=True, max_new_tokens=n, cycle_max_period=0, on_invalid_header="text"
        )
        out.append(RolloutRequest(t, seed=k, params=params))
    return out


def run_engine(engine: RolloutEngine, trajs, targets, chunk: int) -> list[list[int]]:
    requests = requests_for(trajs, targets)
    out = []
    for s in range(0, len(requests), chunk):
        out += engine.generate(requests[s : s + chunk])
    return [o.token_ids[len(t) :].tolist() for o, t in zip(out, trajs)]


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def scenario(name, model, hf, trajs, targets, slots: int, args) -> float:
    sp = SpecialIds.from_tokenizer(model.tokenizer)
    n = len(trajs)
    runners = {
        "hf_generate": lambda: run_hf(hf, trajs, targets, sp.pad, sp.eos, slots),
        "engine_static": lambda: run_engine(RolloutEngine(model), trajs, targets, slots),
        "engine_continuous": lambda: run_engine(
            RolloutEngine(model, slots=slots), trajs, targets, n
        ),
    }
    if args.levers and name == "varied" and slots == args.slots[0]:
        for key, kw in (
            ("static_mask", {"finished": "mask"}),
            ("static_unshared", {"share_prefill": False}),
            ("static_generic", {"lean": False}),
        ):
            runners[key] = lambda kw=kw: run_engine(
                RolloutEngine(model, **kw), trajs, targets, slots
            )
    times: dict[str, list[float]] = {k: [] for k in runners}
    outputs = {}
    for _ in range(args.repeats):
        for key, fn in runners.items():
            seconds, outputs[key] = timed(fn)
            times[key].append(seconds)
    reference = outputs["hf_generate"]
    same = all(outputs[k] == reference for k in runners)
    lengths = [len(r) for r in reference]
    n_tokens = sum(lengths)
    tps = {k: n_tokens / statistics.median(v) for k, v in times.items()}
    print(
        f"\n[{name}] {n} requests, {slots} slots, max_new_tokens {args.max_new_tokens}, "
        f"threads {torch.get_num_threads()}, repeats {args.repeats}"
    )
    print(f"  target lengths: {describe(targets)}")
    print(f"  generated:      {describe(lengths)}; identical tokens: {same}")
    for key in runners:
        ms = statistics.median(times[key]) * 1e3
        print(f"  {key:18s} {ms:9.1f} ms  {tps[key]:8.0f} tok/s")
    ratio = tps["engine_continuous"] / tps["hf_generate"]
    print(f"  engine_continuous / hf_generate: {ratio:.2f}x")
    print(f"  engine_static / hf_generate:     {tps['engine_static'] / tps['hf_generate']:.2f}x")
    if model.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(model.device) / 2**20
        print(f"  peak GPU memory so far: {peak:.0f} MiB")
    if not same:
        raise SystemExit("the runners disagree on the tokens: not a like-for-like run")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--slots", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--cap-requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--levers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, hf = build()
    model.to(args.device)
    trajs = prompts(model.tokenizer, args.requests)
    cap = args.max_new_tokens
    targets = target_lengths(args.requests, cap)
    results = {}
    for slots in args.slots:
        results[f"varied_{slots}"] = scenario("varied", model, hf, trajs, targets, slots, args)
    n_cap = args.cap_requests
    s0 = args.slots[0]
    results[f"cap_{s0}"] = scenario("cap", model, hf, trajs[:n_cap], [cap] * n_cap, s0, args)
    print("result: " + " ".join(f"{k}={v:.2f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
