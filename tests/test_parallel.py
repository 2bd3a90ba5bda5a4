"""`trainer.parallel` (ddp, fsdp2) under torchrun, 2 gloo processes on CPU: each equals
the one-process run after 3 updates (SFT on the tiny model, GRPO, SFT on a tiny
Janus-Pro); FSDP2 runs killed during a checkpoint write and during an update resume to
parameters and optimizer state bitwise equal to the uninterrupted 2-process run; a
desynchronised DDP replica is caught, by tensor name, before anything is committed; and
the settings that cannot work are refused at config time."""

from __future__ import annotations

import json
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tolerances import U_FP32, assert_within, elementwise_bound, sum_bound, tiny_decoder_reductions
from trainer_helpers import (
    assert_same_state,
    checkpoint_tensors,
    grpo_config,
    run_cli,
    tiny_config,
    write_config,
)

from uniweave.config import ConfigError, validate_config
from uniweave.data.digits import vocabulary_texts
from uniweave.models.janus_pro.tiny import TinyJanusSpec, write_tiny_checkpoint
from uniweave.train.distributed.comm import init_distributed

TORCHRUN = Path(sys.executable).parent / "torchrun"
MODES = ("none", "ddp", "fsdp2")
# The equivalence runs are float64 end to end (`trainer.precision: fp64`), so the check
# separates the algorithm (which gradients are summed, divided by which count) from
# reduction-order rounding. Bound, per element: ranks and micro-batches add the same
# per-row gradients in another order, so a gradient element differs by at most
# k * u * S (k <= 4 partial sums, u = 2^-53 ~ 1.1e-16, S = sum of the absolute per-row
# terms; with the loss a mean and grad_clip 1.0, S <= ~10). Adam turns a gradient change dg
# into a step change of at most lr * |dg| / eps (the worst case: g ~ 0, where the step is
# ~ lr * g / (|g| + eps)): 3e-3 * 4.4e-15 / 1e-6 ~ 1.3e-11 per update, ~4e-11 over 3
# updates (second-order effects through the changed weights are smaller still). In fp32
# the same bound is ~2e-2 (u = 6e-8): useless, which is why these runs are float64.
# A real error (a gradient summed twice, divided by a rank's count instead of the global
# one) moves an element by ~lr = 3e-3.
FP64_BOUND = 1e-10
TRAINER = {"total_updates": 3, "precision": "fp64", "optimizer": {"lr": 3e-3, "eps": 1e-6}}


def launch(cfg: dict, path: Path, mode: str, env: dict | None = None):
    """`uniweave train` of `cfg` with `trainer.parallel = mode`: one plain process for none,
    torchrun with 2 processes otherwise (fsdp2 gathers parameters in fp32 on CPU)."""
    trainer = {**cfg["trainer"], "parallel": mode}
    if mode == "fsdp2":
        dtype = "fp64" if trainer.get("precision") == "fp64" else "fp32"
        trainer["fsdp"] = {"param_dtype": dtype, "reduce_dtype": dtype}
    write_config(path, {**cfg, "trainer": trainer})
    launcher = None
    if mode != "none":
        launcher = [str(TORCHRUN), "--standalone", "--nproc-per-node=2", "-m", "uniweave.cli"]
    return run_cli(["train", str(path)], env_extra=env, launcher=launcher)


def run_modes(tmp: Path, make_cfg) -> dict[str, Path]:
    """Run `make_cfg(run_dir)` under every mode; the run directories."""
    out = {}
    for mode in MODES:
        out[mode] = tmp / mode
        proc = launch(make_cfg(out[mode]), tmp / f"{mode}.yaml", mode)
        assert proc.returncode == 0, (mode, proc.stderr[-3000:])
    return out


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def assert_modes_agree(runs: dict[str, Path], tol: float = FP64_BOUND) -> None:
    """ddp and fsdp2 final models within `tol` of the one-process model (every tensor),
    and the run actually moved the weights."""
    ref = final_model(runs["none"])
    first = load_file(
        str(next((runs["none"] / "checkpoints").glob("update-000000")) / "model.safetensors")
    )
    assert any((ref[k] - first[k]).abs().max() > 1e-3 for k in first)
    for mode in ("ddp", "fsdp2"):
        got = final_model(runs[mode])
        assert got.keys() == ref.keys(), mode
        for name, value in ref.items():
            assert (value - got[name]).abs().max() <= tol, (mode, name)


def dcp_state(ckpt: Path) -> dict:
    """A DCP checkpoint's model, optimizer and scheduler state as one plain dict."""
    model, rest = checkpoint_tensors(ckpt)
    return {"model": model, **rest}


@pytest.fixture(scope="module")
def codec_dir(small_vq_dir):
    return small_vq_dir


def sft_config(run_dir: Path, codec_dir: Path) -> dict:
    """Two micro-batches per rank (per update: 4 in one process), so ddp's `no_sync` and
    fsdp2's local accumulation both act."""
    trainer = {**TRAINER, "micro_batch_size": 2}
    return tiny_config(
        run_dir, codec_dir, trainer=trainer, checkpoint={"every_updates": 1, "keep_last": 0}
    )


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, codec_dir) -> dict[str, Path]:
    return run_modes(tmp_path_factory.mktemp("sft"), lambda d: sft_config(d, codec_dir))


@pytest.mark.slow
def test_sft_ddp_and_fsdp2_equal_one_process(sft_runs):
    assert_modes_agree(sft_runs)
    for mode in ("ddp", "fsdp2"):
        ckpt = sft_runs[mode] / "checkpoints" / "update-000003"
        assert sorted(p.name for p in (ckpt / "dcp").iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_ddp_and_fsdp2_equal_one_process(tmp_path, codec_dir, classifier_dir, lora):
    """GRPO with a k3 KL to the reference: a frozen copy (sharded under fsdp2), or with
    LoRA the adapters switched off; LoRA runs compare the adapters they checkpoint. Both
    to FP64_BOUND: lora_A's gradient is proportional to lora_B, zero at the start, so its
    first updates are Adam steps on tiny gradients, the worst case of the bound (g ~ 0)."""
    assets = {"vq": codec_dir, "clf": classifier_dir}
    trainer = {**TRAINER, **({"lora": {"enabled": True, "r": 4}} if lora else {})}

    def make(run_dir: Path) -> dict:
        return grpo_config(run_dir, assets, trainer=trainer, checkpoint={"every_updates": 0})

    runs = run_modes(tmp_path, make)
    if not lora:
        assert_modes_agree(runs)
        return
    last = "checkpoints/update-000003"
    ref = checkpoint_tensors(runs["none"] / last)[0]
    assert ref and all("lora_" in k for k in ref)
    for mode in ("ddp", "fsdp2"):
        got = checkpoint_tensors(runs[mode] / last)[0]
        assert got.keys() == ref.keys(), mode
        for name, value in ref.items():
            assert (value - got[name]).abs().max() <= FP64_BOUND, (mode, name)


@pytest.mark.slow
def test_janus_pro_sft_ddp_and_fsdp2_equal_one_process(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "janus", TinyJanusSpec(grid=2), vocabulary_texts())

    def make(run_dir: Path) -> dict:
        return {
            "run": {"name": "j", "seed": 0, "output_dir": str(run_dir), "device": "cpu"},
            "model": {"kind": "janus_pro", "path": str(ckpt)},
            "data": {"tasks": ["t2i", "i2t_mc"], "train_size": 8, "val_size": 0, "test_size": 0},
            "trainer": {**TRAINER, "global_batch_size": 8, "micro_batch_size": 2},
            "checkpoint": {"every_updates": 0},
            "logging": {"tensorboard": False, "progress_bar": False},
        }

    assert_modes_agree(run_modes(tmp_path, make))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["checkpoint_write:2", "after_update:2"])
def test_fsdp2_sigkill_resume_is_bitwise_exact(tmp_path, codec_dir, sft_runs, fault):
    run_dir = tmp_path / "killed"
    cfg = sft_config(run_dir, codec_dir)
    killed = launch(cfg, tmp_path / "k.yaml", "fsdp2", {"UNIWEAVE_FAULT": fault})
    assert killed.returncode != 0
    names = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert "update-000002" not in names
    if fault.startswith("checkpoint_write"):
        assert ".tmp-update-000002" in names  # every shard written, never sealed
    resumed = launch(cfg, tmp_path / "k.yaml", "fsdp2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    last = "checkpoints/update-000003"
    reference = dcp_state(sft_runs["fsdp2"] / last)
    final = dcp_state(run_dir / last)
    assert set(final) == {"model", "optim", "scheduler"}
    assert_same_state(reference, final, fault)
    assert_same_state(final_model(sft_runs["fsdp2"]), final_model(run_dir), fault)


@pytest.mark.slow
def test_a_desynchronised_ddp_replica_is_caught_before_any_commit(tmp_path, codec_dir):
    run_dir = tmp_path / "drift"
    name = "decoder.layers.1.mlp.up_proj.weight"
    cfg = sft_config(run_dir, codec_dir)
    proc = launch(cfg, tmp_path / "d.yaml", "ddp", {"UNIWEAVE_PERTURB": f"1:{name}"})
    assert proc.returncode != 0
    assert f"replica drift: parameter '{name}' differs on rank(s) [1]" in proc.stderr
    assert not list((run_dir / "checkpoints").glob("update-*"))


def test_settings_that_cannot_work_are_refused(tmp_path, codec_dir, monkeypatch):
    base = tiny_config(tmp_path / "r", codec_dir)
    for key, value in [("micro_token_budget", 256), ("eval_every", 1)]:
        with pytest.raises(ConfigError, match=f"trainer.{key}"):
            validate_config(
                {**base, "trainer": {**base["trainer"], "parallel": "fsdp2", key: value}}
            )
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="trainer.parallel=ddp needs torchrun"):
        init_distributed(torch.device("cpu"), "ddp", 60.0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="trainer.parallel=none under torchrun"):
        init_distributed(torch.device("cpu"), "none", 60.0)
    # an FSDP2 without set_reduce_scatter_unused_params (torch 2.11, seen on the GPU
    # machine) is refused before anything runs; this torch has it
    from torch.distributed.fsdp import FSDPModule

    from uniweave.train.distributed.parallel import check_fsdp2_support

    check_fsdp2_support()
    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    with pytest.raises(ConfigError, match="set_reduce_scatter_unused_params") as err:
        check_fsdp2_support()
    assert err.value.key == "trainer.parallel"


def test_fp64_precision_is_float64_end_to_end_and_refuses_mixed_fsdp_dtypes(tmp_path, codec_dir):
    """`trainer.precision: fp64` trains float64 weights (the exported model and the
    optimizer state are float64) and its first update's loss equals the fp32 run's to
    fp32 rounding of a ~4-nat mean CE (4 * 2^-24 * a few terms ~ 1e-6); fsdp dtypes of fp64
    go with it and nothing else."""
    from uniweave.train.run import run_train

    losses = {}
    for precision in ("fp32", "fp64"):
        trainer = {"total_updates": 1, "precision": precision, "micro_batch_size": 4}
        cfg = tiny_config(tmp_path / precision, codec_dir, trainer=trainer)
        cfg["checkpoint"] = {"every_updates": 1, "keep_last": 0}
        run_dir = run_train(validate_config(cfg))
        exported = final_model(run_dir)
        want = torch.float64 if precision == "fp64" else torch.float32
        assert {v.dtype for v in exported.values()} == {want}, precision
        _, opt = checkpoint_tensors(run_dir / "checkpoints" / "update-000001")
        moments = [s["exp_avg"] for s in opt["optimizer"]["state"].values()]
        assert moments and {m.dtype for m in moments} == {want}, precision
        losses[precision] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    # one float32 path against float64 (tests/tolerances.py sum_bound): the forward's
    # reductions plus the mean over the update's tokens; the key length is at most the
    # tokens of the batch (an overestimate, inside the square root)
    tokens = round(losses["fp32"]["tokens_per_s"] * losses["fp32"]["step_seconds"])
    n = tiny_decoder_reductions(validate_config(cfg).model.tiny, tokens) + tokens
    err = abs(losses["fp64"]["loss"] - losses["fp32"]["loss"])
    assert_within(err, sum_bound(losses["fp64"]["loss"], n), "fp32 vs fp64 loss")
    base = tiny_config(tmp_path / "r", codec_dir)
    bad = [
        {"precision": "fp32", "parallel": "fsdp2", "fsdp": {"param_dtype": "fp64"}},
        {"precision": "fp64", "parallel": "fsdp2", "fsdp": {"param_dtype": "fp32"}},
        {"precision": "fp32", "parallel": "none", "fsdp": {"reduce_dtype": "fp64"}},
    ]
    for trainer in bad:
        with pytest.raises(ConfigError, match="trainer.fsdp.(param|reduce)_dtype"):
            validate_config({**base, "trainer": {**base["trainer"], **trainer}})


@contextmanager
def one_process_fsdp2(monkeypatch):
    """A 1-process fsdp2 job in this process, as torchrun would set it up (gloo)."""
    from uniweave.train.distributed.comm import shutdown_distributed

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    info, _ = init_distributed(torch.device("cpu"), "fsdp2", 60.0)
    try:
        yield info
    finally:
        shutdown_distributed()


def one_process_trainer(cfg: dict, mode: str, info):
    """The Trainer `uniweave train` builds for `cfg` under `trainer.parallel = mode`."""
    from uniweave.train.engine.trainer import Trainer
    from uniweave.train.run import JOBS, _prepare_model

    trainer = {**cfg["trainer"], "parallel": mode}
    if mode == "fsdp2":
        dtype = "fp64" if trainer.get("precision") == "fp64" else "fp32"
        trainer["fsdp"] = {"param_dtype": dtype, "reduce_dtype": dtype}
    cfg = validate_config({**cfg, "trainer": trainer})
    run_dir = Path(cfg.run.output_dir)
    model = _prepare_model(cfg, run_dir, torch.device("cpu"))
    source, objective = JOBS[cfg.algorithm.name](cfg, model, run_dir, info)
    return Trainer(model, source, objective, cfg, run_dir, info, model.special_ids.pad)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_fsdp2_reduce_scatters_once_per_update(tmp_path, codec_dir, monkeypatch):
    """A 1-process fsdp2 job: the micro-batches but the last leave the sharded gradients
    unset (accumulated locally, no reduce-scatter); the last reduce-scatters their sum,
    which equals the one-process accumulated gradient."""
    from uniweave.core.trajectory import TrajectoryBatch
    from uniweave.train.distributed.comm import DistInfo
    from uniweave.train.engine.batching import rank_micro_batches

    torch.set_num_threads(1)

    def grads(mode: str, info: DistInfo) -> dict[str, torch.Tensor]:
        cfg = tiny_config(tmp_path / mode, codec_dir, trainer={**TRAINER, "micro_batch_size": 2})
        t = one_process_trainer(cfg, mode, info)
        groups = rank_micro_batches(t.source.global_batch(0), info, t.t)
        micros = [TrajectoryBatch.collate(g, t.pad_id) for g in groups]
        assert len(micros) == 4
        n = sum(t.objective.count(m) for m in micros)
        for i, micro in enumerate(micros):
            with t.parallel.accumulation(last=i == len(micros) - 1):
                t.parallel.run(t.objective.loss, micro, n)[0].backward()
            if mode == "fsdp2" and i < len(micros) - 1:
                assert all(p.grad is None for p in t.params), i
        return {name: full(p.grad) for name, p in t.named_params}

    reference = grads("none", DistInfo())
    with one_process_fsdp2(monkeypatch) as info:
        sharded = grads("fsdp2", info)
    assert sharded.keys() == reference.keys()
    # one process: the reduce-scatter of 1 rank is the identity and the micro-batches run
    # the same kernels on the same shapes in the same order: the same bits
    for name, value in reference.items():
        assert torch.equal(value, sharded[name]), name


def test_fsdp2_leaves_a_parameter_no_micro_batch_reaches_without_a_gradient(tmp_path, monkeypatch):
    """Tiny Janus-Pro, t2i rows only: the understanding aligner gets no gradient. One
    process leaves its `.grad` None and AdamW skips it; fsdp2 reduce-scatters zeros for
    it, and `drop_unreached` sets it back to None, so one update with weight decay gives
    the same parameters (aligner untouched) as one process."""
    from uniweave.train.distributed.comm import DistInfo

    torch.set_num_threads(1)
    ckpt = write_tiny_checkpoint(tmp_path / "janus", TinyJanusSpec(grid=2), vocabulary_texts())

    def step(mode: str, info) -> tuple[set[str], dict[str, torch.Tensor]]:
        cfg = {
            "run": {"name": "j", "seed": 0, "output_dir": str(tmp_path / mode), "device": "cpu"},
            "model": {"kind": "janus_pro", "path": str(ckpt)},
            "data": {"tasks": ["t2i"], "train_size": 8, "val_size": 0, "test_size": 0},
            "trainer": {
                "total_updates": 1,
                "global_batch_size": 4,
                "micro_batch_size": 2,
                "optimizer": {"lr": 1e-2, "weight_decay": 0.1},
            },
            "checkpoint": {"every_updates": 0},
            "logging": {"tensorboard": False, "progress_bar": False},
        }
        t = one_process_trainer(cfg, mode, info)
        t.step()
        unset = {n for n, p in t.named_params if p.grad is None}
        return unset, {n: full(p.detach()).clone() for n, p in t.named_params}

    unset, reference = step("none", DistInfo())
    assert unset and all(".aligner." in n for n in unset)
    with one_process_fsdp2(monkeypatch) as info:
        sharded_unset, sharded = step("fsdp2", info)
    assert sharded_unset == unset
    # one process: the same gradients (test_fsdp2_reduce_scatters_once_per_update: bitwise),
    # but AdamW runs on the sharded DTensors, its step rounded in another op order: per run
    # the decay and the update round theta twice, and the first step (|m/sqrt(v)| <= 1, so
    # at most lr) carries ~10 roundings (moments, sqrt, bias corrections, the division)
    lr = 1e-2
    for name, value in reference.items():
        tol = elementwise_bound(value, 2) + 2 * 10 * U_FP32 * lr
        assert_within((value - sharded[name]).abs(), tol, name)


def test_fsdp2_grpo_lora_in_one_process_equals_no_wrapper(
    tmp_path, codec_dir, classifier_dir, monkeypatch
):
    """GRPO + LoRA under a 1-process fsdp2 job equals `parallel: none` (adapters after 2
    updates, which parameters have gradients): the adapter switch around the reference
    pass toggles requires_grad, and the unreached-parameter hooks are placed before it."""
    from uniweave.train.distributed.comm import DistInfo

    torch.set_num_threads(1)
    assets = {"vq": codec_dir, "clf": classifier_dir}

    def run(mode: str, info):
        lora = {"enabled": True, "r": 4}
        cfg = grpo_config(tmp_path / mode, assets, trainer={"lora": lora, "total_updates": 2})
        t = one_process_trainer(cfg, mode, info)
        unset = []
        for _ in range(2):
            t.step()
            t.update += 1
            unset.append({n for n, p in t.named_params if p.grad is None})
        return unset, {n: full(p.detach()).clone() for n, p in t.named_params}

    unset, reference = run("none", DistInfo())
    with one_process_fsdp2(monkeypatch) as info:
        sharded_unset, sharded = run("fsdp2", info)
    assert sharded_unset == unset
    assert reference and all("lora_" in n for n in reference)
    # one process: the same kernels on the same shapes in the same order, the same bits
    for name, value in reference.items():
        assert torch.equal(value, sharded[name]), name
