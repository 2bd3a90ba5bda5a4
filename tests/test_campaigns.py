"""Campaigns (docs/campaigns.md): a LoRA run's peft adapter and `model.initial_adapter`;
parent-linked runs (`run.parent`) under each `checkpoint.resume_mode`; the input
fingerprints every checkpoint records and a resume checks.

Runs are the tiny model on a pre-fitted codec, in process through `uniweave.cli.main` (the
same code path as the command line, without a Python start-up per run), except the
SIGKILL test, which needs a real process to kill.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tolerances import assert_within, logprob_bound, tiny_decoder_reductions
from trainer_helpers import (
    ForkedCLI,
    assert_same_state,
    checkpoint_tensors,
    tiny_config,
    write_config,
)

from uniweave import cli
from uniweave.config import validate_config
from uniweave.config.fingerprint import cache_path, digest, fingerprint, path_identity
from uniweave.config.hashing import (
    ALWAYS_RESUMABLE,
    RESUME_MODES,
    check_extension,
    resume_conflicts,
)
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.export import export_task
from uniweave.data.tokenizer import SpecialIds
from uniweave.forward import forward_interleaved
from uniweave.models.build import build_model
from uniweave.models.registry import load_model
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.methods.grpo.job import build_grpo_job
from uniweave.train.methods.opd.objective import teacher_identity
from uniweave.train.methods.sft.source import sft_trajectories
from uniweave.train.run import _prepare_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on 1 thread

LORA = {"enabled": True, "r": 4, "alpha": 8.0, "target_modules": r".*\.(q_proj|v_proj)$"}
TIMING = ("seconds", "per_s", "time/")  # wall-clock metrics, which no two runs share


@pytest.fixture(scope="module")
def codec_dir(small_vq_dir):
    return small_vq_dir


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, codec_dir) -> Path:
    """A tiny model saved as a `model.path` directory (weights, tokenizer, codec)."""
    root = tmp_path_factory.mktemp("base")
    build_model(validate_config(tiny_config(root / "x", codec_dir))).save_pretrained(root / "base")
    return root / "base"


def _path_config(run_dir: Path, codec_dir: Path, base: Path, **sections) -> dict:
    cfg = tiny_config(run_dir, codec_dir, **sections)
    cfg["model"] = {"kind": "tiny", "path": str(base), **sections.get("model", {})}
    return cfg


def _train(tmp_path: Path, cfg: dict, *extra: str, capsys=None) -> tuple[int, str, str]:
    """`uniweave train` in process: (exit code, stdout, stderr)."""
    path = write_config(tmp_path / f"{Path(cfg['run']['output_dir']).name}.yaml", cfg)
    if capsys is not None:
        capsys.readouterr()
    code = cli.main(["train", str(path), *extra])
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return code, out, err


def _logprobs(model, batch: TrajectoryBatch) -> torch.Tensor:
    """log pi of every scored target of `batch` (text, then visual), under no_grad."""
    with torch.no_grad():
        out = forward_interleaved(model.eval(), batch)
        text = out.text_logits.log_softmax(-1).gather(-1, out.text_targets[:, None])[:, 0]
        visual = out.visual_logits.log_softmax(-1).gather(-1, out.visual_targets[:, None])[:, 0]
    return torch.cat([text, visual])


def _metrics(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {
        r["update"]: {k: v for k, v in r.items() if not any(t in k for t in TIMING)}
        for r in records
    }


def _files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- 1. adapters ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, codec_dir, base_dir) -> tuple[Path, dict]:
    """A 3-update LoRA SFT run on `base_dir`: its directory and config."""
    tmp = tmp_path_factory.mktemp("lora")
    cfg = _path_config(
        tmp / "lora", codec_dir, base_dir, trainer={"total_updates": 3, "lora": LORA}
    )
    assert cli.main(["train", str(write_config(tmp / "lora.yaml", cfg))]) == 0
    return tmp / "lora", cfg


def test_a_lora_run_exports_a_peft_adapter_equal_to_its_final_model(tmp_path, lora_run, base_dir):
    """adapter/ loads with peft's own `PeftModel.from_pretrained` on the base and through
    `model.initial_adapter`; both give the log-probs of the run's final (unmerged)
    model bit for bit, and of its merged model/ to float rounding."""
    from peft import PeftModel

    run_dir, cfg = lora_run
    adapter = run_dir / "adapter"
    record = json.loads((adapter / "uniweave_adapter.json").read_text())
    assert (
        record["r"] == 4
        and record["alpha"] == 8.0
        and record["target_regex"] == LORA["target_modules"]
    )
    assert record["target_modules"] and all(
        m.endswith(("q_proj", "v_proj")) for m in record["target_modules"]
    )
    assert record["base_digest"] and record["base_path"] == str(base_dir)
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == "LORA"

    peft_model = PeftModel.from_pretrained(load_model(base_dir), str(adapter)).get_base_model()
    started = validate_config({**cfg, "model": {**cfg["model"], "initial_adapter": str(adapter)}})
    ours = _prepare_model(started, tmp_path, torch.device("cpu"))
    # the run's final model, unmerged: the base + the last checkpoint's adapter tensors
    final = _prepare_model(validate_config(cfg), tmp_path, torch.device("cpu"))
    last = load_file(str(run_dir / "checkpoints" / "update-000003" / "model.safetensors"))
    missing, unexpected = final.load_state_dict(last, strict=False)
    assert not unexpected and all("lora_" not in k for k in missing)
    merged = load_model(run_dir / "model")

    rows = sft_trajectories(started, ours, "train", 8)
    batch = TrajectoryBatch.collate(rows, SpecialIds.from_tokenizer(ours.tokenizer).pad)
    reference = _logprobs(final, batch)
    assert reference.numel() > 50
    assert torch.equal(_logprobs(peft_model, batch), reference)
    assert torch.equal(_logprobs(ours, batch), reference)
    # merged W + s·BA vs. unmerged x·Wᵀ + s·(x·Aᵀ)·Bᵀ: the same sums in another order,
    # two fp32 paths through the model (tests/tolerances.py; measured 4.8e-7 before)
    tol = logprob_bound(reference, tiny_decoder_reductions(merged.config, batch.token_ids.shape[1]))
    assert_within((_logprobs(merged, batch) - reference).abs(), tol, "merged vs unmerged")
    base_lp = _logprobs(load_model(base_dir), batch)
    assert (base_lp - reference).abs().max() > 1e-3  # the adapter changed the model


@pytest.mark.parametrize("method", ["sft", "opd"])
def test_initial_adapter_starts_a_run_from_base_plus_adapter(
    tmp_path, lora_run, codec_dir, base_dir, method, capsys
):
    """An SFT or OPD run from the adapter checkpoints the adapter's tensors at update 0
    (the OPD student is base + adapter) and then trains them: unmerged."""
    run_dir, _ = lora_run
    adapter = run_dir / "adapter"
    peft_tensors = load_file(str(adapter / "adapter_model.safetensors"))
    sections = {}
    if method == "opd":  # the base itself as the teacher: the same action spaces
        sections = {
            "data": {"tasks": ["t2i"], "train_size": 8, "val_size": 0, "test_size": 0},
            "rollout": {"max_new_tokens": 16, "length_semantics": "exact"},
            "algorithm": {"name": "opd", "teacher": {"path": str(base_dir)}},
        }
    cfg = _path_config(
        tmp_path / method,
        codec_dir,
        base_dir,
        model={"initial_adapter": str(adapter)},
        trainer={"total_updates": 1, "lora": LORA},
        **sections,
    )
    code, _, err = _train(tmp_path, cfg, capsys=capsys)
    assert code == 0, err
    ckpts = tmp_path / method / "checkpoints"
    start = load_file(str(ckpts / "update-000000" / "model.safetensors"))
    assert len(start) == len(peft_tensors)
    for name, value in peft_tensors.items():
        stem, _, leaf = name.removeprefix("base_model.model.").rpartition(".")
        assert torch.equal(start[f"{stem}.default.{leaf}"], value), name
    after = load_file(str(ckpts / "update-000001" / "model.safetensors"))
    assert any(not torch.equal(after[k], start[k]) for k in start)
    record = json.loads((tmp_path / method / "adapter" / "uniweave_adapter.json").read_text())
    assert (
        record["base_digest"]
        == json.loads((adapter / "uniweave_adapter.json").read_text())["base_digest"]
    )  # the next link of a chain starts on the same base


def test_a_grpo_reference_from_an_initial_adapter_is_base_plus_adapter(
    tmp_path, lora_run, codec_dir, base_dir
):
    """The frozen reference is a copy of the initial policy, base + adapter (a LoRA run
    from scratch uses the base with adapters off instead)."""
    adapter = lora_run[0] / "adapter"
    grpo = _path_config(
        tmp_path / "grpo",
        codec_dir,
        base_dir,
        model={"initial_adapter": str(adapter)},
        data={"tasks": ["i2t_mc"], "train_size": 8, "val_size": 0, "test_size": 0},
        rollout={"max_new_tokens": 3},
        reward={"plugins": [{"name": "mc_exact"}]},
        algorithm={"name": "grpo", "group_size": 4, "kl": {"type": "k3", "coef": 0.05}},
        trainer={"total_updates": 1, "lora": LORA},
    )
    cfg = validate_config(grpo)
    model = _prepare_model(cfg, tmp_path / "grpo", torch.device("cpu"))
    _, objective = build_grpo_job(cfg, model, tmp_path / "grpo", DistInfo())
    frozen = objective.reference.frozen
    assert frozen is not None and frozen is not model
    held = {k: v for k, v in frozen.state_dict().items() if "lora_B" in k}
    assert held and all(v.abs().max() > 0 for v in held.values())
    policy = model.state_dict()
    assert all(torch.equal(v, policy[k]) for k, v in frozen.state_dict().items())


@pytest.mark.parametrize(
    "change, says",
    [
        ({"r": 8}, "trainer.lora.r=8"),
        ({"alpha": 16.0}, "trainer.lora.alpha=16.0"),
        ({"target_modules": r".*\.(q_proj|k_proj)$"}, "trainer.lora.target_modules"),
        ("other base", "another base model"),
        ("no lora", "needs trainer.lora.enabled true"),
    ],
)
def test_a_mismatched_adapter_is_refused_before_anything_is_written(
    tmp_path, lora_run, codec_dir, base_dir, change, says, capsys
):
    run_dir, _ = lora_run
    base, lora = base_dir, dict(LORA)
    if change == "other base":
        base = tmp_path / "other"
        shutil.copytree(base_dir, base)
        weights = load_file(str(base / "model.safetensors"))
        name = sorted(weights)[0]
        weights[name] = weights[name] + 1e-3
        save_file(weights, str(base / "model.safetensors"))
    elif change == "no lora":
        lora = {}
    else:
        lora.update(change)
    cfg = _path_config(
        tmp_path / "run",
        codec_dir,
        base,
        model={"initial_adapter": str(run_dir / "adapter")},
        trainer={"total_updates": 1, "lora": lora},
    )
    code, _, err = _train(tmp_path, cfg, capsys=capsys)
    assert code == 2, err
    assert "model.initial_adapter" in err and says in err, err
    assert err.count("\n") == 1
    assert not (tmp_path / "run").exists()


# -- 2. parent-linked runs -------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_parent(tmp_path_factory, codec_dir) -> tuple[Path, dict]:
    """An SFT run of 3 updates stopped after 2 (checkpoints every update)."""
    tmp = tmp_path_factory.mktemp("sft_parent")
    cfg = tiny_config(
        tmp / "parent",
        codec_dir,
        trainer={"total_updates": 3},
        checkpoint={"every_updates": 1, "keep_last": 0},
    )
    path = write_config(tmp / "parent.yaml", cfg)
    assert cli.main(["train", str(path), "--stop-after-updates", "2"]) == 0
    return tmp / "parent", cfg


def _child(cfg: dict, out: Path, parent: Path | None, mode: str, **changes) -> dict:
    """`cfg` as a run into `out` (from `parent` if given) under `mode`, with `changes`
    ({"trainer.total_updates": 4, ...})."""
    child = json.loads(json.dumps(cfg))
    child["run"]["output_dir"] = str(out)
    if parent is not None:
        child["run"]["parent"] = str(parent)
    child["checkpoint"]["resume_mode"] = mode
    for dotted, value in changes.items():
        *path, leaf = dotted.split(".")
        node = child
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return child


def _same_first_update(tmp_path, cfg, parent, mode, update, capsys, **changes) -> Path:
    """A child of `parent` under `mode` with `changes`, and a copy of the parent resumed
    in place under the same mode and changes (what the parent computes with that
    change): their first update `update` equal bit for bit (weights, optimizer state,
    logged metrics). Returns the child's directory."""
    inplace = tmp_path / "inplace"
    shutil.copytree(parent, inplace)
    for run, src in ((tmp_path / "child", parent), (inplace, None)):
        code, out, err = _train(
            tmp_path,
            _child(cfg, run, src, mode, **changes),
            "--stop-after-updates",
            "1",
            capsys=capsys,
        )
        assert code == 0, err
        if src is not None:
            assert f"starting from the parent checkpoint {parent}" in out
    name = f"update-{update:06d}"
    a = checkpoint_tensors(tmp_path / "child" / "checkpoints" / name)
    b = checkpoint_tensors(inplace / "checkpoints" / name)
    assert_same_state(a[0], b[0], "model")
    assert_same_state(a[1], b[1], "optimizer")
    assert _metrics(tmp_path / "child")[update] == _metrics(inplace)[update]
    return tmp_path / "child"


def test_epoch_extension_child_continues_exactly(tmp_path, sft_parent, capsys):
    """A longer constant-LR child from the parent's update 2: its update 3 equals the
    parent's in-place extension and the parent's own (shorter) run's update 3; the
    child records the parent checkpoint and the SHA-256 of its manifest."""
    parent, cfg = sft_parent
    child = _same_first_update(
        tmp_path,
        cfg,
        parent,
        "epoch_extension",
        3,
        capsys,
        **{"trainer.total_updates": 5, "run.name": "longer"},
    )
    own = tmp_path / "parent_rest"
    shutil.copytree(parent, own)
    code, _, err = _train(tmp_path, _child(cfg, own, None, "strict"), capsys=capsys)
    assert code == 0, err
    assert_same_state(
        checkpoint_tensors(own / "checkpoints" / "update-000003")[0],
        checkpoint_tensors(child / "checkpoints" / "update-000003")[0],
    )
    state = json.loads((child / "checkpoints" / "update-000003" / "state.json").read_text())
    source = parent / "checkpoints" / "update-000002"
    manifest = json.loads((source / "state.json").read_text())["manifest"]
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    assert state["parent"]["checkpoint"] == str(source.resolve())
    assert state["parent"]["manifest_sha256"] == hashlib.sha256(canonical).hexdigest()
    assert sorted(p.name for p in (child / "checkpoints").iterdir()) == [
        "update-000002",
        "update-000003",
    ]


def test_execution_change_child_continues_exactly(tmp_path, sft_parent, capsys):
    parent, cfg = sft_parent
    _same_first_update(
        tmp_path,
        cfg,
        parent,
        "execution_change",
        3,
        capsys,
        **{"trainer.micro_batch_size": 2, "trainer.gradient_checkpointing": True},
    )


def test_rollout_limit_change_child_continues_exactly_and_remeasures(
    tmp_path, codec_dir, classifier_dir, capsys
):
    """GRPO (t2i, scored by the digits classifier) stopped after update 1, continued
    with a longer rollout cap: the child's update 2 equals the in-place resume's; the
    child first re-measures the validation metrics at update 1 under the new cap."""
    cfg = tiny_config(
        tmp_path / "parent",
        codec_dir,
        data={"tasks": ["t2i"], "train_size": 8, "val_size": 2, "test_size": 0},
        rollout={"max_new_tokens": 12},
        reward={
            "plugins": [{"name": "digit_classifier", "path": str(classifier_dir)}],
            "truncated_reward": "keep",
        },
        algorithm={"name": "grpo", "group_size": 4},
        trainer={"total_updates": 2, "eval_every": 2},
        checkpoint={"every_updates": 1, "keep_last": 0},
    )
    code, _, err = _train(tmp_path, cfg, "--stop-after-updates", "1", capsys=capsys)
    assert code == 0, err
    child = _same_first_update(
        tmp_path,
        cfg,
        tmp_path / "parent",
        "rollout_limit_change",
        2,
        capsys,
        **{"rollout.max_new_tokens": 20},
    )
    assert _metrics(child)[2]["loss"] != 0.0  # the update trains on something
    baseline = _metrics(child)[1]
    assert any(k.startswith("val/") for k in baseline) and "loss" not in baseline


@pytest.mark.parametrize(
    "mode, changes, key",
    [
        ("epoch_extension", {"trainer.optimizer.lr": 1e-2}, "trainer.optimizer.lr"),
        ("epoch_extension", {"data.seed": 5}, "data.seed"),
        ("epoch_extension", {"trainer.total_updates": 1}, "trainer.total_updates"),
        ("execution_change", {"trainer.total_updates": 5}, "trainer.total_updates"),
        ("execution_change", {"rollout.max_new_tokens": 5}, "rollout.max_new_tokens"),
        ("rollout_limit_change", {"trainer.optimizer.lr": 1e-2}, "trainer.optimizer.lr"),
        ("rollout_limit_change", {"run.name": "x"}, "run.name"),
    ],
)
def test_a_change_the_mode_does_not_allow_exits_2_naming_the_key(
    tmp_path, sft_parent, mode, changes, key, capsys
):
    parent, cfg = sft_parent
    before = _files(parent)
    code, _, err = _train(
        tmp_path, _child(cfg, tmp_path / "child", parent, mode, **changes), capsys=capsys
    )
    assert code == 2, err
    assert key in err and err.count("\n") == 1, err
    assert not (tmp_path / "child").exists()
    assert _files(parent) == before


def test_a_parent_inside_a_grpo_round_or_without_checkpoints_exits_2(
    tmp_path, codec_dir, classifier_dir, capsys
):
    cfg = tiny_config(
        tmp_path / "parent",
        codec_dir,
        data={"tasks": ["t2i"], "train_size": 8, "val_size": 0, "test_size": 0},
        rollout={"max_new_tokens": 16, "length_semantics": "exact"},
        reward={"plugins": [{"name": "digit_classifier", "path": str(classifier_dir)}]},
        algorithm={"name": "grpo", "group_size": 4, "updates_per_batch": 2},
        trainer={"total_updates": 4},
        checkpoint={"every_updates": 1, "keep_last": 0},
    )
    code, _, err = _train(tmp_path, cfg, "--stop-after-updates", "1", capsys=capsys)
    assert code == 0, err
    for parent, says in (
        (tmp_path / "parent", "update 1 is inside a GRPO round"),
        (tmp_path / "nowhere", "neither a run directory nor a checkpoint"),
    ):
        child = _child(cfg, tmp_path / "child", parent, "strict")
        code, _, err = _train(tmp_path, child, capsys=capsys)
        assert code == 2 and "run.parent" in err and says in err, err
        assert not (tmp_path / "child").exists()


def test_the_allowed_key_sets_live_in_one_place():
    """Each mode allows exactly ALWAYS_RESUMABLE + its RESUME_MODES entry: a DDP reducer
    flag only under execution_change, a rollout cap only under rollout_limit_change."""
    base = {"trainer": {"parallel": "ddp"}}
    for key, value, mode in (
        ("trainer.ddp.static_graph", True, "execution_change"),
        ("rollout.max_new_tokens", 9, "rollout_limit_change"),
        ("trainer.total_updates", 9, "epoch_extension"),
    ):
        section, *rest = key.split(".")
        changed = json.loads(json.dumps(base))
        node = changed.setdefault(section, {})
        for part in rest[:-1]:
            node = node.setdefault(part, {})
        node[rest[-1]] = value
        for other in RESUME_MODES:
            current = validate_config({**changed, "checkpoint": {"resume_mode": other}})
            refused = resume_conflicts(validate_config(base), current)
            allowed = other == mode or (other == "allow_schedule_changes" and "total" in key)
            assert refused == ([] if allowed else [key]), (key, other)
    assert "run.parent" in ALWAYS_RESUMABLE
    # epoch_extension: only a constant learning rate extends exactly
    sched = {"scheduler": {"name": "warmup_cosine", "warmup_steps": 2}, "total_updates": 10}
    longer = {**sched, "total_updates": 20}
    mode = {"resume_mode": "epoch_extension"}
    saved = validate_config({"trainer": sched})
    cosine = validate_config({"trainer": longer, "checkpoint": mode})
    assert check_extension(saved, cosine)[0] == "trainer.scheduler.name"
    flat = {"scheduler": {"name": "warmup_constant", "warmup_steps": 2}}
    saved = validate_config({"trainer": {**flat, "total_updates": 10}})
    assert check_extension(saved, validate_config({"trainer": {**flat, "total_updates": 20},
                                                   "checkpoint": mode})) is None  # fmt: skip


@pytest.mark.slow
def test_a_killed_child_resumes_from_its_own_checkpoint(tmp_path, sft_parent):
    """SIGKILL after the child's update 4 (saved: 2 from the parent, 3): the retry takes
    the child's own update-3, says so, and ends bit for bit where an unkilled child does.
    Real processes (`ForkedCLI`: forked from one that imported torch once)."""
    import os

    parent, cfg = sft_parent
    forked = ForkedCLI()
    env = {**os.environ, "CI": "true", "OMP_NUM_THREADS": "1"}
    ends = {}
    for name, fault in (("whole", None), ("killed", "after_update:4")):
        changes = {"trainer.total_updates": 5}
        child = _child(cfg, tmp_path / name, parent, "epoch_extension", **changes)
        path = write_config(tmp_path / f"{name}.yaml", child)
        if fault is not None:
            killed = forked.run(["train", str(path)], tmp_path, {**env, "UNIWEAVE_FAULT": fault})
            assert killed.returncode == -9, killed.stderr
            assert "starting from the parent checkpoint" in killed.stdout
        done = forked.run(["train", str(path)], tmp_path, env)
        assert done.returncode == 0, done.stderr
        if fault is not None:
            own = tmp_path / name / "checkpoints" / "update-000003"
            assert f"resuming from this run's own checkpoint {own}" in done.stdout
        ends[name] = checkpoint_tensors(tmp_path / name / "checkpoints" / "update-000005")
    assert_same_state(ends["whole"][0], ends["killed"][0], "model")
    assert_same_state(ends["whole"][1], ends["killed"][1], "optimizer")


# -- 3. fingerprints -------------------------------------------------------------------


def test_a_replaced_model_file_refuses_the_resume_naming_it(tmp_path, codec_dir, base_dir, capsys):
    base = tmp_path / "base"
    shutil.copytree(base_dir, base)
    cfg = _path_config(tmp_path / "run", codec_dir, base, trainer={"total_updates": 2})
    code, _, err = _train(tmp_path, cfg, "--stop-after-updates", "1", capsys=capsys)
    assert code == 0, err
    weights = base / "model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 2  # same names, shapes, size: only the content differs
    weights.unlink()
    save_file(tensors, str(weights))
    before = _files(tmp_path / "run")
    code, _, err = _train(tmp_path, cfg, capsys=capsys)
    assert code == 2, err
    assert f"{weights} content changed" in err and "model.path" in err, err
    assert _files(tmp_path / "run") == before

    capsys.readouterr()
    assert cli.main(["inspect", "--fingerprints", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if f"  {weights}  " in x)
    assert line.startswith("model.path") and line.endswith("content changed")
    assert any(x.startswith("model.path") and x.endswith("  ok") for x in lines)
    light = (  # reads JSON and hashes files: no torch, no model package
        "import sys; from uniweave import cli; "
        f"assert cli.main(['inspect', '--fingerprints', {str(tmp_path / 'run')!r}]) == 0; "
        "assert 'torch' not in sys.modules and 'uniweave.models' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", light], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_replaced_dataset_file_refuses_the_resume_naming_it(tmp_path, codec_dir, capsys):
    rows = export_task("i2t_mc", "train", 8, tmp_path / "data")
    cfg = tiny_config(
        tmp_path / "run",
        codec_dir,
        data={
            "path": str(rows),
            "tasks": ["i2t_mc"],
            "train_size": 8,
            "val_size": 0,
            "test_size": 0,
        },
        trainer={"total_updates": 2},
    )
    code, _, err = _train(tmp_path, cfg, "--stop-after-updates", "1", capsys=capsys)
    assert code == 0, err
    state = json.loads((tmp_path / "run/checkpoints/update-000001/state.json").read_text())
    assert set(state["fingerprints"]) >= {"data.path", "model.codec.path"}
    lines = rows.read_text().splitlines(keepends=True)
    rows.write_text("".join(lines[1:] + lines[:1]))  # the same rows in another order
    code, _, err = _train(tmp_path, cfg, capsys=capsys)
    assert code == 2, err
    assert f"{rows} content changed" in err and "data.path" in err, err


def test_a_dataset_path_naming_another_file_is_refused_as_another_file(tmp_path, codec_dir, capsys):
    """data.path moved to another file of the same name: the refusal says it is another
    file (not that the recorded one changed), and its suggestion (the recorded path)
    resumes."""
    first = export_task("i2t_mc", "train", 8, tmp_path / "a")
    second = export_task("i2t_mc", "train", 8, tmp_path / "b", seed=1)
    assert first.name == second.name and first.read_bytes() != second.read_bytes()
    data = {"tasks": ["i2t_mc"], "train_size": 8, "val_size": 0, "test_size": 0}
    cfg = tiny_config(
        tmp_path / "run",
        codec_dir,
        data={**data, "path": str(first)},
        trainer={"total_updates": 2},
    )
    code, _, err = _train(tmp_path, cfg, "--stop-after-updates", "1", capsys=capsys)
    assert code == 0, err
    moved = {**cfg, "data": {**cfg["data"], "path": str(second)}}
    code, _, err = _train(tmp_path, moved, capsys=capsys)
    assert code == 2, err
    assert f"data.path names {second}, another file than the {first.resolve()}" in err, err
    assert "changed" not in err, err
    fix = re.search(r"set (data\.path)=(\S+) to resume", err)
    assert fix is not None and fix.group(2) == str(first.resolve()), err
    code, _, err = _train(tmp_path, moved, f"{fix.group(1)}={fix.group(2)}", capsys=capsys)
    assert code == 0, err


def test_content_hashes_are_cached_by_size_mtime_and_inode(tmp_path):
    """A cached hash is used while (size, mtime, inode) match, recomputed when not."""
    file = tmp_path / "w.bin"
    file.write_bytes(b"abc")
    true = hashlib.sha256(b"abc").hexdigest()
    assert fingerprint(file)["w.bin"]["sha256"] == true
    cache = json.loads(cache_path().read_text())
    cache[str(file.resolve())]["sha256"] = "planted"
    cache_path().write_text(json.dumps(cache))
    assert fingerprint(file)["w.bin"]["sha256"] == "planted"  # the stamp matched: cached
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(b"abd")
    replacement.replace(file)  # another inode (and mtime), same size
    assert fingerprint(file)["w.bin"]["sha256"] == hashlib.sha256(b"abd").hexdigest()


def test_the_teacher_identity_is_the_cached_file_identity(tmp_path):
    """OPD's teacher identity (written into every checkpoint) is `path_identity`: the
    digest of the directory's cached content hashes, the same ones the run's input
    fingerprints record, so a start does not hash the teacher again; a copy of the
    directory has the same digest."""
    teacher = tmp_path / "teacher"
    (teacher / "sub").mkdir(parents=True)
    (teacher / "model.bin").write_bytes(b"weights")
    (teacher / "sub" / "tok.json").write_bytes(b"{}")
    first = teacher_identity(teacher)
    assert (
        first
        == path_identity(teacher)
        == {
            "path": str(teacher.resolve()),
            "digest": digest(fingerprint(teacher)),
        }
    )
    copy = tmp_path / "copy"
    shutil.copytree(teacher, copy)
    assert teacher_identity(copy)["digest"] == first["digest"]
    cache = json.loads(cache_path().read_text())
    cache[str((teacher / "model.bin").resolve())]["sha256"] = "planted"
    cache_path().write_text(json.dumps(cache))
    planted = teacher_identity(teacher)["digest"]  # the stamp matched: the cached hash
    assert planted != first["digest"]
    (teacher / "model.bin").write_bytes(b"weights!")  # another size: hashed again
    assert teacher_identity(teacher)["digest"] not in (first["digest"], planted)
