"""`rollout.assignment: dynamic` (uniweave.rollout.queue) against static, gloo on CPU.

In W = 1, 2 and 3 spawned processes (a DDP process group, as torchrun sets it up), each
rank builds what `uniweave train` builds for a GRPO config (t2i, 2 prompts x G = 4: 8 rows,
uneven on 3 ranks) and for an OPD config (t2i and i2t_mc prompts: rows of different
prepared lengths), once per assignment, and runs one update. Dynamic claims one row at
a time (rollout.batch_size 1) from the job's TCPStore. Checked, bitwise (no tolerance:
the same rows, with the same per-row seeds, are sampled and scored by a deterministic
engine whatever rank runs them, then gathered back into the same order, so the update
is the same computation): the gathered trajectories (tokens, rollout log-probs,
advantages) and the updated parameters; that the ranks' claims partition the batch,
each rank's longest first; and, for OPD, that dynamic really assigned rows differently
from round-robin (the longest row is not among the first W). A third GRPO arm claims two
rows at a time and decodes each claim with continuous batching (`rollout.
continuous_batching`, 2 slots): its tokens, codes, advantages and update equal static's
bitwise, its rollout log-probs within the batch-geometry bound of
tests/test_continuous_batching.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from trainer_helpers import grpo_config, opd_config, run_cli, tiny_config, write_config

from uniweave.config import ConfigError, validate_config
from uniweave.rollout.queue import longest_first, round_robin

pytestmark = pytest.mark.usefixtures("one_thread")


ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _worker(rank: int, world: int, port: int, configs: dict, out: str) -> None:
    torch.set_num_threads(1)
    values = (str(rank), str(rank), str(world), "127.0.0.1", str(port))
    os.environ.update(dict(zip(ENV, values)))
    from uniweave.train.distributed.comm import init_distributed, shutdown_distributed
    from uniweave.train.engine.trainer import Trainer
    from uniweave.train.run import JOBS, _prepare_model

    info, device = init_distributed(torch.device("cpu"), "ddp", 120.0)
    try:
        for name, raw in configs.items():
            cfg = validate_config(raw)
            run_dir = Path(cfg.run.output_dir)
            model = _prepare_model(cfg, run_dir, device)
            source, objective = JOBS[cfg.algorithm.name](cfg, model, run_dir, info)
            trainer = Trainer(model, source, objective, cfg, run_dir, info, model.special_ids.pad)
            trainer.step()
            service = source.service
            rows = source.global_batch(0)
            if name == "grpo-dynamic" and world == 2:
                _forced_claims(rank, source, rows)
            torch.save(
                {
                    "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "rows": [
                        (r.token_ids, r.visual_codes, r.rollout_logp, r.advantage) for r in rows
                    ],
                    "indices": service.last_indices,
                    "lengths": [service.prepared_length(q) for q in _requests(source)],
                },
                f"{out}/{name}-{rank}.pt",
            )
    finally:
        shutdown_distributed()


def _forced_claims(rank: int, source, rows: list) -> None:
    """Dynamic scoring where rank 0's claims equal its round-robin share and rank 1's do
    not: every rank must still join the gather (a rank-local test once let rank 0 skip
    it; the ranks' all_gather_object calls then paired up wrongly). The result: the
    same trajectories, in order, and the rewards the update's rollout scored."""
    from uniweave.train.onpolicy.scoring import score_sharded

    samples, _ = source.requests(0)
    share = round_robin(len(samples), rank, 2)
    claims = share if rank == 0 else share[::-1]
    assert claims != share or rank == 0
    local = [rows[i] for i in claims]
    trajs, result = score_sharded(
        source.service, source.rewards, source.model.parse_response, samples, local, claims
    )
    assert [t.token_ids.tolist() for t in trajs] == [t.token_ids.tolist() for t in rows]
    assert result.total.tolist() == source.rollout(0).rewards


def _requests(source) -> list:
    """The update-0 requests of a GRPO or OPD source (for their prepared lengths)."""
    if hasattr(source, "requests"):
        return source.requests(0)[1]
    from uniweave.core.seeding import seed_for
    from uniweave.rollout.request import RolloutRequest

    samples = source.prompt_sampler.prompts(0, source.n_prompts)
    return [
        RolloutRequest(s, seed_for(source.run_seed, 0, i, 0), source.params)
        for i, s in enumerate(samples)
    ]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def opd_assets(tmp_path_factory, small_vq_dir, classifier_dir):
    from uniweave.models.build import build_model

    root = tmp_path_factory.mktemp("opd_teacher")
    assets = {"clf": classifier_dir, "vq": small_vq_dir}
    build_model(validate_config(opd_config(root / "x", assets, seed=9))).save_pretrained(
        root / "teacher"
    )
    return {**assets, "teacher_vq": root / "teacher"}


def test_dynamic_equals_static_for_grpo_and_opd_at_1_2_3_ranks(
    tmp_path, small_vq_dir, classifier_dir, opd_assets
):
    configs = {}
    for assignment in ("static", "dynamic"):
        rollout = {"batch_size": 1, "assignment": assignment}
        trainer = {"total_updates": 1, "parallel": "ddp"}
        grpo = grpo_config(
            tmp_path / f"g-{assignment}",
            {"vq": small_vq_dir, "clf": classifier_dir},
            trainer=trainer,
        )
        grpo["rollout"] = {**grpo["rollout"], **rollout}
        opd = opd_config(tmp_path / f"o-{assignment}", opd_assets)
        opd["rollout"] = {**opd["rollout"], **rollout}
        opd["trainer"] = {**opd["trainer"], **trainer}
        configs[f"grpo-{assignment}"] = grpo
        configs[f"opd-{assignment}"] = opd
    # dynamic claims of 2 rows, each claim decoded with continuous batching in 2 slots,
    # against static on the same model without the conv prior (continuous batching needs
    # a KV-only cache)
    for name, rollout in (
        ("static_kv", {"batch_size": 1, "assignment": "static"}),
        ("dynamic_cb", {"batch_size": 2, "assignment": "dynamic", "continuous_batching": True}),
    ):
        cfg = grpo_config(
            tmp_path / f"g-{name}",
            {"vq": small_vq_dir, "clf": classifier_dir},
            trainer={"total_updates": 1, "parallel": "ddp"},
        )
        cfg["model"] = {**cfg["model"], "tiny": {**cfg["model"].get("tiny", {}), "mixer_kernel": 0}}
        cfg["rollout"] = {**cfg["rollout"], **rollout}
        configs[f"grpo-{name}"] = cfg
    for world in (1, 2, 3):
        out = tmp_path / f"w{world}"
        out.mkdir()
        args = (world, _port(), configs, str(out))
        if world == 1:  # in this process: one spawn fewer (the same torchrun-style group)
            saved = {k: os.environ.get(k) for k in ENV}
            try:
                _worker(0, *args)
            finally:
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        else:
            mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="spawn")
        for method in ("grpo", "opd"):
            static = [torch.load(out / f"{method}-static-{r}.pt") for r in range(world)]
            dynamic = [torch.load(out / f"{method}-dynamic-{r}.pt") for r in range(world)]
            where = f"{method} at {world} ranks"
            for s, d in zip(static, dynamic):
                assert len(s["rows"]) == len(d["rows"]) > 0, where
                for a, b in zip(s["rows"], d["rows"]):
                    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), where
                    assert (a[2] is None and b[2] is None) or torch.equal(a[2], b[2]), where
                    assert a[3] == b[3], where
                for key, value in s["params"].items():
                    assert torch.equal(value, d["params"][key]), (where, key)
            lengths = dynamic[0]["lengths"]
            n = len(lengths)
            claimed = [d["indices"] for d in dynamic]
            assert sorted(i for c in claimed for i in c) == list(range(n)), where
            order = longest_first(lengths)
            rank_of = {i: k for k, i in enumerate(order)}
            for c in claimed:  # each rank's claims come longest first
                assert [rank_of[i] for i in c] == sorted(rank_of[i] for i in c), where
            for r, s in enumerate(static):
                assert s["indices"] == round_robin(n, r, world), where
            if method == "opd" and world > 1:
                assert order[0] >= world, "the test needs a longest row outside the first W"
                assert any(c != round_robin(n, r, world) for r, c in enumerate(claimed)), where
        # continuous batching inside dynamic claims: the same tokens and codes, rollout
        # log-probs within a batch-geometry bound (a different key window and batch
        # neighbours reassociate float32 sums), and bitwise the same update (replay-anchored
        # GRPO reads rollout log-probs only for a metric)
        static = [torch.load(out / f"grpo-static_kv-{r}.pt") for r in range(world)]
        cb_runs = [torch.load(out / f"grpo-dynamic_cb-{r}.pt") for r in range(world)]
        where = f"grpo dynamic+continuous at {world} ranks"
        claimed = [d["indices"] for d in cb_runs]
        assert sorted(i for c in claimed for i in c) == list(range(8)), where
        for s, d in zip(static, cb_runs):
            assert len(s["rows"]) == len(d["rows"]) > 0, where
            for a, b in zip(s["rows"], d["rows"]):
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), where
                # bound: NOT DERIVED: 1e-4, the estimate test_continuous_batching used before it took rollout_fixtures.logp_bounds (the workers' saved rows carry no model to bound with)
                assert torch.allclose(a[2], b[2], rtol=0, atol=1e-4), where
                assert a[3] == b[3], where
            for key, value in s["params"].items():
                assert torch.equal(value, d["params"][key]), (where, key)


def test_dynamic_assignment_refusals(tmp_path, small_vq_dir, classifier_dir):
    assets = {"vq": small_vq_dir, "clf": classifier_dir}
    cfg = grpo_config(tmp_path / "r", assets, rollout={"assignment": "dynamic", "workers": 2})
    with pytest.raises(ConfigError, match="not for Ray rollout workers"):
        validate_config(cfg)
    sft = {
        "model": {"kind": "tiny"},
        "rollout": {"assignment": "dynamic"},
        "run": {"output_dir": str(tmp_path / "s")},
    }
    with pytest.raises(ConfigError, match="acts only with rollouts in training"):
        validate_config(sft)


# -- distributed validation: the ranks share the evaluation queue ----------------------


def _eval_config(root: Path, vq: Path) -> dict:
    """Digits val rows of two tasks (3 each), 2 sampled rollouts per row, engine batches
    of 2: 12 items, 6 claims."""
    return tiny_config(
        root,
        vq,
        data={"tasks": ["t2i", "i2t_mc"], "train_size": 8, "val_size": 3, "test_size": 0},
        rollout={"batch_size": 2, "max_new_tokens": 16},
        evaluation={"rollouts_per_sample": 2, "greedy": False},
    )


def _evaluate(raw: dict, out: Path, clf: Path, ranks=None) -> tuple:
    from uniweave.eval.runner import evaluate, split_config, weights_sha256
    from uniweave.models.build import build_model

    cfg = validate_config(raw)
    model = build_model(cfg).eval()
    committed: list = []
    summary = evaluate(
        split_config(cfg, "val"),
        model,
        out,
        per_task=3,
        classifier_dir=clf,
        stale="replace",
        ranks=ranks,
        committed=committed,
    )
    return summary, committed, weights_sha256(model)


def _eval_worker(rank: int, world: int, port: int, raw: dict, out: str, clf: str) -> None:
    torch.set_num_threads(1)
    values = (str(rank), str(rank), str(world), "127.0.0.1", str(port))
    os.environ.update(dict(zip(ENV, values)))
    from uniweave.train.distributed.comm import init_distributed, shutdown_distributed

    info, _ = init_distributed(torch.device("cpu"), "ddp", 120.0)
    try:
        ranks = (info.rank, info.world_size, info.cpu_group)
        result = _evaluate(raw, Path(out) / "eval", Path(clf), ranks)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        shutdown_distributed()


def _records(out: Path) -> list[dict]:
    lines = (out / "results.jsonl").read_text().splitlines()
    return sorted((json.loads(x) for x in lines), key=lambda r: (r["id"], r["member"]))


RESUME_TOL = 1e-6
"""A resumed evaluation's items are batched differently from the uninterrupted one's
(engine batches of `rollout.batch_size` consecutive items still to do), and the digits
classifier scores an image in float32 within its batch: its probability moves by a few
float32 ulps (2^-24 ~ 6e-8 relative, scores in [0, 1]); 1e-6 leaves a margin of ~16x.
Everything else in a record (tokens, answer, images, pass) must be equal."""


def _exact(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("total", "scores")}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out


def test_distributed_validation_equals_one_rank_and_resumes(tmp_path, small_vq_dir, classifier_dir):
    """2 ranks share a validation (dynamic claims from the job's store) and end with
    exactly one rank's records (every field, images included) and summary; a second
    2-rank evaluation into a directory holding part of the records (as a killed one
    leaves it: 5 whole records and a torn sixth) commits only the missing items."""
    raw = _eval_config(tmp_path / "run", small_vq_dir)
    one, committed_one, digest = _evaluate(raw, tmp_path / "one", classifier_dir)
    n = len(committed_one)
    assert n == 12
    expected = _records(tmp_path / "one")
    # a killed evaluation: the first 5 records, a torn sixth, the same weights and config
    partial = tmp_path / "partial" / "eval"
    partial.mkdir(parents=True)
    for name in ("config_hash", "weights_sha256"):
        (partial / name).write_text((tmp_path / "one" / name).read_text())
    lines = (tmp_path / "one" / "results.jsonl").read_text().splitlines(keepends=True)
    (partial / "results.jsonl").write_text("".join(lines[:5]) + lines[5][:40])
    shutil.copytree(tmp_path / "one" / "images", partial / "images")
    for name, out in (("fresh", tmp_path / "fresh"), ("resumed", tmp_path / "partial")):
        out.mkdir(exist_ok=True)
        args = (2, _port(), raw, str(out), str(classifier_dir))
        mp.start_processes(_eval_worker, args=args, nprocs=2, join=True, start_method="spawn")
        (summary, c0, d0), (none, c1, d1) = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
        assert d0 == d1 == digest, "the ranks evaluate the reference weights"
        assert none is None
        got = _records(out / "eval")
        if name == "fresh":  # the same engine batches as one rank: exactly equal
            assert summary == one and got == expected
        else:  # the 7 recomputed items form other batches: RESUME_TOL on the scores
            lines_now = (out / "eval" / "results.jsonl").read_text().splitlines(True)
            assert lines_now[:5] == lines[:5], "committed records are kept as they were"
            assert [_exact(r) for r in got] == [_exact(r) for r in expected]
            for a, b in zip(got, expected):
                assert a["total"] == pytest.approx(b["total"], abs=RESUME_TOL)
                assert a["scores"] == pytest.approx(b["scores"], abs=RESUME_TOL)
            assert _flat(summary) == pytest.approx(_flat(one), abs=RESUME_TOL)
        done = set(c0) | set(c1)
        assert not set(c0) & set(c1), "an item committed by two ranks"
        assert c0 and c1, f"{name}: both ranks claimed work ({len(c0)}, {len(c1)})"
        if name == "fresh":
            assert len(done) == n
        else:  # exactly the 7 items without a whole record were recomputed
            first5 = {(json.loads(x)["id"], json.loads(x)["member"]) for x in lines[:5]}
            assert len(done) == n - 5 and not done & first5


def test_ddp_training_validates_on_every_rank(tmp_path, small_vq_dir, classifier_dir):
    """`uniweave train` with trainer.world_size 2 (ddp) and eval_every 1: both workers run the
    validation (the trainer calls the shared evaluator on every rank, rank 0 logs), and
    its records and logged metrics equal one process evaluating the exported model."""
    from safetensors.torch import load_file

    from uniweave.eval.runner import evaluate, split_config, task_metrics, weights_sha256
    from uniweave.models.build import build_model

    plugins = [
        {"name": "digit_classifier", "path": str(classifier_dir), "tasks": ["t2i"]},
        {"name": "mc_exact", "tasks": ["i2t_mc"]},
    ]
    raw = _eval_config(tmp_path / "run", small_vq_dir)
    raw["data"]["val_size"] = 2
    raw["reward"] = {"plugins": plugins}
    raw["trainer"] |= {"total_updates": 1, "parallel": "ddp", "world_size": 2, "eval_every": 1}
    raw["checkpoint"] = {"every_updates": 0}
    proc = run_cli(["train", str(write_config(tmp_path / "c.yaml", raw))])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    val = run / "evals" / "val-update-000001"
    cfg = validate_config(raw)
    model = build_model(cfg).eval()
    model.load_state_dict(load_file(str(run / "model" / "model.safetensors")))
    assert (val / "weights_sha256").read_text().strip() == weights_sha256(model)
    one = tmp_path / "one"
    summary = evaluate(split_config(cfg, "val"), model, one, per_task=2, stale="replace")
    assert _records(val) == _records(one) and len(_records(one)) == 8
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    metrics = {k[4:]: v for k, v in logged[-1].items() if k.startswith("val/")}
    expected = task_metrics(summary)
    assert expected and {k: metrics.get(k) for k in expected} == expected
    assert {"loss", "loss_text"} <= metrics.keys(), "rank 0 adds SFT's validation losses"
