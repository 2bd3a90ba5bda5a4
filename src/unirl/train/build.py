"""Build the pieces of a run from its config: device, tokenizer, codec, model, LoRA.

Nothing here runs before the config is fully validated; a model directory given as
`model.path` is loaded as is (its tokenizer and codec travel with it), otherwise the tiny
default is built from scratch with the run seed and its codec fitted on the digits train
split (or loaded from `model.codec.path`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from unirl.codecs import ImageCodec, build_codec, load_codec
from unirl.codecs.base import CONFIG_NAME
from unirl.config.schema import UnirlConfig
from unirl.data.digits_images import load_split
from unirl.data.tokenizer import build_tokenizer
from unirl.models import UnifiedModel, load_model
from unirl.models.tiny import TinyModelConfig, TinyUnifiedModel


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_or_load_codec(cfg: UnirlConfig, seed: int, codec_dir: Path | None) -> ImageCodec:
    """The tiny model's codec: loaded from `model.codec.path` (or from `codec_dir` when an
    earlier attempt of this run saved it there), else fitted on the digits train split and
    saved to `codec_dir`."""
    c = cfg.model.codec
    path = c.path or (str(codec_dir) if codec_dir and (codec_dir / CONFIG_NAME).is_file() else None)
    if path:
        codec = load_codec(path)
        if codec.kind != cfg.model.visual_head:
            raise ValueError(
                f"model.codec.path={path} holds a {codec.kind} codec but "
                f"model.visual_head={cfg.model.visual_head}"
            )
        return codec
    if cfg.model.visual_head == "vq":
        codec = build_codec("vq", codebook_size=c.codebook_size, patch=c.patch_size)
    else:
        codec = build_codec("bsq", latent_dim=c.bits, patch=c.patch_size, group=c.group)
    codec.fit(load_split("train").images, seed=seed)
    if codec_dir is not None:
        codec.save_pretrained(codec_dir)
    return codec


def build_model(cfg: UnirlConfig, codec_dir: Path | None = None) -> UnifiedModel:
    """The model a run starts from (before LoRA): `model.path` or a fresh tiny model
    (initialised from the run seed; its codec as in `build_or_load_codec`)."""
    if cfg.model.path:
        model = load_model(cfg.model.path)
        if model.visual_head != cfg.model.visual_head:
            raise ValueError(
                f"model.path={cfg.model.path} has a {model.visual_head} head but "
                f"model.visual_head={cfg.model.visual_head}"
            )
        return model
    if cfg.model.kind != "tiny":
        raise ValueError(f"model.kind={cfg.model.kind} needs model.path")
    codec = build_or_load_codec(cfg, cfg.run.seed, codec_dir)
    t = cfg.model.tiny
    torch.manual_seed(cfg.run.seed)
    return TinyUnifiedModel(
        TinyModelConfig(
            visual_head=cfg.model.visual_head,
            hidden_size=t.hidden_size,
            num_layers=t.num_layers,
            num_heads=t.num_heads,
            intermediate_size=t.intermediate_size,
            max_positions=t.max_position_embeddings,
            mixer_kernel=t.mixer_kernel,
        ),
        build_tokenizer(),
        codec,
    )


def apply_lora(model: UnifiedModel, cfg: UnirlConfig) -> list[str]:
    """Inject peft LoRA adapters into modules whose full name matches the regex, freeze
    every other parameter, and return the names of the adapted modules."""
    from peft import LoraConfig, inject_adapter_in_model

    lora = cfg.trainer.lora
    pattern = re.compile(lora.target_modules)
    targets = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and pattern.fullmatch(name)
    ]
    if not targets:
        raise ValueError(f"trainer.lora.target_modules={lora.target_modules!r} matches no Linear")
    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets
    )
    inject_adapter_in_model(config, model)
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
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
            state[f"{name}.weight"] = module.get_base_layer().weight.detach() + delta
    return state
