"""Janus-Pro behind the `UnifiedModel` hooks, over transformers' `JanusForConditionalGeneration`.

The adapter's modules *are* the transformers model's (`self.model` = `JanusModel`,
`self.lm_head`), so parameter names are the checkpoint's own
(``model.language_model.layers.0.self_attn.q_proj``; LoRA regexes root there) and a
state dict saves as a transformers checkpoint.

- ``embed``: text positions use the Llama token embedding; VISUAL positions use the
  generation path, generation_aligner(generation_embeddings(code)) (=
  `prepare_embeddings_for_image_generation`); the ``<image_placeholder>`` positions of
  an input-image block (``<begin_of_image>`` + N placeholders, TEXT) get the aligned
  SigLIP features of the row's image (= `JanusModel.get_image_features(...).pooler_output`,
  the frozen tower run without gradients). The pixels travel with the trajectory
  (`Trajectory.images`, set by `prompt_trajectory`) into `ModelInputs.images`: the k-th
  block of a row gets its k-th image, and a row whose block count differs from its image
  count is an error. The model keeps no per-row state.
- ``body``: the Llama decoder (`model.language_model`) with a KV cache.
- ``text_logits`` = `lm_head`, ``visual_logits`` = `model.generation_head` (16,384 VQ
  codes), applied only to the hidden states passed in.
- The VQ model and the SigLIP tower are frozen: requires_grad False, and eval mode that
  `train()` keeps.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import JanusForConditionalGeneration

from uniweave.core.sample import Part, Sample
from uniweave.core.trajectory import Trajectory
from uniweave.core.types import Modality
from uniweave.models.base import BodyOutput, ModelInputs, StreamIds, UnifiedModel, run_decoder
from uniweave.models.janus_pro.images import JanusVQCodec, PixelSpec
from uniweave.models.janus_pro.loading import load_parts
from uniweave.models.janus_pro.template import IMAGE, JanusTemplate
from uniweave.models.registry import MODEL_CONFIG


class JanusProModel(UnifiedModel):
    kind = "janus_pro"
    visual_head = "vq"
    _hf: JanusForConditionalGeneration  # set outside the module registry (see __init__)

    def __init__(self, hf: JanusForConditionalGeneration, tokenizer: Any, image_processor: Any):
        super().__init__()
        self.model = hf.model
        self.lm_head = hf.lm_head
        object.__setattr__(self, "_hf", hf)  # the same modules, kept for saving
        self.config = hf.config
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        size = int(image_processor.size["height"])
        self.pixels = PixelSpec(size, image_processor.image_mean, image_processor.image_std)
        self.codec = JanusVQCodec(hf, self.pixels)
        self.template = JanusTemplate(tokenizer, self.codec.grid, self.pixels.check)
        self.tokens = self.template.tokens
        for frozen in (self.model.vision_model, self.model.vqmodel):
            frozen.requires_grad_(False)
            frozen.eval()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> JanusProModel:
        """Load a local transformers Janus-Pro checkpoint (`loading`: checks, no remote code)."""
        return cls(*load_parts(path, dtype))

    # ---- geometry ------------------------------------------------------------------
    @property
    def n_visual_outputs(self) -> int:
        return self.codec.codebook_size

    @property
    def image_grid(self) -> tuple[int, int]:
        """(side, side) visual positions of every generated image (24 x 24 for Janus-Pro)."""
        return self.codec.grid

    @property
    def n_image_tokens(self) -> int:
        return self.image_grid[0] * self.image_grid[1]

    @property
    def image_size(self) -> tuple[int, int]:
        """(H, W) pixels of input and generated images (384 x 384 for Janus-Pro)."""
        return self.codec.image_size

    @property
    def max_positions(self) -> int:
        text: Any = (
            self.config.text_config
        )  # transformers types sub-configs as dict | config | None
        return int(text.max_position_embeddings)

    # ---- chat format ---------------------------------------------------------------
    @property
    def special_ids(self) -> StreamIds:
        t = self.tokens
        return StreamIds(
            pad=t.pad, eos=t.eos, vision_start=t.boi, vision_end=t.eoi, image_pad=t.image
        )

    def prompt_trajectory(self, sample: Sample, add_generation_prompt: bool = True) -> Trajectory:
        """The sample in the Janus-Pro format (`template`); its input images travel with
        it (`Trajectory.images`)."""
        return self.template.serialize(sample, add_generation_prompt, self.codec.encode)

    def image_generation_prefix(self, height: int, width: int) -> list[int]:
        """``<begin_of_image>``: Janus announces an image by that token alone."""
        self.template.check_grid(height, width, "image generation")
        return [self.tokens.boi]

    def parse_image_header(self, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """None: Janus-Pro never announces an image inside text (as in transformers'
        text-mode `generate`); image generation is chosen by the prompt, which text-to-image
        ends with ``<begin_of_image>``. A sampled ``<begin_of_image>`` ends the row
        "invalid", or stays a text token with `on_invalid_header="text"`."""
        return None

    def parse_response(self, traj: Trajectory) -> list[Part] | None:
        return self.template.parse_response(traj)

    def unconditional_prompt(self, traj: Trajectory) -> Trajectory:
        """Janus's CFG prompt: every prompt token but BOS and ``<begin_of_image>`` -> pad."""
        return self.template.unconditional(traj)

    # ---- hooks ---------------------------------------------------------------------
    def embed(self, inputs: ModelInputs) -> torch.Tensor:
        # Janus's generation embeddings carry no grid position (the decoder's 1D positions do).
        inner = self.model
        embeds = inner.language_model.embed_tokens(inputs.token_ids)
        visual = inputs.modality == Modality.VISUAL
        if visual.any():
            rows, cols = visual.nonzero(as_tuple=True)
            codes = inputs.visual_codes[rows, cols]
            gen = inner.generation_aligner(inner.generation_embeddings(codes))
            embeds = embeds.index_put((rows, cols), gen.to(embeds.dtype))
        return self._merge_images(embeds, inputs)

    def _merge_images(self, embeds: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        """Write the SigLIP features of each row's images over its image blocks."""
        token_ids, modality = inputs.token_ids, inputs.modality
        t, n, T = self.tokens, self.n_image_tokens, token_ids.shape[1]
        placeholder = (token_ids == t.image) & (modality == Modality.TEXT)
        starts = torch.zeros_like(placeholder)
        starts[:, 1:] = placeholder[:, 1:] & (token_ids[:, :-1] == t.boi)
        if not starts.any():
            return embeds
        if len(inputs.images) != len(token_ids):
            raise ValueError(
                f"Janus-Pro input images: {len(inputs.images)} image lists for "
                f"{len(token_ids)} rows (ModelInputs.images holds one list per row)"
            )
        rows, first = starts.nonzero(as_tuple=True)  # row-major: a row's blocks in order
        cols = first[:, None] + torch.arange(n, device=first.device)[None]
        if (cols[:, -1] >= T).any() or not placeholder[rows[:, None], cols.clamp(max=T - 1)].all():
            raise ValueError(f"an input image block holds fewer than {n} {IMAGE} tokens")
        images: list[torch.Tensor] = []
        for r in sorted(set(rows.tolist())):
            found, blocks = inputs.images[r], int((rows == r).sum())
            if len(found) != blocks:
                raise ValueError(
                    f"row {r} has {blocks} input image block(s) but carries {len(found)} "
                    "image(s) (Trajectory.images); serialise its sample with prompt_trajectory"
                )
            images += found
        features = self.image_features(images).to(embeds.dtype).reshape(-1, embeds.shape[-1])
        return embeds.index_put(
            (rows[:, None].expand_as(cols).reshape(-1), cols.reshape(-1)), features
        )

    def image_features(self, images: Sequence[torch.Tensor | np.ndarray]) -> torch.Tensor:
        """Aligned SigLIP features [n, N, d] of checked pixels [S, S, 3] in [0, 1]; equal
        images (a group's members share theirs) go through the tower once."""
        slot: dict[bytes, int] = {}
        keys: list[Any] = []
        distinct: list[Any] = []
        for image in images:
            px = torch.as_tensor(image).detach().float().cpu().contiguous()
            key = hashlib.blake2b(px.numpy().tobytes(), digest_size=16).digest()
            if key not in slot:
                slot[key] = len(distinct)
                distinct.append(px)
            keys.append(slot[key])
        tower = self.model.vision_model
        param = next(tower.parameters())
        x = self.pixels.normalize(torch.stack(distinct).to(param.device))
        with torch.no_grad():
            hidden = tower(x.to(param.dtype)).last_hidden_state
        aligned = self.model.aligner(hidden)
        return aligned[torch.tensor(keys, device=aligned.device)]

    def body(
        self,
        embeds: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any = None,
    ) -> BodyOutput:
        return run_decoder(self.model.language_model, embeds, attention_mask, position_ids, cache)

    def plain_decoder(self) -> Any:
        """The Llama text decoder: `body` runs it and nothing else, so the rollout may take
        its lean decode step (`uniweave.rollout.lean_step`, which checks the configuration)."""
        return self.model.language_model

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def visual_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.generation_head(hidden)

    # ---- training ------------------------------------------------------------------
    def train(self, mode: bool = True) -> JanusProModel:
        """Set train/eval mode; the frozen VQ model and SigLIP tower stay in eval."""
        super().train(mode)
        self.model.vision_model.eval()
        self.model.vqmodel.eval()
        return self

    def enable_gradient_checkpointing(self) -> None:
        self.model.language_model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )

    def save_pretrained(
        self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None
    ) -> None:
        """A transformers checkpoint (weights, config, tokenizer, image processor) plus
        `uniweave_model.json`; `state_dict` (e.g. LoRA merged) replaces the live weights."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        source = self.state_dict() if state_dict is None else state_dict
        state = {k: v.detach().contiguous().cpu() for k, v in source.items()}
        self._hf.save_pretrained(str(path), state_dict=state)
        self.tokenizer.save_pretrained(str(path))
        self.image_processor.save_pretrained(str(path))
        (path / MODEL_CONFIG).write_text(json.dumps({"kind": self.kind}, indent=2) + "\n")
