"""Seconds per GRPO update: uniweave's trainer vs TRL's `GRPOTrainer`, like for like.

Both sides train their own copy of one model: the tiny model's transformers `LlamaModel`
body (no conv prior) and its text head (for TRL wrapped as a `LlamaForCausalLM` that
holds that very body and head), with the same initial weights, digits tokenizer, text-only
ChatML prompts (identical token ids, checked), reward function, group size G, prompts per
update P, max new tokens, learning rate, AdamW settings, grad clip 1.0, temperature 1, no
top-k/top-p, and no reference model (beta 0 / `kl.type: none`). One optimizer step per
generation on both sides, one forward/backward over all P·G completions (TRL:
`per_device_train_batch_size` = P·G; uniweave: `micro_batch_size` = P·G), and no separate
old-log-prob pass on either (TRL: `num_iterations` 1 aligned with the step; uniweave:
`old_logp_source: replay`, one update per batch, so the ratio is 1 by construction in both).
Token-mean aggregation over the global batch (TRL's default `dapo`, uniweave's
`token_mean`), group-normalised advantages (sample std). TRL runs its default
transformers `generate` path.

Alternation in one process: a TRL trainer callback times each TRL step (on_step_begin ..
on_step_end) and, at the end of each step, runs one update of each uniweave variant on the
prompts TRL just used (the variants' order alternates step by step). Each variant trains
its own copy of the initial weights: "shared" prefills each distinct prompt once in the
rollout (the engine's default) and runs it once in the update's replay
(`algorithm.share_prompt_prefix`); "unshared" runs every row on its own in both (the A/B
baseline; TRL, too, runs every row on its own). The first `--warmup` steps are dropped. Printed: median
wall seconds and CPU seconds per update for each side, the ratios uniweave / TRL, the mean
generated length on all sides (random init: most rows run to the cap), and the phase
splits.

    OMP_NUM_THREADS=1 .venv/bin/python bench/grpo_vs_trl.py [--prompts 16 4] [--group 8]
        [--max-new-tokens 20] [--updates 6] [--warmup 2] [--threads 1]
        [--variants shared unshared]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from transformers import LlamaForCausalLM, TrainerCallback

from uniweave.algorithms.grpo import group_advantages
from uniweave.codecs import build_codec
from uniweave.config import validate_config
from uniweave.config.algorithms import GRPOConfig as UniweaveGRPOConfig
from uniweave.core.sample import Sample
from uniweave.core.seeding import seed_for
from uniweave.data.digits import TASKS, make_task_samples
from uniweave.data.digits_images import load_split
from uniweave.data.template import serialize
from uniweave.data.tokenizer import SpecialIds, build_tokenizer
from uniweave.models.tiny import TinyArchitecture, TinyUnifiedModel
from uniweave.rollout import RolloutRequest, RolloutService, SamplingParams
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.grpo.objective import GRPOObjective

LR = 1e-4


def reward_of(ids: list[int], digit_ids: frozenset[int]) -> float:
    """The shared reward: the fraction of completion tokens that are digit words."""
    return sum(t in digit_ids for t in ids) / max(len(ids), 1)


def text_prompts(tokenizer, n: int) -> list[Sample]:
    """Text-only prompts: every digits task's question with its image parts removed."""
    out = []
    for task in TASKS:
        for s in make_task_samples(task, "train", n, seed=0):
            parts = [p for p in s.prompt_parts if getattr(p, "text", None) is not None]
            if parts:
                out.append(Sample(s.id, parts, s.answer, s.task))
    return out


def build_model(args: argparse.Namespace) -> TinyUnifiedModel:
    tokenizer = build_tokenizer()
    codec = build_codec("vq", codebook_size=32, n_init=1, max_iter=5)
    codec.fit(load_split("train").images[:200])
    torch.manual_seed(0)
    config = TinyArchitecture(
        hidden_size=args.width,
        num_layers=args.layers,
        num_heads=args.width // 48 if args.width % 48 == 0 else max(1, args.width // 64),
        intermediate_size=args.width * 8 // 3,
        mixer_kernel=0,
    )
    return TinyUnifiedModel(config, tokenizer, codec).train()


@dataclass
class Timings:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    lengths: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases.setdefault(name, []).append(seconds)


class UniweaveSide:
    """uniweave's GRPO update: rollout service -> reward -> group advantages -> the shared
    trainer's step with the GRPO objective (one micro-batch of P·G rows)."""

    def __init__(
        self,
        model: TinyUnifiedModel,
        args: argparse.Namespace,
        run_dir: str,
        phase: Callable[[str], AbstractContextManager] = lambda name: nullcontext(),
        share: bool = True,
    ) -> None:
        self.phase = phase
        n = args.n_prompts * args.group
        cfg = validate_config(
            {
                "run": {"name": "bench", "seed": 0, "output_dir": run_dir, "device": "cpu"},
                "model": {"kind": "tiny", "tiny": {"mixer_kernel": 0}},
                "algorithm": {
                    "name": "grpo",
                    "group_size": args.group,
                    "kl": {"type": "none"},
                    "old_logp_source": "replay",
                    "eps": 1e-4,
                    "share_prompt_prefix": share,
                },
                "trainer": {
                    "optimizer": {"lr": LR},
                    "global_batch_size": n,
                    "micro_batch_size": n,
                    "grad_clip": 1.0,
                },
                "logging": {"tensorboard": False, "progress_bar": False},
                # Validation asks for a plugin; this bench scores rows with `reward_of`
                # (the function TRL gets), not with the reward service.
                "reward": {"plugins": [{"name": "mc_exact"}]},
            }
        )
        self.algo: UniweaveGRPOConfig = cfg.algorithm
        self.model = model
        self.group = args.group
        self.params = SamplingParams(
            max_new_tokens=args.max_new_tokens, cycle_max_period=0, on_invalid_header="text"
        )
        self.service = RolloutService(model, batch_size=n)
        self.service.engine.share_prefill = share
        self.digit_ids = args.digit_ids
        self.batch: list = []
        self.trainer = Trainer(
            model, self, GRPOObjective(self.algo, None), cfg, run_dir, DistInfo(), args.pad
        )
        self.timings = Timings()

    # BatchSource
    def global_batch(self, update: int) -> list:
        return self.batch

    def batch_metrics(self, update: int) -> dict[str, float]:
        return {}

    def update(self, prompts: list[Sample], update: int) -> None:
        w0, c0 = time.perf_counter(), time.process_time()
        with self.phase("rollout"):
            requests = [
                RolloutRequest(p.fork(m), seed_for(0, update, i, m), self.params)
                for i, p in enumerate(prompts)
                for m in range(self.group)
            ]
            trajs = self.service.generate(requests)
        w1 = time.perf_counter()
        with self.phase("reward+advantages"):
            rewards = [reward_of(t.token_ids[_plen(t) :].tolist(), self.digit_ids) for t in trajs]
            adv, _ = group_advantages(
                torch.tensor(rewards, dtype=torch.float64),
                self.group,
                std_ddof=self.algo.std_ddof,
                eps=self.algo.eps,
            )
            for t, a in zip(trajs, adv.tolist()):
                t.advantage = a
            self.batch = trajs
        w2 = time.perf_counter()
        with self.phase("update (fwd+bwd+AdamW)"):
            self.trainer.step()
            self.trainer.update += 1
        w3, c3 = time.perf_counter(), time.process_time()
        t = self.timings
        t.wall.append(w3 - w0)
        t.cpu.append(c3 - c0)
        t.lengths.append(statistics.mean(len(x) - _plen(x) for x in trajs))
        t.add_phase("rollout", w1 - w0)
        t.add_phase("reward+advantages", w2 - w1)
        t.add_phase("old log-probs", 0.0)
        t.add_phase("update (fwd+bwd+AdamW)", w3 - w2)


def _plen(traj) -> int:
    return int(traj.sampling.prompt_length)


class Alternate(TrainerCallback):
    """Times each TRL step and runs one uniweave update after it, on TRL's prompts."""

    def __init__(
        self,
        uniweave: dict[str, UniweaveSide],
        by_text: dict[str, Sample],
        generate_seconds: list[float],
    ) -> None:
        self.uniweave, self.by_text = uniweave, by_text
        self.generate_seconds = generate_seconds
        self.generate_mark = 0
        self.trl = Timings()
        self.step_prompts: list[str] = []
        self.step_lengths: list[int] = []
        self._t0 = (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_prompts, self.step_lengths = [], []
        self.generate_mark = len(self.generate_seconds)
        self._t0 = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        w, c = time.perf_counter() - self._t0[0], time.process_time() - self._t0[1]
        self.trl.wall.append(w)
        self.trl.cpu.append(c)
        self.trl.lengths.append(statistics.mean(self.step_lengths))
        gen = sum(self.generate_seconds[self.generate_mark :])
        self.trl.add_phase("generate (transformers)", gen)
        self.trl.add_phase("rest (scoring, loss, backward, AdamW)", w - gen)
        unique = list(dict.fromkeys(self.step_prompts))
        sides = list(self.uniweave.values())
        if state.global_step % 2:  # alternate which uniweave variant runs first
            sides.reverse()
        for side in sides:
            side.update([self.by_text[p] for p in unique], state.global_step)


def run(args: argparse.Namespace) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = build_model(args)
    tok = model.tokenizer
    sp = SpecialIds.from_tokenizer(tok)
    args.pad = sp.pad
    vocab = tok.get_vocab()
    args.digit_ids = frozenset(i for w, i in vocab.items() if w.isdigit())
    hf = LlamaForCausalLM(model.decoder.config)
    twin = copy.deepcopy(model)
    hf.model, hf.lm_head = twin.decoder, twin.text_head
    hf.generation_config.eos_token_id = sp.eos
    hf.generation_config.pad_token_id = sp.pad
    hf.train()
    generate_seconds: list[float] = []
    hf_generate = hf.generate

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        out = hf_generate(*a, **k)
        generate_seconds.append(time.perf_counter() - t0)
        return out

    hf.generate = timed_generate  # observation only: TRL's own call, timed

    samples = text_prompts(tok, 64)
    by_text: dict[str, Sample] = {}
    for s in samples:
        ids = serialize(s, tok, add_generation_prompt=True).token_ids.tolist()
        text = tok.decode(ids)
        if tok(text)["input_ids"] != ids:
            raise SystemExit(f"prompt {s.id!r} does not round-trip: not like for like")
        by_text[text] = s
    dataset = Dataset.from_dict({"prompt": list(by_text)})

    lengths: list[int] = []

    def reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
        cb.step_prompts.extend(prompts)
        cb.step_lengths.extend(len(c) for c in completion_ids)
        lengths.extend(len(c) for c in completion_ids)
        return [reward_of(c, args.digit_ids) for c in completion_ids]

    n = args.n_prompts * args.group
    with tempfile.TemporaryDirectory() as tmp:
        start = copy.deepcopy(model)
        uniweave = {
            variant: UniweaveSide(
                model if k == 0 else copy.deepcopy(start),
                args,
                f"{tmp}/uniweave_{variant}",
                share=variant == "shared",
            )
            for k, variant in enumerate(args.variants)
        }
        cb = Alternate(uniweave, by_text, generate_seconds)
        config = GRPOConfig(
            output_dir=f"{tmp}/trl",
            per_device_train_batch_size=n,
            num_generations=args.group,
            max_completion_length=args.max_new_tokens,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            optim="adamw_torch",
            max_grad_norm=1.0,
            beta=0.0,
            epsilon=0.2,
            loss_type="dapo",
            scale_rewards="group",
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_steps=args.warmup + args.updates,
            logging_steps=10**6,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            disable_tqdm=True,
            seed=0,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=hf,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[cb],
        )
        trainer.train()
    report(args, cb.trl, {k: side.timings for k, side in uniweave.items()})


def med(xs: list[float], skip: int) -> float:
    return statistics.median(xs[skip:])


def report(args: argparse.Namespace, trl: Timings, uniweave: dict[str, Timings]) -> None:
    k = args.warmup
    print(
        f"\n[{args.n_prompts} prompts x G={args.group}] max_new_tokens {args.max_new_tokens}, "
        f"width {args.width}, layers {args.layers}, threads {torch.get_num_threads()}, "
        f"{len(trl.wall) - k} timed updates per side (after {k} warm-up)"
    )
    print(f"  {'':8s} {'wall s/update':>14s} {'CPU s/update':>13s} {'mean gen length':>16s}")
    sides = [("TRL", trl)] + [(f"uniweave {v}", t) for v, t in uniweave.items()]
    for name, t in sides:
        print(
            f"  {name:14s} {med(t.wall, k):8.3f} {med(t.cpu, k):13.3f} "
            f"{statistics.mean(t.lengths[k:]):16.2f}"
        )
    for v, t in uniweave.items():
        print(
            f"  ratio uniweave {v} / TRL: seconds per update {med(t.wall, k) / med(trl.wall, k):.2f}x"
            f", CPU seconds {med(t.cpu, k) / med(trl.cpu, k):.2f}x"
        )
    for side, t in sides:
        print(f"  {side} phases (median wall s):")
        for name, xs in t.phases.items():
            print(f"    {name:38s} {med(xs, k):8.3f}")
    print(
        "    (old log-probs: none, replay anchoring with one update per batch: the update's "
        "own forward is the ratio's denominator, as TRL's)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[16, 4])
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=["shared", "unshared"],
        default=["shared", "unshared"],
        help="uniweave variants, each on its own copy of the initial weights: shared = each "
        "prompt prefilled once in rollout and run once in the update's replay "
        "(algorithm.share_prompt_prefix); unshared = every row on its own",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for p in args.prompts:
        run(argparse.Namespace(**vars(args), n_prompts=p))


if __name__ == "__main__":
    main()
