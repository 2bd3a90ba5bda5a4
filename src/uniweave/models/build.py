"""Build a run's model from its config: the device, the tokenizer, the model, and the
dataset rows as that model sees them.

Nothing here runs before the config is fully validated; a model directory given as
`model.path` is loaded as is (its tokenizer and codec travel with it), otherwise the kind's
registered builder makes one from the config (the tiny default: from scratch with the run
seed, its codec fitted on the digits train split or loaded from `model.codec.path`, and
its tokenizer as `data.tokenizer` says: the digits WordLevel tokenizer, or a byte-level
BPE trained on the training rows' text, saved in `tokenizer_dir` and reused on resume).
"""

from __future__ import annotations

from pathlib import Path

import torch

from uniweave.config.schema import UniweaveConfig
from uniweave.core.sample import TextPart
from uniweave.data.images import processor_for
from uniweave.data.loader import Rows
from uniweave.data.rows import check_targets, split_rows
from uniweave.data.tokenizer import build_tokenizer, load_or_train_bpe
from uniweave.models.base import UnifiedModel
from uniweave.models.registry import check_model_config, load_model


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def config_tokenizer(cfg: UniweaveConfig, tokenizer_dir: Path | None = None):
    """The tokenizer of a model built from the config (module docstring). With
    `data.path`, every assistant text of the training rows must map to known ids (a
    `DatasetError` names file:line)."""
    if cfg.data.path is None:
        return build_tokenizer()
    # Only the rows' text is read here (the codec, and so its grid, comes later): a
    # generate_image item without a size gets a placeholder (1, 1); dataset_rows reads
    # the rows again on the model's grid.
    rows = split_rows(cfg.data, "train", image_grid=(1, 1))
    if cfg.data.uses_bpe:
        texts = [p.text for s in rows.samples for p in s.parts if isinstance(p, TextPart)]
        tokenizer = load_or_train_bpe(tokenizer_dir, texts, cfg.data.bpe_vocab_size)
    else:
        tokenizer = build_tokenizer()
    check_targets(rows, tokenizer)
    return tokenizer


def dataset_rows(cfg: UniweaveConfig, model: UnifiedModel, split: str) -> Rows:
    """The `data.path` rows of `split` as `model` sees them: images through the model's
    processor (`processor_for(model.kind, codec.image_size, data.image_resize, channels)`:
    greyscale for a one-channel tiny codec, RGB for colour models), generate_image items on
    the codec's grid."""
    processor = processor_for(
        cfg.model.kind,
        tuple(model.codec.image_size),
        cfg.data.image_resize,
        int(getattr(model.codec, "channels", 1)),
    )
    return split_rows(cfg.data, split, processor, tuple(model.codec.grid))


def build_model(
    cfg: UniweaveConfig, codec_dir: Path | None = None, tokenizer_dir: Path | None = None
) -> UnifiedModel:
    """The model a run starts from (before LoRA): `model.path` loaded as is, or the kind
    built from the config by its registered builder (the tiny model: initialised from the
    run seed, its codec fitted or loaded as `uniweave.models.tiny.build` says, its tokenizer
    from `config_tokenizer`). The `model` section is checked against the kind's
    registration first (`check_model_config`)."""
    spec = check_model_config(cfg.model)
    if cfg.model.path is None:
        tokenizer = config_tokenizer(cfg, tokenizer_dir)
        build = spec.build
        assert build is not None, "check_model_config refuses a kind that does not build"
        return build(cfg.model, cfg.run.seed, codec_dir, tokenizer)
    model = load_model(cfg.model.path)
    if model.visual_head != cfg.model.visual_head:
        raise ValueError(
            f"model.path={cfg.model.path} has a {model.visual_head} head but "
            f"model.visual_head={cfg.model.visual_head}"
        )
    return model
