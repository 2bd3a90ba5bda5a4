"""OPD under `trainer.parallel` ddp and fsdp2: 2 gloo processes on CPU (spawned with the
environment torchrun gives each worker, as tests/test_queues.py) against one process.

Each rank builds what `uniweave train` builds for a tiny OPD config (t2i + i2t_mc prompts;
privileged-correction routing against the answer-privileged teacher, failure GT replay,
necessity carriers: every path that reads the teacher) and runs 2 updates under ddp,
then under fsdp2; this process runs the same 2 updates with `parallel: none`. Checked:

- the student's parameters after 2 updates equal the one-process ones within
  `FP64_BOUND` (every tensor), and the update's loss within the same bound;
- under fsdp2 the teacher is sharded, not copied: every teacher parameter is a DTensor
  whose local shard holds about half its elements (`fully_shard` splits dim 0 into
  ceil(n / 2)-row pieces, so a rank holds between total/2 - rows and total/2 + rows),
  its shards on the two ranks add to the whole, and no teacher parameter requires a
  gradient or is in the optimizer.

Why FP64_BOUND = 1e-10 (and not bitwise). The runs are float64 end to end
(`trainer.precision: fp64`; the teacher follows the student's dtype), so the check
separates the algorithm (which rows' gradients are summed, divided by which global count)
from summation-order rounding. The rollouts are the same rows (per-row seeds, a
deterministic engine: rows equal bitwise whatever rank samples them, tests/test_queues.py),
and each row's loss term is computed from the same operands; what differs is only the
order in which the per-row gradient terms are added: within a rank's micro-batches, then
across ranks (the all-reduce / reduce-scatter SUM), versus one process's 4 micro-batches.
An element of the summed gradient then differs by at most k * u * S (k <= 4 partial sums,
u = 2^-53 ~ 1.1e-16, S the sum of the absolute per-row terms, <= ~10 with the loss a mean
over rows and grad_clip 1.0): ~4.4e-15. AdamW turns a gradient change dg into a step
change of at most lr * |dg| / eps (the worst case g ~ 0, where the step is
~lr * g / (|g| + eps)): 3e-3 * 4.4e-15 / 1e-6 ~ 1.3e-11 per update, ~3e-11 over 2 updates
(the second update's rollouts are the same rows again: the sampled tokens only move if a
~1e-11 change of the weights flips a sampling decision, which the equality of the losses
checks). The same derivation in float32 (u = 6e-8) gives ~1e-2, useless; hence float64.
A real error (a row counted on two ranks, a rank's count instead of the global one, a
teacher replicated and diverging) moves an element by ~lr = 3e-3.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from trainer_helpers import opd_config

from uniweave.config import validate_config

pytestmark = pytest.mark.usefixtures("one_thread")

FP64_BOUND = 1e-10
ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
UPDATES = 2


def config(run_dir: Path, assets: dict, mode: str) -> dict:
    """6 prompts + up to 2 GT rows per update, micro-batches of 2 rows: 4 per update in
    one process, 2 per rank at 2 ranks (accumulation acts under both wrappers)."""
    cfg = opd_config(
        run_dir,
        assets,
        routing="privileged_correction",
        gt_replay={"mode": "failure", "budget": 2},
        carriers="necessity",
    )
    cfg["algorithm"]["teacher"] = {"path": str(assets["teacher_vq"]), "privilege": "answer"}
    trainer = {
        **cfg["trainer"],
        "total_updates": UPDATES,
        "micro_batch_size": 2,
        "precision": "fp64",
        "optimizer": {"lr": 3e-3, "eps": 1e-6},
        "grad_clip": 1.0,
        "parallel": mode,
    }
    if mode == "fsdp2":
        trainer["fsdp"] = {"param_dtype": "fp64", "reduce_dtype": "fp64"}
    cfg["trainer"] = trainer
    cfg["checkpoint"] = {"every_updates": 0}
    return cfg


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run_updates(raw: dict, info) -> dict:
    """`UPDATES` updates of what `uniweave train` builds for `raw` on this rank: the
    student's full parameters, the losses, the rows trained on (token ids) and, per
    teacher parameter, (local elements, total elements, is a DTensor, requires grad)."""
    from uniweave.train.engine.trainer import Trainer
    from uniweave.train.run import JOBS, _prepare_model

    cfg = validate_config(raw)
    run_dir = Path(cfg.run.output_dir)
    model = _prepare_model(cfg, run_dir, torch.device("cpu"))
    source, objective = JOBS[cfg.algorithm.name](cfg, model, run_dir, info)
    trainer = Trainer(model, source, objective, cfg, run_dir, info, model.special_ids.pad)
    losses, rows = [], []
    for _ in range(UPDATES):
        losses.append(trainer.step()["loss"])
        rows.append([r.token_ids.clone() for r in source.global_batch(trainer.update)])
        trainer.update += 1
    in_opt = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    teacher = {
        name: (
            (p.to_local() if hasattr(p, "to_local") else p).numel(),
            p.numel(),
            hasattr(p, "to_local"),
            p.requires_grad or id(p) in in_opt,
        )
        for name, p in objective.teacher.named_parameters()
    }
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"params": params, "losses": losses, "rows": rows, "teacher": teacher}


def _worker(rank: int, world: int, port: int, configs: dict, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(dict(zip(ENV, (str(rank), str(rank), str(world), "127.0.0.1", str(port)))))
    from uniweave.train.distributed.comm import init_distributed, shutdown_distributed

    info, _ = init_distributed(torch.device("cpu"), "ddp", 120.0)
    try:
        for mode, raw in configs.items():
            torch.save(run_updates(raw, info), f"{out}/{mode}-{rank}.pt")
    finally:
        shutdown_distributed()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, small_vq_dir, classifier_dir):
    from uniweave.models.build import build_model

    root = tmp_path_factory.mktemp("opd_parallel_teacher")
    out = {"clf": classifier_dir, "vq": small_vq_dir}
    build_model(validate_config(opd_config(root / "x", out, seed=9))).save_pretrained(
        root / "teacher"
    )
    return {**out, "teacher_vq": root / "teacher"}


def test_opd_ddp_and_fsdp2_equal_one_process_and_fsdp2_shards_the_teacher(tmp_path, assets):
    from uniweave.train.distributed.comm import DistInfo

    reference = run_updates(config(tmp_path / "none", assets, "none"), DistInfo())
    assert all(not grad for _, _, _, grad in reference["teacher"].values())
    configs = {m: config(tmp_path / m, assets, m) for m in ("ddp", "fsdp2")}
    out = tmp_path / "out"
    out.mkdir()
    args = (2, _port(), configs, str(out))
    mp.start_processes(_worker, args=args, nprocs=2, join=True, start_method="spawn")
    for mode in ("ddp", "fsdp2"):
        ranks = [torch.load(out / f"{mode}-{r}.pt", weights_only=False) for r in range(2)]
        for got in ranks:
            # the same rows (the gathered global batch) on every rank, as in one process
            for want_rows, got_rows in zip(reference["rows"], got["rows"]):
                assert len(want_rows) == len(got_rows) > 0, mode
                for a, b in zip(want_rows, got_rows):
                    assert torch.equal(a, b), mode
            for want, value in zip(reference["losses"], got["losses"]):
                assert abs(want - value) <= FP64_BOUND, (mode, want, value)
            assert got["params"].keys() == reference["params"].keys(), mode
            for name, value in reference["params"].items():
                assert (value - got["params"][name]).abs().max() <= FP64_BOUND, (mode, name)
        teacher = [r["teacher"] for r in ranks]
        assert teacher[0].keys() == reference["teacher"].keys()
        for name, (local, total, is_dtensor, grad) in teacher[0].items():
            assert not grad, (mode, name)
            other = teacher[1][name]
            if mode == "ddp":  # a full copy per rank (ddp replicates)
                assert (local, is_dtensor) == (total, False), name
                continue
            assert is_dtensor and local + other[0] == total, name
        if mode == "fsdp2":
            local = [sum(v[0] for v in t.values()) for t in teacher]
            total = sum(v[1] for v in teacher[0].values())
            assert sum(local) == total
            print(f"fsdp2 teacher elements per rank: {local} of {total}")
            for held in local:  # about half each: dim-0 chunks of ceil(rows / 2)
                assert abs(held - total / 2) <= 0.05 * total, (held, total)
    # the run moved the weights (the comparison is not between two untouched models)
    from uniweave.models.build import build_model

    start = build_model(validate_config(config(tmp_path / "s", assets, "none"))).state_dict()
    moved = [(reference["params"][n] - start[n].double()).abs().max() for n in start]
    assert max(moved) > 1e-3
