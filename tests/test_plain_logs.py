"""Logs outside a terminal (issue 30 item 5): with stdout and stderr redirected to files
(no TTY, CI unset) `uniweave train` prints one plain line per logged update, says where it
resumed from after a kill, prints the final metrics (eval.json's), and a Ctrl-C says which
checkpoint was saved. The runs are `uniweave` processes forked from one that imported torch
once (`trainer_helpers.ForkedCLI`), whose fds 1 and 2 are files."""

from __future__ import annotations

import json
import re

import pytest
from trainer_helpers import ForkedCLI, fit_small_codec, tiny_config, write_config

from uniweave.train.engine.metrics import progress_line

LINE = re.compile(
    r"^update (\d+)/4  loss \d+\.\d{4}  lr \S+  \d+\.\d\d s/update  ETA \d+:\d\d:\d\d$", re.M
)


def test_progress_line_shows_only_what_the_update_logged():
    assert "reward" not in progress_line(3, 10, {"loss": 0.5}, 2.0)
    assert progress_line(3, 10, {"loss": 0.5, "lr": 1e-4}, 2.0) == (
        "update 3/10  loss 0.5000  lr 0.0001  2.00 s/update  ETA 0:00:14"
    )


@pytest.fixture(scope="module")
def cli():
    return ForkedCLI()


def test_grpo_progress_lines_show_reward_kl_and_zero_variance_share(tmp_path, cli):
    """A real GRPO run's plain lines carry the values its metrics.jsonl holds for that
    update: the reward service's mean, the KL to the reference, the zero-variance share
    (the line once looked for keys no method writes)."""
    codec = fit_small_codec(tmp_path / "vq")
    run = tmp_path / "run"
    cfg = tiny_config(
        run,
        codec,
        data={"tasks": ["i2t_mc"], "train_size": 4, "val_size": 0, "test_size": 0},
        trainer={"total_updates": 2, "global_batch_size": 4, "micro_batch_size": 4},
        algorithm={"name": "grpo", "group_size": 2, "kl": {"type": "k3", "coef": 0.01}},
        reward={"plugins": [{"name": "mc_exact"}]},
        rollout={"max_new_tokens": 4},
        logging={"every": 1, "tensorboard": False},
        health={"baseline_eval": False},
    )
    config = str(write_config(tmp_path / "c.yaml", cfg))
    done = cli.run(["train", config], tmp_path, {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    by_update = {int(m["update"]): m for m in logged if "loss" in m}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("update ")]
    assert len(lines) == 2
    for line in lines:
        m = by_update[int(line.split()[1].split("/")[0])]
        for label, key, fmt in (
            ("reward", "reward/total_mean", ".4f"),
            ("kl", "policy/kl_ref_mean", ".3g"),
            ("zero-var", "adv/frac_zero_std_groups", ".2f"),
        ):
            assert f"  {label} {m[key]:{fmt}}  " in line, (label, line)


def test_train_outside_a_terminal_logs_lines_resume_point_and_final_metrics(tmp_path, cli):
    codec = fit_small_codec(tmp_path / "vq")
    run = tmp_path / "run"
    cfg = tiny_config(
        run,
        codec,
        data={"tasks": ["i2t_mc"], "train_size": 4, "val_size": 0, "test_size": 2},
        trainer={"total_updates": 4, "global_batch_size": 2, "micro_batch_size": 2},
        rollout={"max_new_tokens": 4},
        logging={"every": 1, "tensorboard": False, "progress_bar": True},
    )
    config = str(write_config(tmp_path / "c.yaml", cfg))
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}

    # Ctrl-C after update 3: exit 130, naming the last checkpoint (update 2)
    stopped = cli.run(
        ["train", config], tmp_path, {**env, "UNIWEAVE_FAULT": "after_update:3:SIGINT"}
    )
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    assert [int(n) for n in LINE.findall(stopped.stdout)] == [1, 2, 3]
    # the baseline evaluation announces itself (health.baseline_eval), before update 1
    evals = run / "evals"
    start = f"evaluating the starting model on test (2 rows per task at most) into {evals}"
    assert stopped.stdout.index(start) < stopped.stdout.index("update 1/4")
    saved = run / "checkpoints" / "update-000002"
    assert stopped.stderr.strip().endswith(
        f"interrupted; last checkpoint {saved}; run the same command to resume from it"
    )

    # SIGKILL after update 3 of the resumed run (it resumes from update 2 again)
    killed = cli.run(["train", config], tmp_path, {**env, "UNIWEAVE_FAULT": "after_update:3"})
    assert killed.returncode == -9
    assert f"resumed from update 2 ({saved}); 2 updates to go" in killed.stdout

    done = cli.run(["train", config], tmp_path, env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from update 2 ({saved}); 2 updates to go" in done.stdout
    assert [int(n) for n in LINE.findall(done.stdout)] == [3, 4]
    final = f"evaluating the model at update 4 on test (2 rows per task at most) into {evals}"
    assert done.stdout.index("update 4/4") < done.stdout.index(final)
    assert start not in done.stdout  # the baseline is not evaluated again on resume
    # the run log holds the console's status lines of all three processes, timestamped
    log = (run / "train.log").read_text().splitlines()
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")
    assert log and all(stamp.match(line) for line in log)
    text = "\n".join(stamp.sub("", line) for line in log)
    for shown in (stopped.stdout, killed.stdout, done.stdout):
        for line in shown.splitlines():
            if LINE.match(line) or line.startswith(("training ", "resumed ", "evaluat")):
                assert line in text, line
    assert [int(n) for n in LINE.findall(text)] == [
        1,
        2,
        3,
        3,
        3,
        4,
    ]  # stopped 1-3, killed 3, done 3-4
    results = json.loads((run / "eval.json").read_text())
    tail = done.stdout.split(f"final metrics ({run / 'eval.json'}):\n", 1)[1]
    shown = dict(line.split() for line in tail.splitlines())
    assert shown.keys() == results.keys() and "i2t_mc/accuracy" in shown
    # bound: not precision: cli._metric_lines prints 4 decimals, half a unit in the last place
    assert all(float(shown[k]) == pytest.approx(v, abs=5e-5) for k, v in results.items())

    # `uniweave eval` on the exported model prints its summary, one block per task
    out = tmp_path / "eval"
    argv = ["eval", config, f"model.path={run / 'model'}", "evaluation.split=test"]
    evaluated = cli.run([*argv, f"evaluation.output_dir={out}"], tmp_path, env)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())["tasks"]["i2t_mc"]
    lines = evaluated.stdout.split("i2t_mc:\n", 1)[1].splitlines()
    assert {line.split()[0] for line in lines} == summary.keys()
