"""LoRA adapters of a run's model: inject, switch on/off, read, merge.

The model itself, its device, tokenizer and dataset rows are built by
`uniweave.models.build`; deterministic kernels are set by `uniweave.core.determinism`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from uniweave.config.schema import UniweaveConfig
from uniweave.config.trainer import LoRAConfig
from uniweave.models import UnifiedModel

__all__ = ["adapter_state", "apply_lora", "merged_state_dict", "set_adapters_enabled"]


def lora_config(lora: LoRAConfig, targets: list[str], **extra: Any) -> Any:
    """peft's `LoraConfig` for `trainer.lora` (`lora`) on the modules `targets`; `extra`
    adds peft fields (the adapter file's `base_model_name_or_path`). One construction for
    the adapters injected here and the ones `adapters.save_adapter` writes."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft takes a float alpha (scale alpha / r)
        lora_dropout=lora.dropout,
        target_modules=targets,
        use_rslora=lora.rslora,
        **extra,
    )


def apply_lora(model: UnifiedModel, cfg: UniweaveConfig) -> list[str]:
    """Inject peft LoRA adapters into modules whose full name matches the regex, freeze
    every other parameter, and return the names of the adapted modules."""
    from peft import inject_adapter_in_model

    lora = cfg.trainer.lora
    pattern = re.compile(lora.target_modules)
    targets = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and pattern.fullmatch(name)
    ]
    if not targets:
        raise ValueError(f"trainer.lora.target_modules={lora.target_modules!r} matches no Linear")
    inject_adapter_in_model(lora_config(lora, targets), model)
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name
    return targets


def adapter_state(model: UnifiedModel) -> dict[str, torch.Tensor]:
    """The LoRA adapter tensors of `model` (what a LoRA checkpoint stores)."""
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def set_adapters_enabled(model: UnifiedModel, enabled: bool) -> None:
    """Switch every LoRA layer on or off (off = the frozen base model, e.g. a reference)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.enable_adapters(enabled)


def merged_state_dict(model: UnifiedModel) -> dict[str, torch.Tensor]:
    """The model's weights with every LoRA delta merged into its base layer, under the
    base model's key names (equal to `state_dict()` when no adapters are present)."""
    from peft.tuners.lora import LoraLayer

    state = {
        k.replace(".base_layer.", "."): v.detach().clone()
        for k, v in model.state_dict().items()
        if "lora_" not in k
    }
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            layer: Any = module  # a peft lora.Linear: LoraLayer and the wrapped nn.Linear
            delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters)
            state[f"{name}.weight"] = layer.get_base_layer().weight.detach() + delta
    return state
