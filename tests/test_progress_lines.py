"""Progress lines show what matters per method (issue 51 item 3), checked on what real
runs write: a 2-update SFT, OPD and GRPO run each on the tiny model prints one plain line
per update (no terminal under pytest), and each line carries the loss and every figure its
method's spec declares (`MethodSpec.progress`), with the value that update's record in
metrics.jsonl holds. A declared key that the method never logs fails here (the line once
looked for a reward key GRPO does not write)."""

from __future__ import annotations

import pytest
from trainer_helpers import grpo_config, opd_config, tiny_config

from uniweave.config import validate_config
from uniweave.config.methods import method
from uniweave.train.engine.metrics import read_metrics
from uniweave.train.run import run_train

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on 1 thread

FAST = {"logging": {"every": 1, "tensorboard": False, "progress_bar": False}}


def _config(name: str, run, assets, tmp_path) -> dict:
    if name == "sft":
        return tiny_config(
            run,
            assets["vq"],
            data={"tasks": ["t2i", "i2t_mc"], "train_size": 4},
            trainer={"total_updates": 2, "global_batch_size": 4, "micro_batch_size": 4},
            **FAST,
        )
    if name == "grpo":
        cfg = grpo_config(run, assets, task="i2t_mc", **FAST)
        cfg["trainer"]["total_updates"] = 2
        cfg["reward"]["truncated_reward"] = "keep"  # the untrained model's capped rows count
        return cfg
    # OPD with a verifier routing: it logs the teacher's figures and the reward
    teacher = tmp_path / "teacher"
    validated = validate_config(opd_config(tmp_path / "x", assets, seed=9))
    from uniweave.train.engine.build import build_model

    build_model(validated).save_pretrained(teacher)
    cfg = opd_config(run, {**assets, "teacher_vq": teacher}, routing="correct_only")
    cfg["data"]["tasks"] = ["i2t_mc"]
    cfg["reward"]["plugins"] = [{"name": "mc_exact"}]
    cfg["rollout"]["max_new_tokens"] = 4
    cfg["trainer"].update(global_batch_size=4, micro_batch_size=4)
    cfg["logging"] = FAST["logging"]
    return cfg


@pytest.mark.parametrize("name", ["sft", "opd", "grpo"])
def test_a_real_runs_progress_lines_show_its_methods_figures(
    tmp_path, capsys, name, small_vq_dir, classifier_dir
):
    assets = {"vq": small_vq_dir, "clf": classifier_dir}
    run = tmp_path / "run"
    cfg = validate_config(_config(name, run, assets, tmp_path))
    capsys.readouterr()
    run_train(cfg)
    shown = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("update ")]
    records = {r["update"]: r for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    assert sorted(records) == [1, 2] and len(shown) == 2
    fields = method(name).progress
    assert (name == "sft") == (not fields)  # SFT's figure is its loss
    for line in shown:
        m = records[int(line.split()[1].split("/")[0])]
        assert line.startswith(f"update {m['update']}/2  loss {m['loss']:.4f}  "), line
        for label, key, fmt in fields:
            assert key in m, (name, key, sorted(m))  # the method logs what it declares
            assert f"  {label} {m[key]:{fmt}}  " in line, (label, line)
