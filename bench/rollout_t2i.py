"""Text-to-image rollout throughput: uniweave's engine vs transformers' Janus image generation.

Like for like: one tiny Janus-Pro checkpoint (`uniweave.models.janus_pro.tiny`, the
builder the Janus tests use; `--grid` x `--grid` image tokens), loaded once by uniweave
(`JanusProModel`) and once by transformers (`JanusForConditionalGeneration`); both
decode the same left-padded prompts greedily with classifier-free guidance w = 5 (a
conditional and an unconditional row per image), and the script checks that the codes
are identical. Useful tokens/s = image tokens of all images / wall time (median of
`--repeats` alternating runs).

Runners: `hf_generate` (`generate(generation_mode="image", guidance_scale=5)` over the
whole batch), `engine_static` (the engine's static batch) and `engine_continuous`
(`RolloutEngine(slots=2 * images)`: each image's guided pair in two slots, admitted,
stepped and retired together; guided logits formed once per pair). `--bare` adds
`bare_loop`, a ceiling rather than a product: the decode loop with nothing but the model
(one prefill of the conditional and unconditional rows as transformers builds them, then
per step the lean Llama step on a transformers `DynamicCache`, the generation head, the
guided logits and argmax; no log-probs, no trajectories, no checks), its codes checked
identical too. hf_generate / bare_loop bounds what any engine can gain over transformers
on this device.

    .venv/bin/python bench/rollout_t2i.py [--images 16 64] [--grid 8] [--repeats 1]
        [--threads 1] [--device cuda|cpu] [--bare]

The last line reads `result: t2i_16=R t2i_64=R`, R = engine_continuous / hf_generate
useful tokens/s (with `--bare` also `bare_16=B ...`, B = bare_loop / hf_generate).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import JanusForConditionalGeneration

from uniweave.core.sample import GenerationRequest, Sample, TextPart
from uniweave.models.janus_pro import JanusProModel
from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint
from uniweave.rollout import RolloutEngine, RolloutRequest, SamplingParams

WORDS = ["red", "blue", "cat", "dog", "on", "the", "mat", "a", "two", "birds", "draw", "big"]
W = 5.0


def texts(n: int) -> list[str]:
    """n prompts of 2..7 words (a seeded, vocabulary-only mix: varied left padding)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        k = int(torch.randint(2, 8, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (k,), generator=g)))
    return out


def run_engine(model, prompts: list[str], grid: int, slots: int | None) -> list[list[int]]:
    params = SamplingParams(
        greedy=True, guidance=W, max_new_tokens=grid * grid, length_semantics="exact"
    )
    requests = [
        RolloutRequest(Sample(f"s{k}", [TextPart(t), GenerationRequest(grid, grid)]), k, params)
        for k, t in enumerate(prompts)
    ]
    out = RolloutEngine(model, slots=slots).generate(requests)
    rows = []
    for o in out:
        n = o.sampling.prompt_length
        rows.append(o.visual_codes[n : n + grid * grid].tolist())
    return rows


def hf_inputs(model, prompts: list[str], grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's own prompt positions, left-padded for `generate`."""
    ids = []
    for k, t in enumerate(prompts):
        sample = Sample(f"s{k}", [TextPart(t), GenerationRequest(grid, grid)])
        traj = model.prompt_trajectory(sample, add_generation_prompt=True)
        ids.append(traj.token_ids)
    width = max(len(p) for p in ids)
    pad = model.tokens.pad
    batch = torch.stack([torch.cat([p.new_full((width - len(p),), pad), p]) for p in ids])
    mask = torch.stack([torch.arange(width) >= width - len(p) for p in ids]).long()
    return batch, mask


def run_hf(hf, ids, mask) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(
            ids.to(hf.device),
            attention_mask=mask.to(hf.device),
            generation_mode="image",
            do_sample=False,
            guidance_scale=W,
        )
    return out.tolist()


@torch.no_grad()
def run_bare(model, ids: torch.Tensor, mask: torch.Tensor, grid: int) -> list[list[int]]:
    """The ceiling loop (module docstring): transformers' conditional/unconditional rows
    (the unconditional prompt keeps BOS and BOI, every other token becomes padding), one
    prefill, then model-only greedy CFG steps."""
    from transformers import DynamicCache

    from uniweave.rollout.lean_step import lean_step

    inner, step = model.model, lean_step(model)
    tokens = model.tokens
    device = next(model.parameters()).device
    n = ids.shape[0]
    uncond = ids.clone()
    keep = (uncond == tokens.bos) | (uncond == tokens.boi)
    uncond[~keep] = tokens.pad
    x = torch.cat([ids, uncond]).to(device)
    keys = torch.cat([mask, mask]).bool().to(device)
    pos = (keys.long().cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = inner.language_model(
        input_ids=x, attention_mask=keys.long(), position_ids=pos, past_key_values=cache
    )
    hidden, nxt = out.last_hidden_state[:, -1], pos[:, -1:] + 1
    codes = []
    for _ in range(grid * grid):
        logits = inner.generation_head(hidden).float()
        cond, unc = logits[:n], logits[n:]
        code = (unc + W * (cond - unc)).argmax(-1)
        codes.append(code)
        embeds = inner.generation_aligner(inner.generation_embeddings(torch.cat([code, code])))
        keys = torch.cat([keys, keys.new_ones(2 * n, 1)], 1)
        hidden = step(embeds[:, None], keys, nxt, cache)[:, -1]
        nxt = nxt + 1
    return torch.stack(codes, 1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--grid", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bare", action="store_true", help="add the bare_loop ceiling runner")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    corpus = texts(max(args.images))
    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyJanusSpec(grid=args.grid, hidden_size=64, initializer_range=0.2)
        ckpt = write_tiny_checkpoint(tmp, spec, corpus)
        model = JanusProModel.from_pretrained(ckpt).eval().to(args.device)
        hf = JanusForConditionalGeneration.from_pretrained(str(ckpt)).eval().to(args.device)
    hf.generation_config.generation_kwargs = {"boi_token_id": model.tokens.boi}
    results = {}
    for n in args.images:
        prompts = corpus[:n]
        ids, mask = hf_inputs(model, prompts, args.grid)
        runners = {
            "hf_generate": lambda ids=ids, mask=mask: run_hf(hf, ids, mask),
            "engine_static": lambda p=prompts: run_engine(model, p, args.grid, None),
            "engine_continuous": lambda p=prompts, n=n: run_engine(model, p, args.grid, 2 * n),
        }
        if args.bare:
            runners["bare_loop"] = lambda ids=ids, mask=mask: run_bare(model, ids, mask, args.grid)
        times: dict[str, list[float]] = {k: [] for k in runners}
        outputs = {}
        for _ in range(args.repeats):
            for key, fn in runners.items():
                t0 = time.perf_counter()
                outputs[key] = fn()
                times[key].append(time.perf_counter() - t0)
        same = all(outputs[k] == outputs["hf_generate"] for k in runners)
        tokens = n * args.grid * args.grid
        tps = {k: tokens / statistics.median(v) for k, v in times.items()}
        print(
            f"\n[t2i] {n} images of {args.grid}x{args.grid} codes, CFG w={W:g}, greedy, "
            f"threads {torch.get_num_threads()}, repeats {args.repeats}; "
            f"identical codes: {same}; distinct codes {len({c for r in outputs['hf_generate'] for c in r})}"
        )
        for key in runners:
            ms = statistics.median(times[key]) * 1e3
            print(f"  {key:18s} {ms:9.1f} ms  {tps[key]:8.0f} tok/s")
        ratio = tps["engine_continuous"] / tps["hf_generate"]
        print(f"  engine_continuous / hf_generate: {ratio:.2f}x")
        print(
            f"  engine_static / hf_generate:     {tps['engine_static'] / tps['hf_generate']:.2f}x"
        )
        if model.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(model.device) / 2**20
            print(f"  peak GPU memory so far: {peak:.0f} MiB")
        if not same:
            raise SystemExit("engine and generate disagree on the codes: not a like-for-like run")
        results[f"t2i_{n}"] = ratio
        if args.bare:
            results[f"bare_{n}"] = tps["bare_loop"] / tps["hf_generate"]
    print("result: " + " ".join(f"{k}={v:.2f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
