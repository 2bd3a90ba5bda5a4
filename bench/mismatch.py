"""Rollout-vs-replay log-prob mismatch by precision (issue 33 item 1's measurement).

For each model (the tiny digits model, VQ head; a Janus-shaped tiny checkpoint,
`TinyJanusSpec` / `write_tiny_checkpoint`) the rollout engine samples text-to-image rows
with classifier-free guidance w (default 5, and 1 = off; `rollout.guidance`), exact H*W
images; then
`replay_logprobs` re-scores the same tokens teacher-forced under the same policy. With
Δ_t = ℓ_replay − ℓ_rollout at every sampled position (`mismatch_delta`), the table gives:

- token |Δ| quantiles (p50, p90, p99, max) over all sampled positions of the batch;
- token K3 (`k3_mismatch`: mean of exp(Δ) − Δ − 1, the per-token KL estimate);
- sequence K3 (`sequence_k3`: exp(δ) − δ − 1 of δ = Σ_t Δ_t per row; mean and max).

Modes (rollout / replay): fp32/fp32; bf16/fp32 and bf16/bf16: the engine's
`precision="bf16"` (`rollout.precision: bf16`, CPU autocast to bfloat16: matmuls in
bf16, weights kept fp32), the replay in fp32 or under the same autocast;
bf16w/fp32: the rollout runs a bfloat16 copy of the weights (bf16 weights and compute).
Sampled tokens come from the rollout, so every mode scores its own rows.

    .venv/bin/python bench/mismatch.py [--rows 32] [--guidance 5 1] [--threads 2]

`--grpo-run`: instead of the table, one GRPO run on digits T2I
(recipes/digits/grpo_t2i_vq.yaml, shortened by --updates / --batch) with bf16 rollouts
(`rollout.precision: bf16`, fp32 replay and training), once without and once with the
guards (`algorithm.mismatch.percentile` and `replay_bound`, --percentile / --bound), from
the same start: the recipe's short t2i SFT (trained here first, ~1 min, unless --start
names a model directory). Each run is `bench/grpo_learning.py` (held-out test before and
after, drift/noise of the per-update reward, docs/numerics.md §12); the closing table adds
the run means of the logged mismatch (`mismatch/abs_dlogp_p90`, `mismatch/k3`), of the
guards' masked share of actions (`mismatch/masked_share`, both guards) and of the replay
bound's masked share of rows (`mismatch/bound_masked_row_share`).

    .venv/bin/python bench/mismatch.py --grpo-run [--updates 60] [--batch 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from uniweave.algorithms.grpo import k3_mismatch, mismatch_delta, sequence_k3
from uniweave.codecs import build_codec
from uniweave.core.sample import GenerationRequest, Sample, TextPart
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.digits import make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.data.tokenizer import build_tokenizer
from uniweave.models.janus_pro.model import JanusProModel
from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.replay import replay_logprobs
from uniweave.rollout import RolloutEngine, RolloutRequest, SamplingParams

JANUS_TEXTS = [f"draw the digit {d} in red on a dark square" for d in range(10)]


def tiny_model() -> tuple[TinyUnifiedModel, list[RolloutRequest], tuple[int, int]]:
    codec = build_codec("vq", codebook_size=32, n_init=1, max_iter=10)
    codec.fit(load_split("train").images[:300], seed=0)
    torch.manual_seed(0)
    config = TinyArchitecture(visual_head="vq", hidden_size=64, num_layers=2, num_heads=4,
                              intermediate_size=128, initializer_range=0.1)  # fmt: skip
    model = TinyUnifiedModel(config, build_tokenizer(), codec).eval()
    return model, make_task_samples("t2i", "val", 64, seed=1), codec.grid


def janus_model(root: str) -> tuple[JanusProModel, list[Sample], tuple[int, int]]:
    spec = TinyJanusSpec(initializer_range=0.2)
    path = write_tiny_checkpoint(root, spec, JANUS_TEXTS)
    model = JanusProModel.from_pretrained(path).eval()
    g = (spec.grid, spec.grid)
    samples = [
        Sample(f"j{k}", [TextPart(JANUS_TEXTS[k % 10]), GenerationRequest(*g)], task="t2i")
        for k in range(64)
    ]
    return model, samples, g


def requests(samples, grid, rows: int, guidance: float) -> list[RolloutRequest]:
    params = SamplingParams(guidance=guidance, max_new_tokens=grid[0] * grid[1],
                            length_semantics="exact")  # fmt: skip
    return [RolloutRequest(samples[k % len(samples)], 1000 + k, params, image_grid=grid)
            for k in range(rows)]  # fmt: skip


def autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else nullcontext()


def measure(model, reqs, rollout: str, replay: str) -> dict[str, float]:
    sampler = model
    if rollout == "bf16w":
        sampler = copy.deepcopy(model).to(torch.bfloat16)
    precision = "bf16" if rollout == "bf16" else "fp32"  # rollout.precision
    trajs = RolloutEngine(sampler, precision=precision).generate(reqs)
    batch = TrajectoryBatch.collate(trajs, model.special_ids.pad)
    with torch.no_grad(), autocast(replay == "bf16"):
        replayed = replay_logprobs(model, batch, batch.sampling).logp
    mask = batch.policy_mask
    delta = mismatch_delta(replayed, batch.rollout_logp.double(), mask)
    absd = delta.abs()[mask.bool()]
    q = torch.quantile(absd, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    seq = sequence_k3(delta, mask)
    return {
        "p50": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": float(absd.max()),
        "tok_k3": float(k3_mismatch(batch.rollout_logp.double(), replayed.double(), mask)),
        "seq_k3": float(seq.mean()),
        "seq_k3_max": float(seq.max()),
        "n": int(mask.sum()),
    }


GRPO_RECIPE = "recipes/digits/grpo_t2i_vq.yaml"
SFT_RECIPE = "recipes/digits/sft_vq.yaml"
SFT_SHORT = ["data.tasks=[t2i]", "data.task_weights=null", "trainer.total_updates=80"]


def grpo_run(args: argparse.Namespace) -> None:
    """The bf16-rollout GRPO comparison of the module docstring."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from grpo_learning import main as learning

    from uniweave.config import load_config
    from uniweave.train.engine.metrics import read_metrics
    from uniweave.train.run import run_train

    work = Path(args.workdir or tempfile.mkdtemp(prefix="uniweave-mismatch-"))
    start = args.start
    if start is None:
        sft = work / "sft"
        t0 = time.perf_counter()
        run_train(load_config(SFT_RECIPE, [*SFT_SHORT, f"run.output_dir={sft}",
                                           "logging.progress_bar=false"]))  # fmt: skip
        print(f"start: {SFT_RECIPE} {' '.join(SFT_SHORT)} ({time.perf_counter() - t0:.0f} s)")
        start = str(sft / "model")
    common = [f"model.path={start}", "rollout.precision=bf16",
              f"trainer.total_updates={args.updates}", f"trainer.global_batch_size={args.batch}",
              f"trainer.micro_batch_size={args.batch}", "logging.progress_bar=false"]  # fmt: skip
    guards = [f"algorithm.mismatch.percentile={args.percentile}",
              f"algorithm.mismatch.replay_bound={args.bound}"]  # fmt: skip
    rows = []
    for name, extra in (("unguarded", []), ("guarded", guards)):
        run_dir = work / name
        overrides = [*common, *extra, f"run.output_dir={run_dir}"]
        print(f"\n== {name}: {GRPO_RECIPE} {' '.join(overrides)}", flush=True)
        code = learning([GRPO_RECIPE, *overrides, "--fresh", f"--threads={args.threads}"])
        if code:
            raise SystemExit(code)
        result = json.loads((run_dir / "learning.json").read_text())
        curve = read_metrics(run_dir / "metrics.jsonl")
        keys = ("mismatch/abs_dlogp_p90", "mismatch/k3", "mismatch/masked_share",
                "mismatch/bound_masked_row_share")  # fmt: skip
        means = [sum(r.get(k, 0.0) for r in curve) / len(curve) for k in keys]
        before, after = result["held_out_before_after"]["t2i/score"]
        rows.append((name, result, before, after, *means))
    print(
        f"\nGRPO digits T2I, bf16 rollouts / fp32 replay, {args.updates} updates x "
        f"{args.batch} rows; guards: percentile {args.percentile}, replay_bound {args.bound}"
    )
    head = (
        f"{'run':<11}{'reward first-10':>16}{'last-10':>9}{'drift':>8}{'noise':>8}"
        f"{'d/n':>7}{'test score':>17}{'|Δ| p90':>10}{'K3':>10}{'masked':>8}{'rows':>7}"
        f"{'wall':>7}"
    )
    print(head)
    print("-" * len(head))
    for name, r, before, after, p90, k3, masked, bound_rows in rows:
        print(f"{name:<11}{r['first_mean']:>16.3f}{r['last_mean']:>9.3f}{r['drift']:>+8.3f}"
              f"{r['noise']:>8.3f}{r['ratio']:>7.2f}{before:>8.3f} -> {after:.3f}"
              f"{p90:>10.2e}{k3:>10.2e}{masked:>8.3f}{bound_rows:>7.3f}{r['wall_seconds']:>6.0f}s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--guidance", type=float, nargs="+", default=[5.0, 1.0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--grpo-run", action="store_true", help="the GRPO comparison instead")
    ap.add_argument("--updates", type=int, default=60, help="--grpo-run: updates per run")
    ap.add_argument("--batch", type=int, default=64, help="--grpo-run: rows per update")
    ap.add_argument("--percentile", type=float, default=90.0, help="--grpo-run guard")
    ap.add_argument("--bound", type=float, default=1.002, help="--grpo-run replay_bound")
    ap.add_argument("--start", help="--grpo-run: start model directory (default: train one)")
    ap.add_argument("--workdir", help="--grpo-run: where the runs go (default: a temp dir)")
    args = ap.parse_args()
    if args.grpo_run:
        grpo_run(args)
        return
    torch.set_num_threads(args.threads)
    modes = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"), ("bf16w", "fp32")]
    head = (f"{'model':<12}{'w':>4}  {'rollout/replay':<16}{'|Δ| p50':>10}{'p90':>10}{'p99':>10}"
            f"{'max':>10}{'tok K3':>10}{'seq K3':>10}{'seq K3 max':>11}{'tokens':>8}")  # fmt: skip
    print(f"T2I rows: {args.rows} per line, exact-length images; w: CFG weight (1 = off)")
    print(head)
    print("-" * len(head))
    with tempfile.TemporaryDirectory() as root:
        for name, build in (("tiny-vq", lambda: tiny_model()),
                            ("janus-tiny", lambda: janus_model(root))):  # fmt: skip
            model, samples, grid = build()
            for w, (rollout, replay) in [(w, m) for w in args.guidance for m in modes]:
                reqs = requests(samples, grid, args.rows, w)
                t0 = time.perf_counter()
                m = measure(model, reqs, rollout, replay)
                print(f"{name:<12}{w:>4g}  {rollout + '/' + replay:<16}{m['p50']:>10.2e}{m['p90']:>10.2e}"
                      f"{m['p99']:>10.2e}{m['max']:>10.2e}{m['tok_k3']:>10.2e}"
                      f"{m['seq_k3']:>10.2e}{m['seq_k3_max']:>11.2e}{m['n']:>8}"
                      f"   ({time.perf_counter() - t0:.1f}s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
