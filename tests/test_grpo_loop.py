"""The GRPO loop on the shared trainer: one update per action space, the ratio under
replay anchoring, the rollout-vs-replay gap, exact-count image rewards, the objective
against an independent per-factor formula, reward-plugin failures through the loop, and
bitwise resume after SIGKILL during the rollout and during a checkpoint write."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from tolerances import (
    assert_within,
    elementwise_bound,
    gradient_reductions,
    logprob_bound,
    magnitude,
    reduction_bound,
    tiny_decoder_reductions,
)
from trainer_helpers import (
    assert_same_state,
    checkpoint_tensors,
    fit_metrics,
    grpo_config,
    make_grpo_trainer,
    run_cli,
    write_config,
)

from uniweave.config import RolloutConfig, load_config, validate_config
from uniweave.core.sample import validate_groups
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.data.tokenizer import SpecialIds
from uniweave.forward import body_hidden
from uniweave.models.build import build_model
from uniweave.replay import replay_logprobs
from uniweave.rewards import PLUGINS, RewardError, RewardPlugin
from uniweave.rewards.digit_classifier import DigitClassifier
from uniweave.rollout import SamplingParams
from uniweave.rollout.config import sampling_params
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.metrics import read_metrics
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.grpo.job import build_grpo_job
from uniweave.train.methods.grpo.objective import scored_mask


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: intra-op threads only add overhead (and thrash on a shared machine);
    one thread also matches the subprocesses (OMP_NUM_THREADS=1) bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def assets(small_vq_dir, small_bsq_dir, classifier_dir):
    return {"vq": small_vq_dir, "bsq": small_bsq_dir, "clf": classifier_dir}


def test_rollout_config_maps_one_to_one_onto_sampling_params():
    cfg = RolloutConfig(
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        guidance=2.0,
        guidance_logprob="conditional",
        bit_temperature=0.5,
        max_new_tokens=12,
        length_semantics="exact",
        cycle_max_period=0,
        cycle_repeats=4,
        min_grid_side=2,
        max_grid_side=8,
        on_invalid_header="text",
    )
    params = sampling_params(cfg)
    engine_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    shared = set(RolloutConfig.model_fields) & engine_fields
    assert set(RolloutConfig.model_fields) - shared == {
        "batch_size",
        "workers",
        "precision",
        "continuous_batching",
        "assignment",
    }
    assert engine_fields - shared == {"greedy", "stop_token_ids"}
    assert all(getattr(params, name) == getattr(cfg, name) for name in shared)
    assert sampling_params(cfg, max_new_tokens=3, length_semantics="cap").max_new_tokens == 3
    assert SamplingParams() == sampling_params(RolloutConfig())  # one default per setting


@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_one_update_per_action_space_with_exact_count_images(tmp_path, assets, kind):
    trainer = make_grpo_trainer(grpo_config(tmp_path / kind, assets, kind))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trajs = trainer.source.global_batch(0)
    ids = [t.sample_id for t in trajs]
    assert validate_groups(ids) == (2, 4) and ids[:2] == ["prompt-0/0", "prompt-0/1"]
    assert {t.finish_reason for t in trajs} == {"length_exact"}
    rollout = trainer.source.rollout(0)  # the batch update 0 trains on (before it changes)
    metrics = fit_metrics(trainer)[0]
    assert metrics["reward/overwritten_frac"] == 0.0
    # the rewards are the classifier's p(target digit) of each decoded image, recomputed
    # here from the trajectories' codes, and the logged mean/std are theirs
    expected = _classifier_rewards(trainer.model, rollout, assets["clf"])
    # bound: the classifier's fp32 forward in two batch geometries (reductions 9 + 9c + 32c +
    # hidden + 10 for channels c=16, hidden 64) at probability scale 1
    tol = reduction_bound(1.0, 739)
    assert_within((torch.tensor(rollout.rewards).double() - expected).abs(), tol)
    # the service's float64 mean and population std of the same float32 rewards: both move
    # by at most the largest reward difference (the std is 1-Lipschitz in the max norm)
    assert_within(abs(metrics["reward/total_mean"] - float(expected.mean())), tol)
    assert_within(abs(metrics["reward/total_std"] - float(expected.std(correction=0))), tol)
    assert metrics["reward/total_std"] > 0  # the 8 rewards are not all equal
    assert metrics["rollout/finish_length_exact_frac"] == 1.0
    assert metrics["policy/ratio_is_one_by_construction"] == 1.0
    assert metrics["policy/ratio_mean"] == 1.0 and metrics["policy/clip_frac"] == 0.0
    assert metrics["policy/entropy_visual"] > 0 and math.isfinite(metrics["loss"])
    for key in ("adv/advantage_std", "adv/between_share", "adv/frac_zero_std_groups"):
        assert key in metrics
    assert "task/t2i/accuracy" in metrics and metrics["time/rollout_s"] > 0
    samples = trainer.source.samples(0, 3)
    assert len(samples) == 2 and {"prompt", "response", "reward", "image"} == set(samples[0])
    assert "digit" in samples[0]["prompt"] and samples[0]["image"].shape[:2] == (8, 8)
    assert samples[1]["reward"] == float(trainer.source.rollout(0).rewards[4])
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def _classifier_rewards(model, rollout, clf_dir) -> torch.Tensor:
    """p(target digit | image) of every row of `rollout`: the image decoded by the codec
    from the codes at the row's image positions, scored by the classifier of `clf_dir`;
    float64 [rows]."""
    clf = DigitClassifier.from_pretrained(clf_dir)
    H, W = model.codec.grid
    codes = []
    for traj in rollout.trajectories:
        where = traj.modality == int(Modality.VISUAL)
        codes.append(traj.visual_codes[where].reshape(H, W, *traj.visual_codes.shape[1:]))
    pixels = model.codec.decode(torch.stack(codes))
    digits = torch.tensor([int(s.meta.get("digit", s.answer)) for s in rollout.samples])
    proba = clf.predict_proba(pixels).double()
    return proba[torch.arange(len(digits)), digits]


def _grad_reductions(model, batch) -> int:
    """N of a float32 parameter gradient of an objective over `batch` (tolerances.py)."""
    forward = tiny_decoder_reductions(model.config, batch.token_ids.shape[1])
    return gradient_reductions(forward, int(batch.attention_mask.sum()))


def _replay_gap(trainer, update: int) -> float:
    """The bound on a rollout log-prob against its replay (two float32 paths: KV-cached
    decoding and the full forward) over `update`'s batch, at its largest |log-prob|."""
    batch = TrajectoryBatch.collate(trainer.source.global_batch(update), trainer.pad_id)
    n = tiny_decoder_reductions(trainer.model.config, batch.token_ids.shape[1])
    return logprob_bound(batch.rollout_logp, n)


def test_replay_anchoring_is_reinforce_with_a_group_baseline(tmp_path, assets):
    cfg = grpo_config(tmp_path / "r", assets, algorithm={"kl": {"type": "none", "coef": 0.0}})
    trainer = make_grpo_trainer(cfg)
    trainer.update = 0
    trainer.accumulate()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    batch = TrajectoryBatch.collate(trainer.source.global_batch(0), trainer.pad_id)
    records = batch.sampling
    adv = batch.advantages[:, None]
    trainer.model.zero_grad()
    logp = replay_logprobs(trainer.model, batch, records).logp
    mask = scored_mask(batch)
    (-(adv * logp)[mask].sum() / mask.sum()).backward()
    # float32: the trainer's micro-batches against one batch (tests/tolerances.py)
    n = _grad_reductions(trainer.model, batch)
    for name, g in grads.items():
        p = dict(trainer.model.named_parameters())[name]
        assert_within((g - p.grad).abs(), reduction_bound(magnitude(g), n), name)
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_rollout_anchor_logs_a_small_k3_gap(tmp_path, assets):
    cfg = grpo_config(
        tmp_path / "k", assets, task="i2t_mc", algorithm={"old_logp_source": "rollout"}
    )
    trainer = make_grpo_trainer(cfg)
    metrics = fit_metrics(trainer)
    # a token's log-ratio delta between rollout and replay is within the two float32 paths'
    # bound (the last batch's, cached; the policies are two small updates apart): k3 =
    # e^d - 1 - d <= d^2 for |d| <= 1, and |mean e^d - 1| <= e^|d| - 1
    gap = _replay_gap(trainer, len(metrics) - 1)
    for m in metrics:
        assert m["policy/ratio_is_one_by_construction"] == 0.0
        assert 0.0 <= m["policy/k3_rollout_vs_replay"] <= gap**2
        assert abs(m["policy/ratio_mean"] - 1.0) <= math.expm1(gap)
        assert m["policy/entropy_text"] > 0 and "task/i2t_mc/accuracy" in m


def test_bits_objective_matches_an_independent_per_factor_formula(tmp_path, assets):
    cfg = grpo_config(
        tmp_path / "b",
        assets,
        "bsq",
        algorithm={"old_logp_source": "rollout", "kl": {"type": "none", "coef": 0.0}},
        trainer={"micro_batch_size": 8},
    )
    trainer = make_grpo_trainer(cfg)
    rollout = trainer.source.rollout(0)
    gen = torch.Generator().manual_seed(0)
    for t in rollout.trajectories:  # move the old policy so that ratios leave [0.8, 1.2]
        noise = torch.randn(t.rollout_logp_factors.shape, generator=gen) * 0.5
        visual = (t.modality == Modality.VISUAL)[:, None] & (t.rollout_logp != 0)[:, None]
        t.rollout_logp_factors = t.rollout_logp_factors + noise * visual
        t.rollout_logp = (
            t.rollout_logp_factors.sum(-1) * visual[:, 0] + t.rollout_logp * ~visual[:, 0]
        )
    batch = TrajectoryBatch.collate(rollout.trajectories, trainer.pad_id)
    records = batch.sampling
    adv = batch.advantages[:, None]
    mask = scored_mask(batch)
    loss, stats = trainer.objective.loss(trainer.model, batch, int(mask.sum()))
    with torch.no_grad():
        new = replay_logprobs(trainer.model, batch, records)
        ratio = torch.exp(new.logp_factors - batch.rollout_logp_factors)
        a = adv[..., None]
        per_factor = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
        visual = mask & (batch.modality == Modality.VISUAL)
        text_ratio = torch.exp(new.logp - batch.rollout_logp)
        text = torch.maximum(-adv * text_ratio, -adv * text_ratio.clamp(0.8, 1.2))
        per_pos = torch.where(visual, per_factor.mean(-1), text)
        expected = per_pos[mask].sum() / mask.sum()
        clipped = ((-a * ratio.clamp(0.8, 1.2)) > (-a * ratio))[visual].double().mean(-1).sum()
    # float32, the objective's forward against replay's: a factor's term -a r moves by
    # |a r| times its log-prob's error; then the means over factors and positions
    n = tiny_decoder_reductions(trainer.model.config, batch.token_ids.shape[1])
    term = magnitude(per_factor[visual]) * logprob_bound(new.logp_factors[visual], n)
    means = reduction_bound(magnitude(per_pos[mask]), int(mask.sum()) + ratio.shape[-1])
    assert_within((loss.detach() - expected).abs(), term + means, "bits objective")
    assert stats["clipped"] == pytest.approx(float(clipped)) and float(clipped) > 0


@pytest.mark.parametrize("kl, lora", [("k3", True), ("jsd", False)])
def test_reference_is_the_initial_policy(tmp_path, assets, kl, lora):
    """KL/JSD to the reference is 0 at the first update (policy == reference) and grows
    after; with LoRA the reference is the adapter-free base and only adapters train."""
    lora_cfg = {"enabled": lora, "r": 4, "target_modules": r".*\.(q_proj|v_proj)$"}
    lora_cfg = lora_cfg if lora else {}  # LoRA settings are refused with LoRA off
    cfg = grpo_config(
        tmp_path / kl,
        assets,
        algorithm={"kl": {"type": kl, "coef": 0.5}},
        trainer={"total_updates": 3, "optimizer": {"lr": 1e-2}, "lora": lora_cfg},
    )
    trainer = make_grpo_trainer(cfg)
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    frozen = trainer.objective.reference.frozen
    metrics = fit_metrics(trainer)
    # policy == reference at the first update, the same kernels on the same shapes (LoRA's
    # B = 0 adds an exact 0): the same log-probs, so k3 and the JSD are exactly 0
    assert metrics[0]["policy/kl_ref_mean"] == 0.0
    assert metrics[2]["policy/kl_ref_mean"] > 1e-6
    assert metrics[2]["policy/kl_loss"] > 0
    changed = {k for k, v in trainer.model.state_dict().items() if not torch.equal(v, initial[k])}
    assert changed
    if lora:
        assert frozen is None and all("lora_" in k for k in changed)
    else:
        for k, v in frozen.state_dict().items():
            assert torch.equal(v, initial[k]), k


def test_several_updates_per_batch_reuse_the_round_and_resume_mid_round(tmp_path, assets):
    """updates_per_batch=2: both updates of a round train on its rollout against the anchor
    replayed before its first update (a real ratio, ~1 on the first update, not 1 by
    construction); a run resumed in the middle of a round reloads the round (with its
    anchor) and ends bitwise equal (and refuses when the round file is gone)."""

    def config(run_dir: Path) -> dict:
        return grpo_config(
            run_dir,
            assets,
            algorithm={"updates_per_batch": 2, "kl": {"type": "none", "coef": 0.0}},
            trainer={"total_updates": 4, "optimizer": {"lr": 3e-2}},
            checkpoint={"every_updates": 1, "keep_last": 0},
        )

    trainer = make_grpo_trainer(config(tmp_path / "a"))
    first = trainer.source.global_batch(0)
    assert trainer.source.global_batch(1) is first
    assert all(t.old_logp is not None and t.advantage is not None for t in first)
    metrics = fit_metrics(trainer)
    assert [m["rollout/reused"] for m in metrics] == [0.0, 1.0, 0.0, 1.0]
    assert [m["policy/ratio_is_one_by_construction"] for m in metrics] == [0.0] * 4
    # the first update's old log-probs are its own policy's replay: the same kernels on the
    # same micro-batches, so the ratio is exactly 1; the second's moved by an update
    assert metrics[0]["policy/ratio_mean"] == 1.0
    assert abs(metrics[1]["policy/ratio_mean"] - 1) > 1e-6
    assert metrics[1]["reward/total_mean"] == metrics[0]["reward/total_mean"]
    rounds = sorted(p.name for p in (tmp_path / "a" / "rollouts").iterdir())
    assert rounds == ["round-000000-rank0.pt", "round-000002-rank0.pt"]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "update-000004")
    saved = tmp_path / "round.pt"
    shutil.move(tmp_path / "b" / "rollouts" / rounds[1], saved)
    with pytest.raises(RuntimeError, match="update 4 trains on the rollout batch of update 3"):
        fit_metrics(make_grpo_trainer(config(tmp_path / "b")))
    shutil.move(saved, tmp_path / "b" / "rollouts" / rounds[1])
    assert len(fit_metrics(make_grpo_trainer(config(tmp_path / "b")))) == 1
    reference = checkpoint_tensors(tmp_path / "a" / "checkpoints" / "update-000004")
    resumed = checkpoint_tensors(tmp_path / "b" / "checkpoints" / "update-000004")
    assert_same_state(reference[0], resumed[0], "model")
    assert_same_state(reference[1], resumed[1], "optimizer")


class _Raises(RewardPlugin):
    name = "raises"

    def score(self, samples, responses):
        if any(s.id == "prompt-1/2" for s in samples):
            raise RuntimeError("scorer crashed")
        return [0.5] * len(samples)


class _NaN(RewardPlugin):
    name = "nan_score"

    def score(self, samples, responses):
        return [float("nan") if s.id == "prompt-0/3" else 0.5 for s in samples]


class _Short(RewardPlugin):
    name = "short_output"

    def score(self, samples, responses):
        return [0.5] * (len(samples) - 1)


@pytest.mark.parametrize(
    "plugin, match",
    [
        (_Raises, r"update 1: reward plugin 'raises' failed on sample 'prompt-1/2': raised "),
        (_NaN, r"update 1: reward plugin 'nan_score' failed on sample 'prompt-0/3': .*non-finite"),
        (_Short, r"update 1: reward plugin 'short_output' failed on sample 'prompt-0/0': .*shape"),
    ],
)
def test_a_failing_reward_plugin_fails_the_update_or_scores_zero(
    tmp_path, assets, monkeypatch, plugin, match
):
    monkeypatch.setitem(PLUGINS, plugin.name, plugin)
    cfg = grpo_config(tmp_path / "raise", assets, reward={"plugins": [{"name": plugin.name}]})
    with pytest.raises(RewardError, match=match + r".*dataset row 't2i-train-"):
        fit_metrics(make_grpo_trainer(cfg))
    zero = grpo_config(
        tmp_path / "zero", assets, reward={"plugins": [{"name": plugin.name}], "on_error": "zero"}
    )
    metrics = fit_metrics(make_grpo_trainer(zero))
    expected_errors = 8.0 if plugin is _Short else 1.0
    assert metrics[0][f"reward/{plugin.name}/n_errors"] == expected_errors
    assert len(metrics) == 2


def _final(run_dir: Path):
    return checkpoint_tensors(run_dir / "checkpoints" / "update-000006")


def _updates(run_dir: Path) -> list[int]:
    return [json.loads(x)["update"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sigkill_during_rollout_and_checkpoint_write_resumes_bitwise(tmp_path, assets):
    def config(name: str) -> Path:
        cfg = grpo_config(
            tmp_path / name,
            assets,
            data={"tasks": ["t2i", "i2t_mc"]},
            rollout={"max_new_tokens": 20, "length_semantics": "cap"},
            reward={
                "plugins": [
                    {"name": "digit_classifier", "path": str(assets["clf"]), "tasks": ["t2i"]},
                    {"name": "mc_exact", "tasks": ["i2t_mc"]},
                ],
                "truncated_reward": "keep",
            },
            trainer={"total_updates": 6, "micro_batch_size": 4, "micro_token_budget": 160},
        )
        return write_config(tmp_path / f"{name}.yaml", cfg)

    fit_metrics(make_grpo_trainer(load_config(config("ref"))))  # one thread, as the subprocesses
    path = config("killed")
    for fault in ("rollout:3", "checkpoint_write:4"):
        killed = run_cli(["train", str(path)], env_extra={"UNIWEAVE_FAULT": fault})
        assert killed.returncode == -9, (fault, killed.stderr[-2000:])
    resumed = run_cli(["train", str(path)])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    reference, final = _final(tmp_path / "ref"), _final(tmp_path / "killed")
    assert_same_state(reference[0], final[0], "model")
    assert_same_state(reference[1], final[1], "optimizer")
    assert _updates(tmp_path / "killed") == list(range(1, 7))
    ref_lines = (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()
    got_lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    for a, b in zip(ref_lines, got_lines):
        ra, rb = json.loads(a), json.loads(b)
        assert ra["reward/total_mean"] == rb["reward/total_mean"]
        assert ra["loss"] == rb["loss"]


def _ddp_config(run_dir: Path, assets: dict) -> dict:
    """Adam eps 1e-3: the classifier's rewards agree across the two layouts to float32
    rounding only, and with eps 1e-8 an element whose gradient is at rounding level gets
    a sign-like step either way (up to lr apart); eps 1e-3 keeps the step smooth in the
    gradient, so the weights compare what the layouts compute, not that amplification."""
    cfg = grpo_config(
        run_dir,
        assets,
        data={"tasks": ["t2i", "i2t_mc"]},
        rollout={"max_new_tokens": 20, "length_semantics": "cap", "batch_size": 1},
        reward={
            "plugins": [
                {"name": "digit_classifier", "path": str(assets["clf"]), "tasks": ["t2i"]},
                {"name": "mc_exact", "tasks": ["i2t_mc"]},
            ],
            "truncated_reward": "keep",
        },
        algorithm={"scope": "global"},
    )
    cfg["trainer"]["optimizer"] = {**cfg["trainer"].get("optimizer", {}), "eps": 1e-3}
    return cfg


def _ddp_worker(rank: int, cfg: dict, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cfg = validate_config({**cfg, "trainer": {**cfg["trainer"], "parallel": "ddp"}})
        info = DistInfo(rank=rank, world_size=2)
        model = build_model(cfg).train()
        source, objective = build_grpo_job(cfg, model, Path(cfg.run.output_dir), info)
        pad = SpecialIds.from_tokenizer(model.tokenizer).pad
        for _ in Trainer(model, source, objective, cfg, Path(cfg.run.output_dir), info, pad).fit():
            pass
    finally:
        dist.destroy_process_group()


def test_two_rank_run_shards_rollouts_and_matches_one_process(tmp_path, assets):
    """Rollouts split across 2 gloo ranks, each rank scoring the rows it sampled, and
    gathered give the 1-process run (rows decoded one at a time, so batching cannot
    change a sampled token; the classifier scores 4 rows per call instead of 8, so its
    GEMMs may round differently: rewards agree to float32 precision, not bitwise)."""
    one = make_grpo_trainer(_ddp_config(tmp_path / "p1", assets))
    fit_metrics(one)
    cfg = _ddp_config(tmp_path / "p2", assets)
    mp.spawn(_ddp_worker, args=(cfg, str(tmp_path / "init")), nprocs=2, join=True)
    runs = [tmp_path / "p1", tmp_path / "p2"]
    final = [checkpoint_tensors(r / "checkpoints" / "update-000002")[0] for r in runs]
    # float32 gradients of the two layouts differ by two paths' rounding (tolerances.py),
    # each element at most the clip norm; Adam's step lr m/(sqrt(v) + eps) moves by at most
    # lr dg / eps per update for a gradient change dg; plus each update's own rounding
    opt = validate_config(cfg).trainer
    batch = TrajectoryBatch.collate(one.source.global_batch(1), one.pad_id)
    dg = reduction_bound(opt.grad_clip, _grad_reductions(one.model, batch) + len(batch))
    updates = 2
    for name, value in final[0].items():
        tol = updates * opt.optimizer.lr * dg / opt.optimizer.eps
        tol += elementwise_bound(magnitude(value), updates)
        assert_within((value - final[1][name]).abs(), tol, name)
    for one, two in zip(*[read_metrics(r / "metrics.jsonl") for r in runs]):
        assert one["reward/total_mean"] == pytest.approx(two["reward/total_mean"], rel=1e-6)
        assert one["reward/truncated_frac"] == two["reward/truncated_frac"]
        assert one["rollout/n_rows"] == two["rollout/n_rows"] == 8


@pytest.mark.parametrize("task", ["i2t_mc", "t2i"])
def test_jsd_to_the_reference_matches_full_distributions(tmp_path, assets, task):
    """The chunked JSD path (reference chunks rebuilt from its hidden states inside each
    checkpointed chunk) gives the loss and gradient of an independent computation over
    the full distributions at every scored position (rows with advantage 0, so the loss
    is the penalty alone)."""
    cfg = grpo_config(
        tmp_path / task,
        assets,
        task=task,
        algorithm={"kl": {"type": "jsd", "coef": 0.7}, "chunk_size": 5},
        trainer={"micro_batch_size": 8},
    )
    trainer = make_grpo_trainer(cfg)
    model = trainer.model
    trajs = trainer.source.global_batch(0)
    for t in trajs:
        t.advantage = 0.0
    batch = TrajectoryBatch.collate(trajs, trainer.pad_id)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # move the policy away from the (frozen, initial) reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    mask = scored_mask(batch)
    n = int(mask.sum())
    model.zero_grad()
    loss, stats = trainer.objective.loss(model, batch, n)
    loss.backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    def full_logp(m, hidden):
        text = torch.log_softmax(m.text_logits(hidden).double(), -1)
        vis = torch.log_softmax(m.visual_logits(hidden).double(), -1)
        return text, vis

    model.zero_grad()
    hidden = body_hidden(model, batch)[:, :-1]
    with torch.no_grad():
        ref_hidden = body_hidden(trainer.objective.reference.frozen, batch)[:, :-1]
    visual = (batch.modality == Modality.VISUAL)[:, 1:]
    rows = mask[:, 1:]
    total = torch.zeros((), dtype=torch.float64)
    scale = 1.0
    for policy_lp, ref_lp, where in zip(
        full_logp(model, hidden),
        full_logp(trainer.objective.reference.frozen, ref_hidden),
        (rows & ~visual, rows & visual),
    ):
        p, q = policy_lp[where].exp(), ref_lp[where].exp()
        scale = max(scale, magnitude(policy_lp[where]))
        m = 0.5 * (p + q)
        jsd = 0.5 * (p * (p.log() - m.log())).sum(-1) + 0.5 * (q * (q.log() - m.log())).sum(-1)
        total = total + jsd.sum()
    expected = 0.7 * total / n
    expected.backward()
    assert n > 10 and float(expected.detach()) > 1e-4
    # float32 forwards (the chunked path's, body_hidden's): a position's JSD moves by at
    # most its log-probs' error (its slope in each log-prob is a probability-weighted
    # log-ratio: the slopes sum to <= 1), 0.7 x that, plus the mean over the positions
    fwd = tiny_decoder_reductions(model.config, batch.token_ids.shape[1])
    tol = 0.7 * logprob_bound(scale, fwd) + reduction_bound(float(expected.detach()), n)
    assert_within(abs(float(loss.detach()) - float(expected.detach())), tol, "jsd loss")
    assert stats["kl_sum"] == pytest.approx(float(total.detach()), rel=1e-5)
    assert any(g.abs().max() > 1e-4 for g in got.values())
    n_grad = _grad_reductions(model, batch)
    for name, p in model.named_parameters():
        mine = got.get(name, torch.zeros_like(p)).double()
        theirs = torch.zeros_like(mine) if p.grad is None else p.grad.double()
        tol = reduction_bound(magnitude(theirs), n_grad)
        assert_within((mine - theirs).abs(), tol, name)


def test_sigkill_during_a_round_of_two_updates_resumes_bitwise(tmp_path, assets):
    """updates_per_batch=2: SIGKILLed after the first and after the second update of a
    round (before the checkpoint), the run resumes mid-round from the round file (batch,
    advantages, anchor) and ends bitwise equal to the uninterrupted run."""

    def config(name: str) -> dict:
        return grpo_config(
            tmp_path / name,
            assets,
            algorithm={"updates_per_batch": 2, "kl": {"type": "k3", "coef": 0.05}},
            trainer={"total_updates": 4, "optimizer": {"lr": 3e-2}},
            checkpoint={"every_updates": 1, "keep_last": 0},
        )

    fit_metrics(make_grpo_trainer(config("ref")))  # one thread, as the subprocesses
    path = write_config(tmp_path / "killed.yaml", config("killed"))
    for fault in ("after_update:2", "after_update:4"):
        killed = run_cli(["train", str(path)], env_extra={"UNIWEAVE_FAULT": fault})
        assert killed.returncode == -9, (fault, killed.stderr[-2000:])
    assert sorted(p.name for p in (tmp_path / "killed" / "rollouts").iterdir()) == [
        "round-000000-rank0.pt",
        "round-000002-rank0.pt",
    ]
    resumed = run_cli(["train", str(path)])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    ref = checkpoint_tensors(tmp_path / "ref" / "checkpoints" / "update-000004")
    final = checkpoint_tensors(tmp_path / "killed" / "checkpoints" / "update-000004")
    assert_same_state(ref[0], final[0], "model")
    assert_same_state(ref[1], final[1], "optimizer")
    exported = load_file(str(tmp_path / "killed" / "model" / "model.safetensors"))
    assert_same_state(ref[0], exported, "exported model")
    assert _updates(tmp_path / "killed") == [1, 2, 3, 4]
