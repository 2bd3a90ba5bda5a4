"""A fourth method, defined here and nowhere else, plugs in through the method registry
(`uniweave.config.methods`): a REINFORCE-style objective on the tiny model.

REINFORCE draws `global_batch_size / samples_per_prompt` prompts per update, samples each
`samples_per_prompt` times with the policy, scores the rows with the reward plugins and
trains on the reward-weighted log-likelihood of the sampled tokens,

    loss = -(1/N) Σ_i A_i Σ_t log pi(y_it | y_i<t),   A_i = r_i - mean(r)  (baseline mean)
                                                       A_i = r_i            (baseline none)

Registering its `MethodSpec` is all it takes: the config schema accepts
`algorithm.name: reinforce` with its keys (and refuses what its own check refuses),
`uniweave train` (`run_train`) trains it 3 updates and resumes it bit for bit from a
checkpoint, and `inspect`, `plan` and `config describe` know its keys — no file outside
this test changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import yaml
from pydantic import Field
from tolerances import reduction_bound
from trainer_helpers import assert_same_state, checkpoint_tensors, tiny_config

from uniweave import cli
from uniweave.config import validate_config
from uniweave.config.base import StrictModel, incompatible
from uniweave.config.methods import MethodSpec, method, register_method, unregister_method
from uniweave.core.seeding import seed_for
from uniweave.replay import replay_logprobs
from uniweave.rewards import PLUGINS, RewardPlugin, build_reward_service
from uniweave.rollout.config import sampling_params
from uniweave.rollout.service import RolloutService
from uniweave.train.engine.protocols import BatchSource, Objective
from uniweave.train.onpolicy.prompts import PromptSampler, prompt_pools, rollout_request
from uniweave.train.onpolicy.scoring import score_sharded
from uniweave.train.run import run_train

ROOT = Path(__file__).resolve().parents[1]


class ReinforceConfig(StrictModel):
    """REINFORCE: reward-weighted log-likelihood of the policy's own samples."""

    name: Literal["reinforce"] = Field("reinforce", description="Algorithm selector.")
    samples_per_prompt: int = Field(
        2, ge=1, description="Samples per prompt (prompts per update = global_batch_size / it)."
    )
    baseline: Literal["mean", "none"] = Field(
        "mean", description="mean: A = r - mean(r) over the update's rows; none: A = r."
    )


class ReinforceSource(BatchSource):
    logs_samples = False

    def __init__(self, cfg, model, info) -> None:
        r, algo = cfg.rollout, cfg.algorithm
        self.model, self.algo, self.seed = model, algo, cfg.run.seed
        self.service = RolloutService(
            model, r.batch_size, info.rank, info.world_size, info.cpu_group, r.precision
        )
        self.prompts = PromptSampler(prompt_pools(cfg, model), cfg.data.task_weights, cfg.data.seed)
        self.rewards = build_reward_service(cfg.reward, decode_images=model.codec.decode)
        self.params, self.grid = sampling_params(r), tuple(model.codec.grid)
        self.n_prompts = cfg.trainer.global_batch_size // algo.samples_per_prompt
        self.cache: tuple[int, list, dict] | None = None

    def _make(self, update: int) -> tuple[int, list, dict]:
        samples, requests = [], []
        for i, prompt in enumerate(self.prompts.prompts(update, self.n_prompts)):
            for m in range(self.algo.samples_per_prompt):
                member = prompt.fork(m)
                samples.append(member)
                seed = seed_for(self.seed, update, i, m)
                requests.append(rollout_request(member, seed, self.params, self.grid))
        indices, local = self.service.generate_assigned(requests, lambda: None)
        trajs, result = score_sharded(
            self.service, self.rewards, self.model.parse_response, samples, local, indices
        )
        total = result.total.double()
        adv = total - total.mean() if self.algo.baseline == "mean" else total
        for traj, value in zip(trajs, adv.tolist()):
            traj.advantage = value
        metrics = {"reward/total_mean": float(total.mean()), "adv/mean": float(adv.mean())}
        return update, trajs, metrics

    def _batch(self, update: int) -> tuple[int, list, dict]:
        if self.cache is None or self.cache[0] != update:
            self.cache = self._make(update)
        return self.cache

    def global_batch(self, update: int) -> list:
        return self._batch(update)[1]

    def batch_metrics(self, update: int) -> dict[str, float]:
        return self._batch(update)[2]


class ReinforceObjective(Objective):
    def count(self, batch) -> int:
        return len(batch)

    def loss(self, model, micro, n_global: int):
        logp = replay_logprobs(model, micro, list(micro.sampling)).logp
        per_row = logp.sum(dim=1)
        adv = micro.advantages.to(per_row)
        loss = -(adv * per_row).sum() / n_global
        return loss, {"logp_sum": float(per_row.detach().sum())}

    def finalize(self, sums: dict[str, float], n_global: int) -> dict[str, float]:
        return {"policy/logp_mean": sums["logp_sum"] / n_global}


def _build_job(cfg, model, run_dir, info):
    return ReinforceSource(cfg, model, info), ReinforceObjective()


def _check(cfg: Any, tasks: set[str] | None) -> None:
    algo = cfg.algorithm
    if cfg.trainer.global_batch_size % algo.samples_per_prompt:
        raise incompatible(
            "algorithm.samples_per_prompt",
            f"{algo.samples_per_prompt} does not divide trainer.global_batch_size="
            f"{cfg.trainer.global_batch_size}",
        )
    if not cfg.reward.plugins:
        raise incompatible("reward.plugins", "reinforce needs at least one reward plugin")


SPEC = MethodSpec(
    name="reinforce",
    config=ReinforceConfig,
    build_job=_build_job,
    rollouts=True,
    check=_check,
    plan_setup=lambda algo: {"chunk": 64},
)


@pytest.fixture
def reinforce():
    register_method(SPEC)
    try:
        yield SPEC
    finally:
        unregister_method(SPEC.name)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reinforce_config(run_dir: Path, codec: Path, **algo) -> dict:
    return tiny_config(
        run_dir,
        codec,
        data={"tasks": ["i2t_mc"], "train_size": 16, "val_size": 0, "test_size": 0},
        rollout={"max_new_tokens": 3, "length_semantics": "cap"},
        reward={"plugins": [{"name": "mc_exact"}], "truncated_reward": "keep"},
        algorithm={"name": "reinforce", **algo},
        trainer={"total_updates": 3, "global_batch_size": 8, "micro_batch_size": 4},
        checkpoint={"every_updates": 1, "keep_last": 0},
        health={"baseline_eval": False},
    )


def test_the_schema_takes_a_registered_method_and_forgets_it_again(tmp_path, reinforce):
    cfg = validate_config(reinforce_config(tmp_path / "r", tmp_path, samples_per_prompt=4))
    assert isinstance(cfg.algorithm, ReinforceConfig)
    assert method("reinforce") is SPEC and cfg.algorithm.samples_per_prompt == 4
    with pytest.raises(ValueError, match="samples_per_prompt"):  # its own check acts
        validate_config(reinforce_config(tmp_path / "r", tmp_path, samples_per_prompt=3))
    with pytest.raises(ValueError, match="clip_low"):  # GRPO's keys are not its keys
        validate_config(reinforce_config(tmp_path / "r", tmp_path, clip_low=0.1))
    # the generic rules read the spec: it trains on rollouts, so sft-only keys are refused
    bad = reinforce_config(tmp_path / "r", tmp_path)
    bad["data"]["shuffle"] = False
    with pytest.raises(ValueError, match="acts only with sft: reinforce draws its prompts"):
        validate_config(bad)
    unregister_method("reinforce")
    with pytest.raises(ValueError, match="reinforce"):
        validate_config(reinforce_config(tmp_path / "r", tmp_path))
    register_method(SPEC)  # the fixture takes it out again


def _write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_inspect_plan_and_describe_know_its_keys(tmp_path, capsys, reinforce, small_vq_dir):
    config = _write(
        tmp_path / "r.yaml", reinforce_config(tmp_path / "run", small_vq_dir, samples_per_prompt=4)
    )
    assert cli.main(["inspect", str(config), "algorithm.baseline=none"]) == 0
    out = capsys.readouterr().out
    assert "samples_per_prompt: 4" in out and "baseline: none" in out
    assert cli.main(["inspect", str(config), "algorithm.samples_per_prompt=3"]) == 2
    assert "algorithm.samples_per_prompt" in capsys.readouterr().err
    assert cli.main(["inspect", str(config), "algorithm.bogus=1"]) == 2
    capsys.readouterr()

    assert cli.main(["config", "describe", "algorithm[reinforce].samples_per_prompt"]) == 0
    out = capsys.readouterr().out
    assert "Samples per prompt" in out
    assert cli.main(["config", "describe", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "one of 'sft', 'grpo', 'opd', 'reinforce'" in out
    assert "sft \\| grpo \\| opd \\| reinforce, chosen by algorithm.name." in out
    assert "| `algorithm[reinforce].samples_per_prompt` | int (>= 1) | `2` |" in out
    assert "| `algorithm[reinforce].baseline` | one of 'mean', 'none' | `\"mean\"` |" in out

    recipe = yaml.safe_load(
        (ROOT / "src/uniweave/assets/recipes/janus_pro/grpo_i2t_mc_lora.yaml").read_text()
    )
    recipe["algorithm"] = {"name": "reinforce", "samples_per_prompt": 4}
    planned = _write(tmp_path / "plan.yaml", recipe)
    argv = ["plan", str(planned), "--preset", "janus-pro-1b"]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert cli.main([*argv, "algorithm.samples_per_prompt=5"]) == 2  # 5 does not divide it
    assert "algorithm.samples_per_prompt" in capsys.readouterr().err
    assert table


class _Spread(RewardPlugin):
    """A reward that differs between samples (an untrained model answers no question): a
    fixed function of the sampled response."""

    name = "response_spread"

    def score(self, samples, responses):
        return [(len(repr(r.parts)) % 5) / 4 for r in responses]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train_config(run_dir: Path, codec: Path):
    cfg = reinforce_config(run_dir, codec)
    cfg["reward"]["plugins"] = [{"name": _Spread.name}]
    return validate_config(cfg)


def test_trains_three_updates_and_resumes_bitwise(tmp_path, monkeypatch, reinforce, small_vq_dir):
    monkeypatch.setitem(PLUGINS, _Spread.name, _Spread)
    whole = _train_config(tmp_path / "a", small_vq_dir)
    run_train(whole)
    cut = _train_config(tmp_path / "b", small_vq_dir)
    run_train(cut, stop_after=1)
    assert [m["update"] for m in _metrics(tmp_path / "b")] == [1]
    run_train(cut)  # resumes from update 1
    assert [m["update"] for m in _metrics(tmp_path / "b")] == [1, 2, 3]
    metrics = _metrics(tmp_path / "a")
    assert [m["update"] for m in metrics] == [1, 2, 3]
    # the mean baseline acts: A = r - mean(r) sums to 0 up to the float32 mean of the
    # batch's rewards (values <= 1) taken twice (mean(r), then mean(A))
    bound = reduction_bound(1.0, 2 * 8)  # global_batch_size 8 (_train_config)
    assert all(abs(m["adv/mean"]) <= bound for m in metrics)
    assert any(m["reward/total_mean"] > 0 for m in metrics)  # some rows scored
    final = "checkpoints/update-000003"
    model_a, opt_a = checkpoint_tensors(tmp_path / "a" / final)
    model_b, opt_b = checkpoint_tensors(tmp_path / "b" / final)
    initial = checkpoint_tensors(tmp_path / "a" / "checkpoints/update-000001")[0]
    assert any(not torch.equal(model_a[k], initial[k]) for k in model_a)  # it trained
    assert_same_state(model_a, model_b, "model")
    assert_same_state(opt_a, opt_b, "optimizer")
