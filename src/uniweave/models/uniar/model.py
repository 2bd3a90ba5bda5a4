"""UniAR behind the `UnifiedModel` hooks, over transformers' `Qwen3VLForConditionalGeneration`.

The adapter's modules *are* the transformers model's (`self.model` = `Qwen3VLModel`,
`self.lm_head`), so parameter names are the checkpoint's own
(``model.language_model.layers.0.self_attn.q_proj``; LoRA regexes root there), plus
UniAR's two additions `bit_embed` and `visual_decoder` (`heads`).

- ``embed``: text positions use Qwen's token embedding; generated VISUAL positions the
  bit embedding of their k*k*L bits; understanding-image placeholders the vision tower's
  merged features (`vision`), frozen by default (no gradients, eval mode kept).
- ``body``: the Qwen3-VL text decoder with M-RoPE positions [3, B, T] passed explicitly
  (`positions`; never its cached `rope_deltas`), DeepStack features added at the
  placeholders, and the final norm *skipped*: ``hidden`` returns pre-final-norm states.
- ``text_logits(h)`` = ``project_text(h)`` = lm_head(final_norm(h)), with the image
  placeholder's logit at `PLACEHOLDER_LOGIT` (finite, so p log p stays 0, never NaN);
  ``visual_logits(h)`` = the visual decoder's k*k*L bit logits. Both run only on the hidden
  states passed in (the scored positions).
- ``forward_interleaved``: the public API for custom losses (README example).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import Qwen3VLForConditionalGeneration

from uniweave.codecs import BSQ_KINDS
from uniweave.core.sample import Part, Sample
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.core.types import Modality
from uniweave.models.base import BodyOutput, ModelInputs, UnifiedModel, query_key_mask
from uniweave.models.registry import MODEL_CONFIG
from uniweave.models.uniar.heads import BitEmbedding, VisualDecoder
from uniweave.models.uniar.interleaved import InterleavedOutput, forward_interleaved, generated_mask
from uniweave.models.uniar.loading import CODEC_DIR, WEIGHTS, load_parts
from uniweave.models.uniar.positions import MRopeDecodePositions, batch_positions
from uniweave.models.uniar.template import (
    MAX_GRID_SIDE,
    check_grid,
    serialize_uniar,
    special_id_map,
    uniar_parse_response,
)
from uniweave.models.uniar.vision import VisionInputs, check_pixels

# exp(-1e9) is 0 in every float dtype: the placeholder gets probability 0 as text.
PLACEHOLDER_LOGIT = -1e9


@dataclass(frozen=True)
class UniARSpec:
    """UniAR's own parts: the visual decoder (`decoder_layers` blocks of width
    `decoder_width`, 0 = the language model's) and whether the vision tower trains."""

    decoder_layers: int = 4
    decoder_width: int = 0
    train_vision: bool = False


def _skip_final_norm(module, args, output):
    """Forward hook on the text model's final norm: identity while `_uniweave_skip` is set."""
    return args[0] if getattr(module, "_uniweave_skip", False) else output


class UniARModel(UnifiedModel):
    kind = "uniar"
    visual_head = "bsq"
    max_grid_side = MAX_GRID_SIDE  # the template's 1..30 per side (`template.check_grid`)

    def __init__(
        self,
        hf: Qwen3VLForConditionalGeneration,
        tokenizer: Any,
        image_processor: Any,
        codec: Any,
        spec: UniARSpec | None = None,
    ) -> None:
        super().__init__()
        if getattr(codec, "kind", None) not in BSQ_KINDS:
            raise ValueError(f"UniAR writes images with a BSQ codec, got {codec!r}")
        self.spec = spec or UniARSpec()
        self.model = hf.model
        self.lm_head = hf.lm_head
        object.__setattr__(self, "_hf", hf)  # the same modules, kept for saving and generate
        self.config = hf.config
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.codec = codec
        text: Any = hf.config.text_config  # transformers types sub-configs as dict | config | None
        d, n_bits = int(text.hidden_size), int(codec.bits_per_position)
        self.bit_embed = BitEmbedding(n_bits, codec.latent_dim, d)
        width = self.spec.decoder_width or d
        self.visual_decoder = VisualDecoder(
            d, width, self.spec.decoder_layers, n_bits, float(text.rms_norm_eps)
        )
        vision: Any = (
            hf.config.vision_config
        )  # transformers types sub-configs as dict | config | None
        self.merge = int(vision.spatial_merge_size)
        self.vision = VisionInputs(image_processor, self.merge)
        norm = self.model.language_model.norm
        norm._uniweave_skip = False
        norm.register_forward_hook(_skip_final_norm)
        if not self.spec.train_vision:
            self.model.visual.requires_grad_(False)
            self.model.visual.eval()

    # ---- geometry --------------------------------------------------------------------
    @property
    def n_visual_outputs(self) -> int:
        return int(self.codec.bits_per_position)

    @property
    def image_grid(self) -> tuple[int, int]:
        return tuple(self.codec.grid)

    @property
    def max_positions(self) -> int:
        text: Any = (
            self.config.text_config
        )  # transformers types sub-configs as dict | config | None
        return int(text.max_position_embeddings)

    # ---- chat format -----------------------------------------------------------------
    def prompt_trajectory(self, sample: Sample, add_generation_prompt: bool = True) -> Trajectory:
        return serialize_uniar(
            sample,
            self.tokenizer,
            self.vision.n_tokens,
            check_pixels,
            self.codec.encode,
            add_generation_prompt,
            self.n_visual_outputs,
        )

    def image_generation_prefix(self, height: int, width: int) -> list[int]:
        check_grid(height, width, "image generation")
        return super().image_generation_prefix(height, width)

    def parse_response(self, traj: Trajectory) -> list[Part] | None:
        return uniar_parse_response(traj, self.tokenizer)

    # ---- positions -------------------------------------------------------------------
    def mrope_positions(
        self,
        token_ids: torch.Tensor,
        modality: torch.Tensor,
        attention_mask: torch.Tensor,
        images: list[list[torch.Tensor]],
    ) -> torch.Tensor:
        """M-RoPE positions [3, B, T] from `get_rope_index` (`positions` docstring)."""
        grids = [[self.vision.grid(x) for x in row] for row in images]
        return batch_positions(
            self.model.get_rope_index,
            token_ids,
            modality,
            attention_mask,
            int(self.config.image_token_id),
            grids,
            self.parse_image_header,
            self.merge,
        )

    def _with_mrope(self, inputs: ModelInputs) -> ModelInputs:
        pos = self.mrope_positions(
            inputs.token_ids, inputs.modality, inputs.attention_mask, inputs.images
        )
        return replace(inputs, position_ids=pos)

    def prepare(
        self, batch: TrajectoryBatch, visual_inputs: torch.Tensor | None = None
    ) -> ModelInputs:
        return self._with_mrope(super().prepare(batch, visual_inputs))

    def prepare_prompts(self, prompts, pad_id: int) -> ModelInputs:
        return self._with_mrope(super().prepare_prompts(prompts, pad_id))

    def decode_positions(self, prefill: ModelInputs) -> MRopeDecodePositions:  # type: ignore[override]  # the DecodePositions contract, M-RoPE positions
        return MRopeDecodePositions(
            prefill.token_ids, prefill.attention_mask, prefill.position_ids, self.parse_image_header
        )

    # ---- hooks -----------------------------------------------------------------------
    def token_embeddings(
        self, ids: torch.Tensor, visual: torch.Tensor, codes: torch.Tensor
    ) -> torch.Tensor:
        """Token embeddings, with the bit embedding of `codes` where `visual` is set."""
        embeds = self.model.language_model.embed_tokens(ids)
        bits = self.bit_embed(codes).to(embeds.dtype)
        return torch.where(visual.unsqueeze(-1), bits, embeds)

    def with_image_features(
        self,
        embeds: torch.Tensor,
        placeholder: torch.Tensor,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
    ) -> tuple[torch.Tensor, Any]:
        """The vision tower's merged features scattered into the `placeholder` positions,
        and (placeholder mask, DeepStack features) for the decoder."""
        device = embeds.device
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.spec.train_vision):
            out = self.model.get_image_features(pixel_values.to(device), image_grid_thw.to(device))
        feats = torch.cat(out.pooler_output).to(embeds.dtype)
        if feats.shape[0] != int(placeholder.sum()):
            raise ValueError(
                f"{int(placeholder.sum())} image placeholders for {feats.shape[0]} image "
                "features (serialise samples with prompt_trajectory)"
            )
        embeds = embeds.masked_scatter(placeholder.unsqueeze(-1), feats)
        deep = [torch.cat(f).to(embeds.dtype) for f in out.deepstack_features]
        return embeds, (placeholder, deep)

    def _embed(self, inputs: ModelInputs) -> tuple[torch.Tensor, Any]:
        """(embeddings [B, T, d], (placeholder mask, DeepStack features) or None)."""
        ids = inputs.token_ids
        visual = inputs.modality == Modality.VISUAL
        embeds = self.token_embeddings(ids, visual, inputs.visual_codes)
        placeholder = (ids == int(self.config.image_token_id)) & ~visual
        if not bool(placeholder.any()):
            return embeds, None
        images = [x for row in inputs.images for x in row]
        if not images:
            raise ValueError("understanding-image placeholders but no images in ModelInputs")
        pixel_values, thw = self.vision(images)
        return self.with_image_features(embeds, placeholder, pixel_values, thw)

    def embed(self, inputs: ModelInputs) -> torch.Tensor:
        return self._embed(inputs)[0]

    def body(
        self,
        embeds: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any = None,
        deepstack: Any = None,
    ) -> BodyOutput:
        lm = self.model.language_model
        mask, feats = deepstack if deepstack is not None else (None, None)
        lm.norm._uniweave_skip = True
        try:
            out = lm(
                inputs_embeds=embeds,
                attention_mask=query_key_mask(lm, attention_mask, embeds.dtype, cache),
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                visual_pos_masks=mask,
                deepstack_visual_embeds=feats,
            )
        finally:
            lm.norm._uniweave_skip = False
        return BodyOutput(hidden=out.last_hidden_state, cache=out.cache)

    def hidden(self, inputs: ModelInputs, cache: Any = None) -> BodyOutput:
        embeds, deepstack = self._embed(inputs)
        return self.body(embeds, inputs.attention_mask, inputs.position_ids, cache, deepstack)

    def project_text(self, hidden: torch.Tensor) -> torch.Tensor:
        """Text logits [N, V] = lm_head(final_norm(hidden)) of pre-final-norm states."""
        return self.lm_head(self.model.language_model.norm(hidden))

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`project_text` with the image placeholder's logit at `PLACEHOLDER_LOGIT`: the
        token only marks image positions, so the policy never samples it as text (it would
        be embedded as an understanding image that has no pixels). Rollout, replay and the
        SFT loss all read this, so their distributions agree. In place on the fresh
        lm_head output (its backward needs only the input and the weight): no second
        [N, V] copy and no per-step host tensor."""
        logits = self.project_text(hidden)
        logits[..., int(self.config.image_token_id)] = PLACEHOLDER_LOGIT
        return logits

    def visual_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.visual_decoder(hidden)

    def generated_mask(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """bool [B, T]: the generated-image positions, from the ids (`interleaved`)."""
        return generated_mask(self, input_ids, attention_mask)

    def forward_interleaved(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        visual_codes: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        scored_mask: torch.Tensor | None = None,
    ) -> InterleavedOutput:
        """The public API for custom losses: `interleaved.forward_interleaved`."""
        return forward_interleaved(
            self, input_ids, attention_mask, image_grid_thw, visual_codes, pixel_values, scored_mask
        )

    # ---- training and saving ---------------------------------------------------------
    def train(self, mode: bool = True) -> UniARModel:
        """Set train/eval mode; a frozen vision tower stays in eval."""
        super().train(mode)
        if not self.spec.train_vision:
            self.model.visual.eval()
        return self

    def enable_gradient_checkpointing(self) -> None:
        self.model.language_model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )

    def record(self) -> dict[str, Any]:
        """What `uniweave_model.json` holds: kind, spec, special ids and the codec geometry."""
        return {
            "kind": self.kind,
            "uniar": asdict(self.spec),
            "special_ids": special_id_map(self.tokenizer),
            "image_grid": list(self.image_grid),
            "bits_per_position": self.n_visual_outputs,
        }

    def save_pretrained(
        self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None
    ) -> None:
        """`model.safetensors` (the adapter's parameter names; a tied lm_head is stored
        once, as the embedding), `config.json` (Qwen3-VL), the tokenizer and image
        processor, the codec in `codec/` and `uniweave_model.json` (`record`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        source = self.state_dict() if state_dict is None else state_dict
        state = {k: v.detach().contiguous().cpu() for k, v in source.items()}
        if self.lm_head.weight is self.model.language_model.embed_tokens.weight:
            state.pop("lm_head.weight", None)
        save_file(state, str(path / WEIGHTS), metadata={"format": "pt"})
        self.config.save_pretrained(str(path))
        self.tokenizer.save_pretrained(str(path))
        self.image_processor.save_pretrained(str(path))
        self.codec.save_pretrained(path / CODEC_DIR)
        (path / MODEL_CONFIG).write_text(json.dumps(self.record(), indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> UniARModel:
        """Load a directory `save_pretrained` wrote (`loading`: checks before weights);
        eval mode."""
        path = Path(path)
        config, tokenizer, processor, codec, fields, state = load_parts(path)
        try:
            spec = UniARSpec(**fields)
        except TypeError as err:
            raise ValueError(f"{path / MODEL_CONFIG}: field uniar: {err}") from None
        hf = Qwen3VLForConditionalGeneration(config)
        model = cls(hf, tokenizer, processor, codec, spec)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = model.lm_head.weight is model.model.language_model.embed_tokens.weight
        missing = set(missing) - ({"lm_head.weight"} if tied else set())
        if unexpected or missing:
            raise ValueError(
                f"{path / WEIGHTS}: tensors do not match config.json (missing "
                f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
            )
        return model.eval()
