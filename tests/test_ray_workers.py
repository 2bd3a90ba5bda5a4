"""Ray rollout and reward workers (`rollout.workers`, `reward.workers`): GRPO and OPD
with 2 rollout actors and 1 reward actor against the in-process run — trajectories,
rewards (OPD: verification and routes) and parameters after 2 updates, bitwise — also
when a rollout actor's process dies during an update; a stale policy version is refused;
config-time refusals.

Bitwise, not approximately: each rollout actor decodes whole engine batches
(`rollout.batch_size` rows, the in-process split) with the same thread count (1) on the
same device, the single reward actor scores the whole batch in one call as the
in-process service does, and the driver trains on the same rows, so every floating-point
operation is the same one on the same operands.

One local Ray instance (4 logical CPUs: 3 actors of 1 CPU each, on this 2-core machine)
serves the module; every run starts real actor processes (importing torch and uniweave),
so each Ray run pays several seconds of start-up. The equivalence tests are in the fast
suite; the death, restart-budget and stale-version tests are marked slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import checkpoint_tensors, opd_config, tiny_config

from uniweave.config import ConfigError, validate_config
from uniweave.data.tokenizer import SpecialIds
from uniweave.models.build import build_model
from uniweave.train.distributed.comm import DistInfo
from uniweave.train.engine.lora import adapter_state
from uniweave.train.engine.trainer import Trainer
from uniweave.train.methods.grpo.job import build_grpo_job
from uniweave.train.methods.opd.job import build_opd_job
from uniweave.train.onpolicy.workers import RayPlan, StaleWeightsError, start_workers
from uniweave.train.run import _prepare_model

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_session():
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each actor (ray.*_cpus = 1)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    torch.set_num_threads(torch_threads)


@pytest.fixture(scope="module")
def assets(small_vq_dir, classifier_dir):
    return {"vq": small_vq_dir, "clf": classifier_dir}


def config(
    run_dir: Path, assets: dict, rollout_workers: int = 0, reward_workers: int = 0, lora=False
):
    """Tiny t2i GRPO: 2 prompts x G=4, engine batches of 4 rows (two per update)."""
    trainer = {"total_updates": 2, "global_batch_size": 8, "micro_batch_size": 4}
    return validate_config(
        tiny_config(
            run_dir,
            assets["vq"],
            model={"visual_head": "vq", "codec": {"path": str(assets["vq"]), "codebook_size": 16}},
            data={"tasks": ["t2i"], "train_size": 16, "val_size": 0, "test_size": 0},
            rollout={
                "max_new_tokens": 16,
                "length_semantics": "exact",
                "batch_size": 4,
                "workers": rollout_workers,
            },
            reward={
                "plugins": [{"name": "digit_classifier", "path": str(assets["clf"])}],
                "workers": reward_workers,
            },
            algorithm={"name": "grpo", "group_size": 4, "kl": {"type": "k3", "coef": 0.05}},
            trainer={**trainer, **({"lora": {"enabled": True, "r": 4}} if lora else {})},
        )
    )


def train(cfg) -> tuple[list, int, list[str]]:
    """Fit `cfg` in this process (the driver) as `uniweave train` builds it: the rollout
    batch of every update, how many rollout actors were replaced, and the names of the
    last weights pushed to them."""
    run_dir = Path(cfg.run.output_dir)
    model = _prepare_model(cfg, run_dir, torch.device("cpu"))
    source, objective = build_grpo_job(cfg, model, run_dir, DistInfo())
    pad = SpecialIds.from_tokenizer(model.tokenizer).pad
    lora = cfg.trainer.lora.enabled
    state = (lambda: adapter_state(model)) if lora else None
    trainer = Trainer(model, source, objective, cfg, run_dir, DistInfo(), pad, state)
    try:
        rollouts = [source.rollout(update - 1) for update, _ in trainer.fit()]
        remote = source.workers.rollout if source.workers is not None else None
        if remote is None:
            return rollouts, 0, []
        return rollouts, remote.pool.replaced, sorted(ray.get(remote.weights_ref))
    finally:
        source.close()


def assert_same_run(a: Path, ra: list, b: Path, rb: list) -> None:
    assert len(ra) == len(rb) == 2
    for one, two in zip(ra, rb):
        assert one.rewards == two.rewards
        assert [t.seed for t in one.trajectories] == [t.seed for t in two.trajectories]
        for x, y in zip(one.trajectories, two.trajectories):
            assert torch.equal(x.token_ids, y.token_ids), x.sample_id
            assert torch.equal(x.rollout_logp, y.rollout_logp), x.sample_id
            assert x.finish_reason == y.finish_reason
    final = [checkpoint_tensors(r / "checkpoints" / "update-000002")[0] for r in (a, b)]
    assert final[0].keys() == final[1].keys()
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name


@pytest.fixture(scope="module")
def inproc(tmp_path_factory, assets, ray_session):
    """The in-process run (the reference of every Ray run here)."""
    run_dir = tmp_path_factory.mktemp("inproc") / "run"
    rollouts, _, _ = train(config(run_dir, assets))
    assert rollouts[1].rewards != rollouts[0].rewards  # two different batches
    return run_dir, rollouts


def test_two_rollout_actors_and_a_reward_actor_match_the_in_process_run(tmp_path, assets, inproc):
    """2 rollout actors (one engine batch each) + 1 reward actor == in-process, bitwise
    (module docstring): trajectories, rewards, and every parameter after 2 updates."""
    remote, replaced, pushed = train(config(tmp_path / "ray", assets, 2, 1))
    assert replaced == 0
    model = _prepare_model(config(tmp_path / "m", assets), tmp_path / "m", torch.device("cpu"))
    assert pushed == sorted(n for n, _ in model.named_parameters())  # full fine-tuning
    assert_same_run(*inproc, tmp_path / "ray", remote)


@pytest.mark.slow
def test_a_rollout_actor_dying_during_an_update_is_replaced_and_changes_nothing(
    tmp_path, assets, inproc, monkeypatch
):
    """The first rollout actor `os._exit`s (a real process death) when asked for update
    2's rows: it is replaced (initial policy + the pushed version-1 weights), its engine
    batch re-sampled from the same per-row seeds, and the run is still bitwise the
    in-process one."""
    monkeypatch.setenv("UNIWEAVE_FAULT", "rollout_worker:2")
    killed, replaced, _ = train(config(tmp_path / "killed", assets, 2, 1))
    assert replaced == 1
    assert_same_run(*inproc, tmp_path / "killed", killed)


@pytest.mark.slow
def test_lora_pushes_the_adapters_alone_and_matches_the_in_process_run(
    tmp_path, assets, ray_session
):
    """Under LoRA the driver pushes only the adapter tensors (the base stays as the
    actors received it) and the run is bitwise the in-process LoRA run."""
    inproc, _, _ = train(config(tmp_path / "inproc", assets, lora=True))
    remote, _, pushed = train(config(tmp_path / "ray", assets, 2, 1, lora=True))
    assert pushed and all("lora_" in name for name in pushed)
    assert_same_run(tmp_path / "inproc", inproc, tmp_path / "ray", remote)


@pytest.mark.slow
def test_a_dead_worker_past_the_restart_budget_fails_the_update(
    tmp_path, assets, ray_session, monkeypatch
):
    monkeypatch.setenv("UNIWEAVE_FAULT", "rollout_worker:1")
    cfg = config(tmp_path / "r", assets, rollout_workers=2)
    cfg = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"max_worker_restarts": 0})})
    with pytest.raises(Exception, match="max_worker_restarts=0"):
        train(cfg)


@pytest.mark.slow
def test_a_rollout_actor_refuses_a_stale_policy_version(tmp_path, assets, ray_session):
    cfg = config(tmp_path / "r", assets, rollout_workers=1)
    model = build_model(cfg)
    workers = start_workers(cfg, model, {}, version=3)
    try:
        actor = workers.rollout.pool.actors[0]
        with pytest.raises(StaleWeightsError, match="holds policy version 3, asked for 4"):
            ray.get(actor.generate.remote(4, []))
        with pytest.raises(StaleWeightsError):
            workers.rollout.generate(4, [], model.device)
        workers.rollout.sync(4, model)
        assert workers.rollout.generate(4, [], model.device) == []
    finally:
        workers.close()


def test_worker_settings_are_refused_where_they_cannot_act(tmp_path, assets):
    base = config(tmp_path / "r", assets).model_dump()

    def refused(match: str, **sections) -> None:
        cfg = {**base, **{k: {**base[k], **v} for k, v in sections.items()}}
        with pytest.raises(ConfigError, match=match):
            validate_config(cfg)

    refused("ray.address.*acts only with", ray={"address": "auto"})
    refused(
        "trainer.parallel=ddp are not built", rollout={"workers": 2}, trainer={"parallel": "ddp"}
    )
    refused("ray.num_cpus.*cluster", rollout={"workers": 1}, ray={"address": "auto", "num_cpus": 2})
    refused("ray.reward_cpus.*reward.workers", rollout={"workers": 1}, ray={"reward_cpus": 2.0})
    sft = {"name": "sft"}
    with pytest.raises(ConfigError, match="rollout.workers.*built for grpo and opd, not sft"):
        validate_config(
            {**base, "algorithm": sft, "reward": {"plugins": []}, "rollout": {"workers": 1}}
        )
    opd = {"name": "opd", "teacher": {"path": str(tmp_path / "t")}}
    with pytest.raises(ConfigError, match="reward.workers.*acts only with reward.plugins"):
        validate_config({**base, "algorithm": opd, "reward": {"plugins": [], "workers": 1}})
    with pytest.raises(ConfigError, match="trainer.parallel=fsdp2 are not built"):
        rollout, trainer = (
            {**base["rollout"], "workers": 2},
            {**base["trainer"], "parallel": "fsdp2"},
        )
        validate_config({**base, "algorithm": opd, "rollout": rollout, "trainer": trainer})
    plan = RayPlan.from_config(config(tmp_path / "r", assets, rollout_workers=2))
    assert plan.init == {"address": "local", "include_dashboard": False}
    assert plan.rollout_workers == 2


# -- OPD through the rollout and reward actors ---------------------------------------
# The same reasoning as GRPO's (module docstring): the actors decode whole engine batches
# of the same requests (per-row seeds) with 1 thread on CPU, the reward actor verifies
# the whole batch in one call as the in-process service does, and routing, GT replay and
# the teacher's scoring stay in the driver, so the run is the in-process one bitwise.


@pytest.fixture(scope="module")
def opd_assets(tmp_path_factory, assets):
    root = tmp_path_factory.mktemp("opd_ray_teacher")
    out = {"clf": assets["clf"], "vq": assets["vq"]}
    build_model(validate_config(opd_config(root / "x", out, seed=9))).save_pretrained(
        root / "teacher"
    )
    return {**out, "teacher_vq": root / "teacher"}


def opd_ray_config(run_dir: Path, assets: dict, rollout_workers: int = 0, reward_workers: int = 0):
    """Tiny OPD (t2i + i2t_mc, 6 prompts, wrong rows against the answer-privileged
    teacher, failure GT replay): engine batches of 3 rows (two per update, one per
    rollout actor), 2 updates."""
    cfg = opd_config(
        run_dir,
        assets,
        routing="privileged_correction",
        gt_replay={"mode": "failure", "budget": 2},
    )
    cfg["algorithm"]["teacher"] = {"path": str(assets["teacher_vq"]), "privilege": "answer"}
    cfg["rollout"] = {**cfg["rollout"], "batch_size": 3, "workers": rollout_workers}
    cfg["reward"] = {**cfg["reward"], "workers": reward_workers}
    cfg["checkpoint"] = {"every_updates": 0}
    return validate_config(cfg)


def opd_train(cfg) -> tuple[list, int]:
    """Fit the OPD `cfg` in this process as `uniweave train` builds it: per update (the
    sampled trajectories, the routing / verification record), and how many rollout
    actors were replaced."""
    run_dir = Path(cfg.run.output_dir)
    model = _prepare_model(cfg, run_dir, torch.device("cpu"))
    source, objective = build_opd_job(cfg, model, run_dir, DistInfo())
    trainer = Trainer(model, source, objective, cfg, run_dir, DistInfo(), model.special_ids.pad)
    try:
        batches = [source.rollout_record(update - 1) for update, _ in trainer.fit()]
        remote = source.workers.rollout if source.workers is not None else None
        return batches, 0 if remote is None else remote.pool.replaced
    finally:
        source.close()


def assert_same_opd_run(a: Path, ra: list, b: Path, rb: list) -> None:
    assert len(ra) == len(rb) == 2
    for (ta, rec_a), (tb, rec_b) in zip(ra, rb):
        assert rec_a == rec_b  # verification, routes, GT replay selection
        assert len(ta) == len(tb) == 6
        for x, y in zip(ta, tb):
            assert x.seed == y.seed and x.finish_reason == y.finish_reason, x.sample_id
            assert torch.equal(x.token_ids, y.token_ids), x.sample_id
            assert torch.equal(x.visual_codes, y.visual_codes), x.sample_id
            assert torch.equal(x.rollout_logp, y.rollout_logp), x.sample_id
    final = [checkpoint_tensors(r / "checkpoints" / "update-000002")[0] for r in (a, b)]
    assert final[0].keys() == final[1].keys()
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name


@pytest.fixture(scope="module")
def opd_inproc(tmp_path_factory, opd_assets, ray_session):
    run_dir = tmp_path_factory.mktemp("opd_inproc") / "run"
    batches, _ = opd_train(opd_ray_config(run_dir, opd_assets))
    assert batches[0][1] != batches[1][1]  # two different batches
    assert any(r["route"] == "privileged" for _, rec in batches for r in rec["rows"])
    return run_dir, batches


def test_opd_through_two_rollout_actors_and_a_reward_actor_matches_in_process(
    tmp_path, opd_assets, opd_inproc
):
    """OPD with rollout.workers 2 and reward.workers 1 == in-process, bitwise: the
    students' own trajectories (sampled from the pushed current weights), verification
    and routing, and every parameter after 2 updates."""
    remote, replaced = opd_train(opd_ray_config(tmp_path / "ray", opd_assets, 2, 1))
    assert replaced == 0
    assert_same_opd_run(*opd_inproc, tmp_path / "ray", remote)


@pytest.mark.slow
def test_opd_rollout_actor_dying_during_an_update_is_replaced_and_changes_nothing(
    tmp_path, opd_assets, opd_inproc, monkeypatch
):
    """The first rollout actor dies when asked for update 2's rows (after version 1 was
    pushed): replaced from the initial student + version 1, its engine batch re-sampled,
    the run still bitwise the in-process one."""
    monkeypatch.setenv("UNIWEAVE_FAULT", "rollout_worker:2")
    killed, replaced = opd_train(opd_ray_config(tmp_path / "killed", opd_assets, 2, 1))
    assert replaced == 1
    assert_same_opd_run(*opd_inproc, tmp_path / "killed", killed)
