"""`rollout.assignment: dynamic` (unirl.rollout.queue) against static, gloo on CPU.

In W = 1, 2 and 3 spawned processes (a DDP process group, as torchrun sets it up), each
rank builds what `unirl train` builds for a GRPO config (t2i, 2 prompts x G = 4: 8 rows,
uneven on 3 ranks) and for an OPD config (t2i and i2t_mc prompts: rows of different
prepared lengths), once per assignment, and runs one update. Dynamic claims one row at
a time (rollout.batch_size 1) from the job's TCPStore. Checked, bitwise (no tolerance:
the same rows, with the same per-row seeds, are sampled and scored by a deterministic
engine whatever rank runs them, then gathered back into the same order, so the update
is the same computation): the gathered trajectories (tokens, rollout log-probs,
advantages) and the updated parameters; that the ranks' claims partition the batch,
each rank's longest first; and, for OPD, that dynamic really assigned rows differently
from round-robin (the longest row is not among the first W).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from trainer_helpers import grpo_config, opd_config

from unirl.config import ConfigError, validate_config
from unirl.rollout.queue import longest_first, round_robin

pytestmark = pytest.mark.usefixtures("one_thread")


ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _worker(rank: int, world: int, port: int, configs: dict, out: str) -> None:
    torch.set_num_threads(1)
    values = (str(rank), str(rank), str(world), "127.0.0.1", str(port))
    os.environ.update(dict(zip(ENV, values)))
    from unirl.train.dist.comm import init_distributed, shutdown_distributed
    from unirl.train.engine.trainer import Trainer
    from unirl.train.run import JOBS, _prepare_model

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


def _requests(source) -> list:
    """The update-0 requests of a GRPO or OPD source (for their prepared lengths)."""
    if hasattr(source, "requests"):
        return source.requests(0)[1]
    from unirl.core.seeding import seed_for
    from unirl.rollout.request import RolloutRequest

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
    from unirl.train.engine.build import build_model

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
