"""The fingerprints of what a run reads, recorded in every checkpoint and checked on resume.

`run_inputs(cfg)` names the files and directories a run reads, by the config key that
names them: `model.path` (the weights, tokenizer, codec a run starts from — and so the
GRPO reference, the initial policy), `model.initial_adapter`, `model.codec.path` (a
model built from the config), the dataset files (`data.path`, `data.val_path`,
`data.test_path`), the model directories the method reads (its spec's `model_dirs`:
OPD's teacher, `algorithm.teacher.path`) and the reward plugins' model directories (`reward.plugins.N.path`). `input_fingerprints` fingerprints each
(`uniweave.config.fingerprint`: sizes, safetensors headers, content hashes cached by
size/mtime/inode); `check_fingerprints` refuses (a `ConfigError`, exit 2) a resume when
any recorded file changed, naming the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from uniweave.config import ConfigError, UniweaveConfig
from uniweave.config.fingerprint import changed_files, fingerprint
from uniweave.config.methods import get_key, method

FINGERPRINTS = "fingerprints"
"""The key of a checkpoint's state.json that holds them."""


def run_inputs(cfg: UniweaveConfig) -> dict[str, str]:
    """{config key: path} of everything `cfg` makes a run read (module docstring)."""
    found: dict[str, str | None] = {
        "model.path": cfg.model.path,
        "model.initial_adapter": cfg.model.initial_adapter,
        "model.codec.path": cfg.model.codec.path,
        "data.path": cfg.data.path,
        "data.val_path": cfg.data.val_path,
        "data.test_path": cfg.data.test_path,
    }
    for dotted in method(cfg.algorithm.name).model_dirs:  # the method's (OPD: its teacher)
        found[f"algorithm.{dotted}"] = get_key(cfg.algorithm, dotted)
    for k, plugin in enumerate(cfg.reward.plugins):
        found[f"reward.plugins.{k}.path"] = plugin.path
    return {key: path for key, path in found.items() if path is not None}


def input_fingerprints(cfg: UniweaveConfig) -> dict[str, dict[str, Any]]:
    """{config key: {"path": resolved path, "files": fingerprint map}} of `run_inputs`."""
    out = {}
    for key, path in run_inputs(cfg).items():
        try:
            files = fingerprint(path)
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found", key=key) from None
        out[key] = {"path": str(Path(path).resolve()), "files": files}
    return out


def check_fingerprints(saved: dict[str, Any] | None, cfg: UniweaveConfig, where: str) -> None:
    """ConfigError naming the first changed file (and its key) when an input recorded in
    checkpoint `where` (`saved`: its fingerprints) is not what `cfg` now reads. Inputs the
    checkpoint did not record (an older checkpoint) are not checked."""
    if not saved:
        return
    for key, path in run_inputs(cfg).items():
        record = saved.get(key)
        if record is None:
            continue
        root = Path(path)
        try:
            current = fingerprint(root)
        except FileNotFoundError:
            raise ConfigError(
                f"refusing to resume {where}: {root} is gone (recorded in the checkpoint)",
                key=key,
            ) from None
        changes = changed_files(record["files"], current)
        recorded = record.get("path")
        if changes and recorded is not None and str(root.resolve()) != recorded:
            # another file or folder than the one the checkpoint read: not a change of it
            back = f"set {key}={recorded} to resume" if Path(recorded).exists() else None
            raise ConfigError(
                f"refusing to resume {where}: {key} names {root}, another "
                f"{'folder' if root.is_dir() else 'file'} than the {recorded} the checkpoint "
                f"was written with ({len(changes)} file(s) differ); "
                f"{back + ', or ' if back else ''}use a new run.output_dir to train on it",
                key=key,
            )
        if changes:
            name, what = changes[0]
            file = root / name if root.is_dir() else root
            raise ConfigError(
                f"refusing to resume {where}: {file} {what} since the checkpoint was "
                f"written ({len(changes)} file(s) differ); use a new run.output_dir to "
                "train on the new files",
                key=key,
            )
