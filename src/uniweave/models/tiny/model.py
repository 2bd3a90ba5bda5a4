"""Tiny unified model: a transformers `LlamaModel` body with a text and a visual head.

Inputs: text positions use the token embedding; visual positions use a visual embedding
of their code — VQ: an embedding table over the codebook; BSQ: a linear map of the
±1/√L code vector — plus a where-aware patch term: a learned embedding of the position's
raster index in its image and a per-index linear map of the code's features (VQ: the
codebook patch's pixels; BSQ: the code vector). Outputs: `text_head` (vocabulary logits) and `visual_head_proj`
(VQ: codebook logits; BSQ: one Bernoulli logit per bit), applied only to the hidden
states the caller passes (the positions it scores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaModel, PreTrainedTokenizerFast

from uniweave.codecs import ImageCodec, load_codec
from uniweave.codecs.bsq import BSQCodec
from uniweave.codecs.vq import VQCodec
from uniweave.config.schema import TinyModelConfig
from uniweave.core.types import Modality
from uniweave.models.base import BodyOutput, ModelInputs, UnifiedModel, VisualHead, run_decoder
from uniweave.models.registry import MODEL_CONFIG, ModelFacts, read_json
from uniweave.models.tiny.mixer import MixCache, MixContext, install_mixers, mixer_taps

WEIGHTS = "model.safetensors"


class TinyArchitecture(TinyModelConfig):
    """What a tiny model is built from, and what its ``uniweave_model.json`` records: the
    `model.tiny` sizes (`uniweave.config.TinyModelConfig`, where they are defined) plus what
    the config does not set."""

    visual_head: VisualHead = "vq"
    rope_theta: float = 10000.0
    initializer_range: float = 0.02

    @classmethod
    def from_saved(cls, data: dict[str, Any]) -> TinyArchitecture:
        """The architecture a ``uniweave_model.json`` records (``max_positions``, the name
        files written before the size classes were unified used, is read as
        ``max_position_embeddings``)."""
        data = dict(data)
        if "max_positions" in data:
            data["max_position_embeddings"] = data.pop("max_positions")
        return cls(**data)


class TinyUnifiedModel(UnifiedModel):
    kind = "tiny"
    supports_packing = True

    code_features: torch.Tensor  # a buffer: the VQ codebook's centred patch pixels

    def __init__(
        self, config: TinyArchitecture, tokenizer: PreTrainedTokenizerFast, codec: ImageCodec
    ) -> None:
        super().__init__()
        if config.visual_head != codec.kind:
            raise ValueError(
                f"model.visual_head={config.visual_head!r} needs a {config.visual_head} codec, "
                f"got a {codec.kind} codec"
            )
        self.config = config
        self.visual_head = config.visual_head
        self.tokenizer = tokenizer
        self.codec = codec
        self.decoder = LlamaModel(self._llama_config(config, len(tokenizer)))
        # Sequence-mixing prior (mixer.py): a depthwise causal conv after each layer norm.
        self._mix: MixContext | None = None
        if config.mixer_kernel > 0:
            self._mix = install_mixers(self.decoder, config.mixer_kernel)
        d = config.hidden_size
        self._n_visual = _n_visual_outputs(codec)
        if codec.kind == "vq":
            self.visual_embed: nn.Module = nn.Embedding(self._n_visual, d)
        else:
            self.visual_embed = nn.Linear(self._n_visual, d, bias=False)
        # Where-aware patch embedding: a learned embedding per raster position of the grid
        # plus, per position, a linear map of the code's features (VQ: the codebook patch
        # pixels, centred; BSQ: the code vector). Attention that pools the image then sees
        # a linear function of its pixels, so recognition is learned in a few hundred
        # updates instead of being discovered through the code table alone.
        self._n_grid = int(codec.grid[0] * codec.grid[1])
        if codec.kind == "vq":
            vq = cast(VQCodec, codec)
            feats = vq.tensors()["codebook"].reshape(vq.codebook_size, -1).float() - 0.5
        else:
            feats = torch.zeros(0, self._n_visual)
        self.register_buffer("code_features", feats.clone(), persistent=False)
        self.visual_position = nn.Parameter(torch.zeros(self._n_grid, d))
        self.visual_patch = nn.Parameter(
            torch.randn(self._n_grid, feats.shape[-1], d) * config.initializer_range
        )
        self.text_head = nn.Linear(d, len(tokenizer), bias=False)
        self.visual_head_proj = nn.Linear(d, self._n_visual, bias=False)
        for module in (self.visual_embed, self.text_head, self.visual_head_proj):
            nn.init.normal_(module.weight, std=config.initializer_range)
        if config.tie_embeddings:
            # One matrix E for tokens in and text logits out (logits = h @ E^T).
            self.text_head.weight = self.decoder.embed_tokens.weight

    @staticmethod
    def _llama_config(config: TinyArchitecture, vocab_size: int) -> LlamaConfig:
        return LlamaConfig(  # type: ignore[call-arg]  # rope_theta, attn_implementation: **kwargs
            vocab_size=vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_heads,
            max_position_embeddings=config.max_position_embeddings,
            rope_theta=config.rope_theta,
            initializer_range=config.initializer_range,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )

    @property
    def supports_prefix_sharing(self) -> bool:
        """True without the conv prior (`mixer_kernel` 0): its cache carries detached,
        end-aligned inputs, so a prompt's cached continuation would not get the prompt's
        gradient through the mixers."""
        return self._mix is None

    @property
    def n_visual_outputs(self) -> int:
        return self._n_visual

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def embed(self, inputs: ModelInputs) -> torch.Tensor:
        # Dense over all positions (text ones are discarded by the final `where`): no
        # data-dependent indexing, so a decoding step never waits on the host.
        text = self.decoder.embed_tokens(inputs.token_ids)
        is_visual = inputs.modality == Modality.VISUAL
        if self.visual_head == "vq":
            codes = inputs.visual_codes.long().clamp(min=0)
            visual, feats = self.visual_embed(codes), self.code_features[codes]
        else:
            feats = (2.0 * inputs.visual_codes.to(text.dtype) - 1.0) / self._n_visual**0.5
            visual = self.visual_embed(feats)
        k = inputs.image_position.clamp(0, self._n_grid - 1)
        patch = torch.einsum("btf,btfd->btd", feats.to(text.dtype), self.visual_patch[k])
        visual = visual + self.visual_position[k] + patch
        return torch.where(is_visual.unsqueeze(-1), visual.to(text.dtype), text)

    def body(
        self,
        embeds: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any = None,
    ) -> BodyOutput:
        if self._mix is not None:
            if cache is not None and not isinstance(cache, MixCache):
                raise TypeError(
                    f"the tiny model's mixers need a MixCache (model.new_cache()), "
                    f"got {type(cache).__name__}"
                )
            if attention_mask.dim() == 3:  # a query × key mask: full forward, no cache
                if cache is not None:
                    raise ValueError("a [B, T, T] attention mask is for full forwards only")
                self._mix.taps = mixer_taps(attention_mask.bool(), self.config.mixer_kernel)
                self._mix.valid = self._mix.taps[..., 0]
            else:
                self._mix.taps = None
                self._mix.valid = attention_mask[:, -embeds.shape[1] :].bool()
            self._mix.states = None if cache is None else cache.mix_states
        return run_decoder(self.decoder, embeds, attention_mask, position_ids, cache)

    def plain_decoder(self) -> LlamaModel | None:
        """The Llama body when `body` only runs it (no conv prior, `mixer_kernel` 0)."""
        return self.decoder if self._mix is None else None

    def new_cache(self) -> Any:
        """A KV cache that also carries the mixers' last inputs (`MixCache`)."""
        return MixCache() if self._mix is not None else super().new_cache()

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.text_head(hidden)

    def visual_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.visual_head_proj(hidden)

    def enable_gradient_checkpointing(self) -> None:
        self.decoder.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )

    def save_pretrained(
        self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None
    ) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = {"kind": self.kind, "config": self.config.model_dump()}
        (path / MODEL_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True))
        source = self.state_dict() if state_dict is None else state_dict
        # clone: tied embeddings share storage, which safetensors refuses to save.
        state = {k: v.detach().cpu().clone() for k, v in source.items()}
        save_file(state, str(path / WEIGHTS))
        self.tokenizer.save_pretrained(str(path / "tokenizer"))
        self.codec.save_pretrained(path / "codec")

    @staticmethod
    def _check_directory(path: Path) -> TinyArchitecture:
        for name in (MODEL_CONFIG, WEIGHTS, "tokenizer", "codec"):
            if not (path / name).exists():
                raise FileNotFoundError(f"{path}: incomplete model directory (missing {name})")
        try:
            return TinyArchitecture.from_saved(read_json(path / MODEL_CONFIG)["config"])
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path / MODEL_CONFIG}: field config: {err}") from None

    @classmethod
    def inspect(cls, path: str | Path, full: bool = False) -> ModelFacts:
        """The registered `inspect`: a saved tiny model's facts from `uniweave_model.json`
        (its visual head; prefix sharing without the conv prior, `mixer_kernel` 0) and its
        small codec; with `full` also the tokenizer's vocabulary and the codec's tensors.
        No model weights are read."""
        path = Path(path)
        config = cls._check_directory(path)
        codec = load_codec(path / "codec")
        if not isinstance(codec, ImageCodec) or config.visual_head != codec.kind:
            raise ValueError(
                f"{path / MODEL_CONFIG}: field config.visual_head is {config.visual_head!r} "
                f"but {path / 'codec'} holds a {codec.kind} codec"
            )
        vocab = tensors = None
        if full:
            vocab = PreTrainedTokenizerFast.from_pretrained(str(path / "tokenizer")).get_vocab()
            tensors = codec.tensors()
        n_out = _n_visual_outputs(codec)
        grid = (int(codec.grid[0]), int(codec.grid[1]))
        size = (int(codec.image_size[0]), int(codec.image_size[1]))
        prefix = config.mixer_kernel == 0
        return ModelFacts(
            config.visual_head, int(n_out), grid, prefix, vocab, tensors, size, codec.channels
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TinyUnifiedModel:
        path = Path(path)
        config = cls._check_directory(path)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path / "tokenizer"))
        codec = load_codec(path / "codec")
        if not isinstance(codec, ImageCodec):
            raise ValueError(f"{path / 'codec'} holds a {codec.kind} codec, not a vq or bsq codec")
        model = cls(config, tokenizer, codec)
        model.load_state_dict(load_file(str(path / WEIGHTS)), strict=True)
        return model


def _n_visual_outputs(codec: ImageCodec) -> int:
    """The visual head's outputs: a VQ codec's codebook size, a BSQ codec's bits."""
    if codec.kind == "vq":
        return int(cast(VQCodec, codec).codebook_size)
    return int(cast(BSQCodec, codec).bits_per_position)
