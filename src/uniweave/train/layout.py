"""What every entry of a run directory is: `uniweave inspect RUN_DIR` prints it.

`RUN_ENTRIES` maps each name `uniweave train` may write at the top of a run directory to
one line saying what it holds (the names come from the constants of the modules that
write them, so a renamed entry cannot drift from this table). `describe_run_dir(path)`
lists the entries actually present, in name order, each with its line and, for a
directory, how many entries it holds; a staging name of an atomic write
(`.NAME.tmp...`, `uniweave.core.atomic`) is an interrupted write that the next start
removes; any other name is "not written by uniweave" (left alone by every command).
docs/architecture.md §5 says the same in prose (tests/test_run_layout.py checks that
every name here appears there).
"""

from __future__ import annotations

from pathlib import Path

from uniweave.core.status import RUN_LOG
from uniweave.eval.run_report import REPORT_HTML, REPORT_JSON, REPORT_MD
from uniweave.rewards.digit_classifier import CLASSIFIER_DIR
from uniweave.train.engine.adapters import ADAPTER_DIR
from uniweave.train.engine.metrics import METRICS, TENSORBOARD, WANDB_ID
from uniweave.train.preflight import EVALS, RUN_CODEC, RUN_TOKENIZER
from uniweave.train.state.artifacts import ROLLOUTS

RUN_ENTRIES: dict[str, str] = {
    "config.yaml": "the resolved config the run trains with (every key, defaults included)",
    "config_hash": "the config's SHA-256; a resume with another config is refused",
    RUN_CODEC: "the image codec the run fitted or copied (model.codec), reused on resume",
    RUN_TOKENIZER: "the tokenizer built for the tiny model (byte-level BPE on the rows' text)",
    CLASSIFIER_DIR: "the digits classifier the rewards and evaluations score images with",
    "checkpoints": "update-NNNNNN checkpoints: weights, optimizer, RNG, state.json + manifest",
    METRICS: "one JSON object per logged update (loss, lr, rewards, KL, ...)",
    TENSORBOARD: "TensorBoard event files of the same metrics (logging.tensorboard)",
    WANDB_ID: "the W&B run id, so a resume continues the same W&B run (logging.wandb)",
    RUN_LOG: "the console's status lines and log messages, timestamped, across resumes",
    ROLLOUTS: "archived rollout rounds (GRPO with several updates per batch, resumable)",
    EVALS: "<split>-update-NNNNNN evaluations: results.jsonl, summary.json, index.html",
    "model": "the final model (weights, tokenizer, codec, trained_on.json); model.path for "
    "eval, generate and a child run",
    ADAPTER_DIR: "the LoRA adapter alone, in peft's format (trainer.lora)",
    "eval.json": "the final model's test metrics (the last evals/test-update-NNNNNN)",
    "curves.png": "the training curves (metrics.jsonl), one panel per signal",
    REPORT_MD: "the run report: held-out verdicts against the start, alarms, curves",
    REPORT_HTML: "the same report as a web page",
    REPORT_JSON: "the report's figures: verdicts, alarms, curve fits (drift/noise)",
    "DONE": "the run finished: every update, the export and the final evaluation",
}


def describe_run_dir(path: Path) -> list[tuple[str, str]]:
    """(name, description) of every entry of run directory `path` (module docstring)."""
    out = []
    for entry in sorted(Path(path).iterdir(), key=lambda p: p.name):
        name = entry.name
        if name in RUN_ENTRIES:
            what = RUN_ENTRIES[name]
        elif name.startswith(".") and ".tmp" in name:
            what = "an interrupted atomic write; the next start of the run removes it"
        else:
            what = "not written by uniweave (left alone by every command)"
        if entry.is_dir():
            name += "/"
            what += f" [{sum(1 for _ in entry.iterdir())} entries]"
        out.append((name, what))
    return out


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a run directory (it holds the config hash a run writes first)."""
    return (Path(path) / "config_hash").is_file() and (Path(path) / "config.yaml").is_file()
