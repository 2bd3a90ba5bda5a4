"""Trainer: exact resume after SIGKILL, objective invariance to the batch split, LoRA,
corrupt checkpoints, refused resumes and non-finite losses (multi-process runs:
tests/test_parallel.py)."""

from __future__ import annotations

import copy
import json
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tolerances import (
    assert_within,
    gradient_reductions,
    magnitude,
    reduction_bound,
    tiny_decoder_reductions,
)
from trainer_helpers import (
    assert_same_state,
    checkpoint_tensors,
    run_cli,
    tiny_config,
    write_config,
)

from uniweave.config import resume_conflicts, validate_config
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.data.tokenizer import SpecialIds
from uniweave.forward import forward_interleaved
from uniweave.models.build import build_model
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.errors import TrainingError
from uniweave.train.engine.lora import adapter_state, apply_lora
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.sft.objective import SFTObjective
from uniweave.train.methods.sft.source import DatasetSource, sft_trajectories
from uniweave.train.state.checkpoint import latest_checkpoint


@pytest.fixture(scope="module")
def codec_dir(small_vq_dir):
    return small_vq_dir


def _updates(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["update"] for line in lines]


def _train(cfg_path: Path, env: dict | None = None):
    return run_cli(["train", str(cfg_path)], env_extra=env)


def test_sigkill_resume_is_bitwise_exact(tmp_path, codec_dir):
    ref_dir = tmp_path / "ref"
    ref = _train(write_config(tmp_path / "ref.yaml", tiny_config(ref_dir, codec_dir)))
    assert ref.returncode == 0, ref.stderr
    rng = random.Random(7)
    kill_points = [f"after_update:{rng.randint(1, 7)}", f"checkpoint_write:{rng.choice([4, 6])}"]
    final_ref = checkpoint_tensors(ref_dir / "checkpoints" / "update-000008")
    for n, fault in enumerate(kill_points):
        run_dir = tmp_path / f"killed{n}"
        cfg = write_config(tmp_path / f"k{n}.yaml", tiny_config(run_dir, codec_dir))
        killed = _train(cfg, {"UNIWEAVE_FAULT": fault})
        assert killed.returncode == -9, (fault, killed.returncode, killed.stderr)
        if fault.startswith("checkpoint_write"):
            assert any(p.name.startswith(".tmp-") for p in (run_dir / "checkpoints").iterdir())
        resumed = _train(cfg)
        assert resumed.returncode == 0, resumed.stderr
        final = checkpoint_tensors(run_dir / "checkpoints" / "update-000008")
        assert_same_state(final_ref[0], final[0], f"{fault} model")
        assert_same_state(final_ref[1], final[1], f"{fault} optimizer")
        assert _updates(run_dir) == list(range(1, 9)), fault
        ref_model = load_file(str(ref_dir / "model" / "model.safetensors"))
        assert_same_state(ref_model, load_file(str(run_dir / "model" / "model.safetensors")))


def _trainer(cfg, run_dir: Path, model=None, trainable_state=None) -> Trainer:
    model = model or build_model(cfg)
    trajs = sft_trajectories(cfg, model, "train", cfg.data.train_size)
    source = DatasetSource(
        trajs, cfg.trainer.global_batch_size, cfg.data.seed, run_seed=cfg.run.seed
    )
    pad = SpecialIds.from_tokenizer(model.tokenizer).pad
    return Trainer(
        model,
        source,
        SFTObjective(cfg.algorithm),
        cfg,
        run_dir,
        DistInfo(),
        pad,
        trainable_state=trainable_state,
    )


def test_gradient_is_invariant_to_the_micro_batch_split(tmp_path, codec_dir):
    base = validate_config(tiny_config(tmp_path / "r", codec_dir))
    model = build_model(base)
    grads = {}
    for micro in (8, 4, 2):
        cfg = validate_config(
            tiny_config(tmp_path / "r", codec_dir, trainer={"micro_batch_size": micro})
        )
        trainer = _trainer(cfg, tmp_path / f"r{micro}", copy.deepcopy(model))
        trainer.update = 3
        trainer.accumulate()
        grads[micro] = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    # float32, the update's gradient summed over micro-batches of 8, 4 or 2 rows: two fp32
    # paths to a gradient (tests/tolerances.py) over the global batch
    whole = TrajectoryBatch.collate(trainer.source.global_batch(3), trainer.pad_id)
    n = gradient_reductions(
        tiny_decoder_reductions(model.config, whole.token_ids.shape[1]),
        int(whole.attention_mask.sum()),
    )
    for micro in (4, 2):
        for name, g in grads[8].items():
            tol = reduction_bound(magnitude(g), n)
            assert_within((g - grads[micro][name]).abs(), tol, f"{micro} {name}")
    assert any(g.abs().sum() > 0 for g in grads[8].values())


def test_a_resume_may_change_the_micro_batch_split(tmp_path, codec_dir):
    """The invariance above is why `trainer.micro_batch_size` is on the resumable list:
    a run stopped after 2 updates at micro-batch 8 and resumed at micro-batch 2 ends
    where the uninterrupted micro-batch-8 run ends, to float rounding."""

    def config(run: str, micro: int):
        sections = {"trainer": {"micro_batch_size": micro, "total_updates": 4}}
        return validate_config(tiny_config(tmp_path / run, codec_dir, **sections))

    model = build_model(config("ref", 8))
    reference = _trainer(config("ref", 8), tmp_path / "ref", copy.deepcopy(model))
    list(reference.fit())
    first = _trainer(config("cut", 8), tmp_path / "cut", copy.deepcopy(model))
    for update, _ in first.fit():
        if update == 2:
            break
    assert resume_conflicts(config("cut", 8), config("cut", 2)) == []
    resumed = _trainer(config("cut", 2), tmp_path / "cut", copy.deepcopy(model))
    assert [u for u, _ in resumed.fit()] == [3, 4]
    for (name, a), b in zip(reference.model.named_parameters(), resumed.model.parameters()):
        # not derived (issue 45 follow-up): the gradients of updates 3-4 differ by two fp32
        # paths' rounding (the test above), but Adam's step moves by up to lr / eps x a
        # gradient change where |g| ~ eps, a vacuous worst case; tests/test_reshard.py
        # derives a bound from Adam's state
        # bound: NOT DERIVED, the pre-issue-45 1e-5 kept (see above)
        assert (a - b).abs().max() <= 1e-5, name
    moved = reference.model.text_head.weight - model.text_head.weight
    assert moved.abs().max() > 1e-3


def test_lora_trains_only_adapters_and_reloads(tmp_path, codec_dir):
    cfg = validate_config(
        tiny_config(
            tmp_path / "lora",
            codec_dir,
            trainer={
                "total_updates": 3,
                "lora": {"enabled": True, "r": 4, "target_modules": r".*\.(q_proj|v_proj)$"},
            },
        )
    )
    model = build_model(cfg)
    targets = apply_lora(model, cfg)
    assert targets and all("decoder.layers" in t for t in targets)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(cfg, tmp_path / "lora", model, lambda: adapter_state(model))
    for _ in trainer.fit():
        pass
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    assert any("lora_B" in k for k in changed)
    ckpt = latest_checkpoint(tmp_path / "lora")
    saved = ckpt.model_state()
    assert set(saved) == {k for k in after if "lora_" in k}
    fresh = build_model(cfg)
    apply_lora(fresh, cfg)
    fresh.load_state_dict(saved, strict=False)
    batch = TrajectoryBatch.collate(trainer.source.global_batch(0), trainer.pad_id)
    with torch.no_grad():
        a = forward_interleaved(model.eval(), batch).text_logits
        b = forward_interleaved(fresh.eval(), batch).text_logits
    assert torch.equal(a, b)


def test_corrupt_checkpoint_is_skipped_and_resume_continues(tmp_path, codec_dir):
    run_dir = tmp_path / "c"
    cfg_path = write_config(tmp_path / "c.yaml", tiny_config(run_dir, codec_dir))
    assert _train(cfg_path, {"UNIWEAVE_FAULT": "after_update:5"}).returncode == -9
    newest = run_dir / "checkpoints" / "update-000004"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = latest_checkpoint(run_dir)
    assert found.update == 2
    assert any("update-000004" in str(w.message) and "truncated" in str(w.message) for w in caught)
    resumed = _train(cfg_path)
    assert resumed.returncode == 0, resumed.stderr
    assert _updates(run_dir) == list(range(1, 9))


def test_resume_with_changed_config_names_the_keys(tmp_path, codec_dir):
    run_dir = tmp_path / "d"
    cfg = tiny_config(run_dir, codec_dir, trainer={"total_updates": 2})
    assert _train(write_config(tmp_path / "d.yaml", cfg)).returncode == 0
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    cfg["trainer"]["optimizer"] = {"lr": 1e-2}
    refused = _train(write_config(tmp_path / "d2.yaml", cfg))
    assert refused.returncode == 2
    assert "refusing to resume" in refused.stderr and "trainer.optimizer.lr" in refused.stderr
    assert refused.stderr.count("\n") == 1
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before


def test_non_finite_loss_stops_without_a_nan_checkpoint(tmp_path, codec_dir):
    run_dir = tmp_path / "n"
    cfg = validate_config(tiny_config(run_dir, codec_dir, checkpoint={"every_updates": 1}))
    trainer = _trainer(cfg, run_dir)
    fit = trainer.fit()
    next(fit)
    with torch.no_grad():
        trainer.model.text_head.weight[0, 0] = float("nan")
    with pytest.raises(TrainingError, match="non-finite loss at update 2"):
        next(fit)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["update-000000", "update-000001"]
    for name in ckpts:
        state = load_file(str(run_dir / "checkpoints" / name / "model.safetensors"))
        assert all(torch.isfinite(v).all() for v in state.values())
    shutil.rmtree(run_dir)
