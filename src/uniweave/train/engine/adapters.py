"""LoRA adapters as files: a run's `adapter/` export and `model.initial_adapter`.

A LoRA run writes ``adapter/`` beside its merged ``model/``, in peft's own format —
``adapter_config.json`` (`peft.LoraConfig`) and ``adapter_model.safetensors`` (the
adapter tensors under peft's names, ``base_model.model.<module>.lora_A.weight``), so
``PeftModel.from_pretrained(base, "adapter")`` loads it on the base model — plus
``uniweave_adapter.json``: the base it was trained on (`model.path` and the digest of its
fingerprint, `uniweave.config.fingerprint`; null for a base built from the config), the rank,
alpha, rslora flag, the `trainer.lora.target_modules` regex and the modules it matched.

`model.initial_adapter: DIR` starts a run (SFT, OPD, GRPO) from such an adapter on
`model.path`, unmerged: the run's own LoRA layers (`trainer.lora`) are injected and then
given the adapter's tensors, so training continues the adapter. `check_initial_adapter`
(run by `uniweave train`'s preflight, before anything is written) refuses an adapter whose
base, rank, alpha, rslora or target modules differ from the run's, naming
`model.initial_adapter`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from uniweave.config import ConfigError, UniweaveConfig
from uniweave.config.fingerprint import path_identity
from uniweave.models import UnifiedModel

ADAPTER_DIR = "adapter"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
UNIWEAVE_RECORD = "uniweave_adapter.json"
PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "default"
KEY = "model.initial_adapter"


def base_digest(path: str | None) -> str | None:
    """The digest of the fingerprint of the base model directory `path` (None: a model
    built from the config)."""
    return None if path is None else path_identity(path)["digest"]


def _peft_name(key: str) -> str:
    """`a.lora_A.default.weight` -> `base_model.model.a.lora_A.weight` (peft's file names)."""
    return PEFT_PREFIX + key.replace(f".{ADAPTER_NAME}.", ".")


def _model_name(key: str) -> str:
    """The inverse of `_peft_name`."""
    stem, _, leaf = key.removeprefix(PEFT_PREFIX).rpartition(".")
    return f"{stem}.{ADAPTER_NAME}.{leaf}"


def save_adapter(model: UnifiedModel, cfg: UniweaveConfig, path: Path, targets: list[str]) -> None:
    """Write `model`'s LoRA adapter into directory `path` (module docstring)."""
    from uniweave.train.engine.lora import lora_config

    lora = cfg.trainer.lora
    path.mkdir(parents=True, exist_ok=True)
    config = lora_config(lora, targets, base_model_name_or_path=cfg.model.path)
    config.save_pretrained(str(path))
    state = {
        _peft_name(k): v.detach().to("cpu").contiguous().clone()
        for k, v in model.state_dict().items()
        if "lora_" in k
    }
    save_file(state, str(path / PEFT_WEIGHTS))
    record = {
        "base_path": cfg.model.path,
        "base_digest": base_digest(cfg.model.path),
        "kind": cfg.model.kind,
        "r": lora.r,
        "alpha": lora.alpha,
        "rslora": lora.rslora,
        "target_regex": lora.target_modules,
        "target_modules": sorted(targets),
    }
    (path / UNIWEAVE_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_record(path: str | Path) -> dict[str, Any]:
    """`uniweave_adapter.json` of adapter directory `path` (ConfigError naming
    `model.initial_adapter` when it or peft's files are missing or unreadable)."""
    root = Path(path)
    for name in (PEFT_CONFIG, PEFT_WEIGHTS, UNIWEAVE_RECORD):
        if not (root / name).is_file():
            raise ConfigError(f"{root}: not an adapter directory (no {name})", key=KEY)
    try:
        record = json.loads((root / UNIWEAVE_RECORD).read_text())
    except ValueError as exc:
        raise ConfigError(f"{root / UNIWEAVE_RECORD}: unreadable ({exc})", key=KEY) from None
    fields = ("base_digest", "r", "alpha", "rslora", "target_regex", "target_modules")
    absent = [f for f in fields if not isinstance(record, dict) or f not in record]
    if absent:
        raise ConfigError(f"{root / UNIWEAVE_RECORD}: no {absent[0]}", key=KEY)
    return record


def check_initial_adapter(cfg: UniweaveConfig) -> None:
    """ConfigError naming `model.initial_adapter` unless the adapter was trained on the
    files now at `model.path` with the run's LoRA rank, alpha, rslora and target-module
    regex (reads small files and the base's fingerprint; writes nothing)."""
    path = cfg.model.initial_adapter
    if path is None:
        return
    record = read_record(path)
    lora = cfg.trainer.lora
    for field, ours, key in (
        ("r", lora.r, "trainer.lora.r"),
        ("alpha", lora.alpha, "trainer.lora.alpha"),
        ("rslora", lora.rslora, "trainer.lora.rslora"),
        ("target_regex", lora.target_modules, "trainer.lora.target_modules"),
    ):
        if record[field] != ours:
            raise ConfigError(
                f"{path}: the adapter has {field} {record[field]!r}, this run {key}={ours!r}",
                key=KEY,
            )
    if record["base_digest"] is None:
        raise ConfigError(
            f"{path}: the adapter was trained on a model built from its run's config (no "
            "model.path), which no model.path can reproduce",
            key=KEY,
        )
    if record["base_digest"] != base_digest(cfg.model.path):
        raise ConfigError(
            f"{path}: the adapter was trained on another base model "
            f"({record.get('base_path')}) than model.path={cfg.model.path} (their files differ)",
            key=KEY,
        )


def load_initial_adapter(model: UnifiedModel, cfg: UniweaveConfig, targets: list[str]) -> None:
    """Give `model`'s LoRA layers (already injected, `apply_lora`: `targets`) the tensors
    of `model.initial_adapter` (checked first: `check_initial_adapter`)."""
    assert cfg.model.initial_adapter is not None, "called with model.initial_adapter set"
    path = Path(cfg.model.initial_adapter)
    check_initial_adapter(cfg)
    record = read_record(path)
    if sorted(targets) != record["target_modules"]:
        raise ConfigError(
            f"{path}: the adapter's modules {record['target_modules'][:3]}... differ from "
            f"the ones trainer.lora.target_modules matches here {sorted(targets)[:3]}...",
            key=KEY,
        )
    tensors = {_model_name(k): v for k, v in load_file(str(path / PEFT_WEIGHTS)).items()}
    own = {k for k in model.state_dict() if "lora_" in k}
    if set(tensors) != own:
        extra, missing = sorted(set(tensors) - own), sorted(own - set(tensors))
        raise ConfigError(
            f"{path / PEFT_WEIGHTS}: tensors do not fit the run's LoRA layers "
            f"(unexpected {extra[:3]}, missing {missing[:3]})",
            key=KEY,
        )
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in tensors.items():
            target = params[name]
            if target.shape != value.shape:
                raise ConfigError(
                    f"{path / PEFT_WEIGHTS}: {name} has shape {tuple(value.shape)}, the "
                    f"run's {tuple(target.shape)}",
                    key=KEY,
                )
            target.copy_(value.to(target.dtype))


def lora_targets(model: UnifiedModel) -> list[str]:
    """The names of `model`'s modules that carry LoRA layers (what `apply_lora` adapted)."""
    from peft.tuners.lora import LoraLayer

    return [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]
