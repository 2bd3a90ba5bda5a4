"""`uniweave demo`: codec -> SFT -> GRPO (text-to-image) -> a report, on a CPU.

1. SFT of the tiny VQ model from scratch on the five digits tasks
   (`recipes/digits/sft_vq.yaml` with `sft_updates` updates; the default 1,500 is past
   the multiple-choice plateau at the recipe's constant lr);
2. GRPO on text-to-image from that checkpoint (`recipes/digits/grpo_t2i_vq.yaml`), rewarded
   by the digits classifier's p(asked digit | decoded image);
3. `report.md` with every SFT task's held-out (test split) metrics for the seed-initialised
   model SFT starts from and after SFT, those of GRPO before and after (all from the one
   evaluator, `uniweave.train.run.evaluate_split`: `<run>/evals/test-update-NNNNNN`), the reward
   curve with its least-squares drift and noise band (`reward_curve.png`) and the images
   drawn for every digit before and after from the same seeds (`before_after.png`).

Each stage is an ordinary run directory under `--out`, so re-running the demo resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

from uniweave.config import load_config
from uniweave.config.packaged import recipes_root
from uniweave.demo_figures import before_after_png, draw_digits, markdown_table, reward_curve_png
from uniweave.eval.run_report import REPORT_JSON
from uniweave.eval.runner import task_metrics
from uniweave.models import load_model
from uniweave.train.run import EVALS, run_train

RECIPES = recipes_root() / "digits"  # the packaged recipes: the demo runs from a wheel too
REWARD_KEY = "reward/total_mean"
PER_DIGIT = 4


def _baseline(run_dir: Path) -> dict[str, float]:
    """The test metrics of a run's starting model (its update-0 evaluation)."""
    summary = run_dir / EVALS / f"test-update-{0:06d}" / "summary.json"
    return task_metrics(json.loads(summary.read_text()))


def run_demo(out: Path, sft_updates: int, grpo_updates: int, recipes: Path = RECIPES) -> Path:
    """Run the three stages into `out` and return the path of the report."""
    out.mkdir(parents=True, exist_ok=True)
    sft_cfg = load_config(
        recipes / "sft_vq.yaml",
        [
            f"run.output_dir={out / 'sft'}",
            f"trainer.total_updates={sft_updates}",
            f"trainer.scheduler.warmup_steps={min(20, sft_updates)}",
        ],
    )
    grpo_cfg = load_config(
        recipes / "grpo_t2i_vq.yaml",
        [
            f"run.output_dir={out / 'grpo'}",
            f"model.path={out / 'sft' / 'model'}",
            f"trainer.total_updates={grpo_updates}",
        ],
    )
    sft_dir = run_train(sft_cfg)
    sft_model = load_model(sft_dir / "model").eval()
    # The model SFT started from (its seed), evaluated as SFT's final evaluation is: the
    # run's own baseline evaluation (health.baseline_eval, evals/test-update-000000).
    random_init = _baseline(sft_dir)
    # GRPO's update 0 (the SFT model): the run's own baseline evaluation
    # (health.baseline_eval, evals/test-update-000000), scored as its final one is.
    n_test = grpo_cfg.data.test_size
    grpo_dir = run_train(grpo_cfg)
    before = _baseline(grpo_dir)
    after = json.loads((grpo_dir / "eval.json").read_text())
    verdicts = json.loads((grpo_dir / REPORT_JSON).read_text())["verdicts"]
    grpo_model = load_model(grpo_dir / "model").eval()
    fit = reward_curve_png(grpo_dir / "metrics.jsonl", REWARD_KEY, out / "reward_curve.png")
    seed = grpo_cfg.run.seed + 1
    before_after_png(
        draw_digits(sft_model, PER_DIGIT, seed),
        draw_digits(grpo_model, PER_DIGIT, seed),
        PER_DIGIT,
        out / "before_after.png",
    )
    sft_eval = json.loads((sft_dir / "eval.json").read_text())
    report = out / "report.md"
    report.write_text(
        "\n".join(
            [
                "# uniweave demo: digits SFT -> GRPO (text-to-image)",
                "",
                f"SFT: {sft_updates} updates from scratch ({sft_dir}); "
                f"GRPO: {grpo_updates} updates ({grpo_dir}).",
                "",
                f"## SFT, test split ({sft_cfg.data.test_size} prompts per task), "
                "random init -> after SFT",
                "",
                markdown_table(random_init, sft_eval),
                "",
                f"## GRPO, test split ({n_test} prompts per task), before -> after",
                "",
                markdown_table(before, after),
                "",
                "Verdicts, paired per prompt (same prompts and seeds; the GRPO run's own "
                f"report: {grpo_dir / 'report.md'}):",
                "",
                *(
                    f"- {v['task']} {v['metric']}: {v['verdict']} ({v['diff']:+.3f} ± "
                    f"{v['se']:.3f} SE over {v['n']} prompts)"
                    for v in verdicts
                    if v["split"] == "test"
                ),
                "",
                f"## Training reward `{REWARD_KEY}` ({fit.n} updates)",
                "",
                f"first-10 mean {fit.first_mean:.3f}, last-10 mean {fit.last_mean:.3f}, "
                f"least-squares drift {fit.drift:+.3f}, residual noise {fit.noise:.3f}, "
                f"drift/noise {fit.ratio:.2f} (a learning claim needs >= 3).",
                "",
                "![reward curve](reward_curve.png)",
                "",
                f"## Images per digit (rows 0-9): {PER_DIGIT} before | {PER_DIGIT} after",
                "",
                "![before and after](before_after.png)",
                "",
            ]
        )
    )
    return report
