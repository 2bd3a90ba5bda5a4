"""The `UnifiedModel` contract (docs/models.md §1).

A unified model reads and writes one stream of positions. The adapter turns a batch into
**model inputs** and runs them, nothing else; algorithms, rollout and replay are written
against these hooks alone:

- ``prepare(batch) -> ModelInputs``: token ids, modality, codes, the understanding-image
  inputs the trajectories carry, and position ids in the model's own shape (``[B, T]``
  for RoPE; an M-RoPE model returns ``[3, B, T]``). ``prepare_prompts(prompts)`` does the
  same for left-padded rollout prompts, and ``decode_positions(inputs)`` gives the object
  the decode loop asks for each next step's positions (nothing outside the adapter
  assumes ``pos + 1``).
- ``hidden(inputs, cache) -> BodyOutput(hidden, cache)``: ``embed(inputs)`` then
  ``body(embeds, attention_mask, position_ids, cache)``.
- ``text_logits(hidden [N, d]) -> [N, V]`` and ``visual_logits(hidden [N, d]) -> [N, K | L]``,
  applied by callers only at the positions they score (never to a full sequence).

plus the image codec (``encode`` / ``decode``), the tokenizer and the chat template.
The model holds no state about rows: everything a forward needs travels in the batch
(`Trajectory.images`), so a reference copy, a teacher, a resumed run or another process
scores a trajectory exactly as the sampler did. For classifier-free guidance an adapter
also builds the unconditional prompt of a conditional one (``unconditional_prompt``; the
default blanks the user turns' content).

The chat format is a model hook too, so rollout and rewards never assume ChatML:
``prompt_trajectory`` serialises a `Sample`, ``image_generation_prefix`` /
``parse_image_header`` write and read what announces a generated image,
``parse_response`` reads a rollout row's response back, and ``special_ids`` names the
ids the rollout state machine needs. The defaults are the embedded ChatML template
(`uniweave.data.template`); Janus-Pro overrides them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from uniweave.core.sample import Part, Sample
from uniweave.core.trajectory import Trajectory, TrajectoryBatch
from uniweave.core.types import Modality, Owner

VisualHead = Literal["vq", "bsq"]


@dataclass(frozen=True)
class StreamIds:
    """The special ids the rollout state machine uses: `pad` (batch padding), `eos` (ends a
    row), `vision_start` (opens a generated image), `vision_end` (the controller's close
    of an image) and `image_pad` (the token id held by visual positions)."""

    pad: int
    eos: int
    vision_start: int
    vision_end: int
    image_pad: int


def run_decoder(
    decoder: nn.Module,
    embeds: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any = None,
) -> BodyOutput:
    """Run a transformers decoder (LlamaModel-like) on input embeddings; the cache is
    used and returned only when one is passed. `attention_mask` is the key-padding mask
    [B, T_past + T], or a full query × key mask [B, T, T] (`query_key_mask`)."""
    out = decoder(
        inputs_embeds=embeds,
        attention_mask=query_key_mask(decoder, attention_mask, embeds.dtype, cache),
        position_ids=position_ids,
        cache=cache,
        use_cache=cache is not None,
    )
    return BodyOutput(hidden=out.last_hidden_state, cache=out.cache)


def query_key_mask(
    decoder: nn.Module, attention_mask: torch.Tensor, dtype: torch.dtype, cache: Any = None
) -> torch.Tensor:
    """What a transformers decoder takes for `attention_mask`: a key-padding mask [B, T]
    as long (the decoder adds causality), or a bool query × key mask [B, T, T] (causality
    already in it; a full forward, no cache) as the 4-D mask the decoder uses as-is —
    bool for SDPA, additive (0 / dtype min) for eager attention."""
    if attention_mask.dim() == 2:
        return attention_mask.long()
    if attention_mask.dim() != 3 or cache is not None:
        raise ValueError(
            f"attention_mask: expected [B, T] or, without a cache, [B, T, T]; got "
            f"{tuple(attention_mask.shape)}{' with a cache' if cache is not None else ''}"
        )
    mask = attention_mask.bool()[:, None]
    if getattr(decoder.config, "_attn_implementation", "sdpa") == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    return mask


@dataclass
class BodyOutput:
    """Hidden states [B, T, d] of the decoder body and its (updated) KV cache."""

    hidden: torch.Tensor
    cache: Any = None


@dataclass
class ModelInputs:
    """Everything one forward of a model needs (docs/models.md §1), batch-first.

    `token_ids`, `modality` long [B, T]; `visual_codes` VQ long [B, T] / BSQ float [B, T, L]
    (the *input* codes: BitFlip may perturb them); `attention_mask` bool [B, T_past + T]
    (cached positions included when decoding), or, for a full forward without a cache, a
    bool query × key mask [B, T, T] with causality in it (Information Gain's blind views,
    packed rows' block-causal `packed_attention_mask`); `position_ids` in the model's own shape
    (RoPE: long [B, T]; M-RoPE: [3, B, T]); `image_position` long [B, T]: raster index of
    each visual position within its image (0 elsewhere); `images[b]`: row b's
    understanding-image inputs in order (`Trajectory.images`; empty for decoding steps).
    """

    token_ids: torch.Tensor
    modality: torch.Tensor
    visual_codes: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    image_position: torch.Tensor
    images: list[list[torch.Tensor]] = field(default_factory=list)


class DecodePositions:
    """The decode loop's source of next positions (RoPE: each row's next index).

    `next(modality, image_position, token_ids)` returns the position ids of the next fed
    position of every batch row ([B, 1], the model's shape) and advances; `select(rows)`
    keeps rows (the engine compacts finished ones). Models with other position schemes
    (M-RoPE, which reads a generated image's grid from its header tokens) return their own
    object from `UnifiedModel.decode_positions`.
    """

    def __init__(self, next_position: torch.Tensor) -> None:
        self.next_position = next_position

    def next(
        self,
        modality: torch.Tensor,
        image_position: torch.Tensor,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        pos = self.next_position[:, None]
        self.next_position = self.next_position + 1
        return pos

    def select(self, rows: torch.Tensor) -> None:
        self.next_position = self.next_position[rows]


def rope_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """long [B, T]: 0, 1, ... over each row's real positions (left or right padding), 0 on
    padding."""
    mask = attention_mask.long()
    return ((torch.cumsum(mask, dim=-1) - 1) * mask).clamp(min=0)


def packed_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, T, T] for packed rows (`segment_ids` long [B, T], 0 = padding): query t
    sees key s <= t of its own sequence only; a padding query sees itself only (so no
    attention row is empty)."""
    seg = segment_ids
    T = seg.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    eye = torch.eye(T, dtype=torch.bool, device=seg.device)
    return (same & causal) | eye


def packed_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """long [B, T]: 0, 1, ... restarted at the first position of each packed sequence,
    0 on padding."""
    seg = segment_ids
    idx = torch.arange(seg.shape[1], device=seg.device).expand_as(seg)
    start = torch.ones_like(seg, dtype=torch.bool)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    first = torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=-1).values
    return torch.where(seg > 0, idx - first, torch.zeros_like(idx))


def left_pad(prompts: Sequence[Trajectory], pad_id: int) -> tuple[torch.Tensor, ...]:
    """(token_ids, modality, visual_codes, attention_mask) of `prompts` left-padded to
    the longest (padding: `pad_id`, TEXT, no code)."""
    lengths = torch.tensor([len(p) for p in prompts])
    P = int(lengths.max())
    first = prompts[0].visual_codes
    code_pad = 0.0 if first.dim() == 2 else -1
    B = len(prompts)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    modality = torch.full((B, P), int(Modality.TEXT), dtype=torch.long)
    codes = torch.full((B, P, *first.shape[1:]), code_pad, dtype=first.dtype)
    for r, p in enumerate(prompts):
        ids[r, P - len(p) :] = p.token_ids
        modality[r, P - len(p) :] = p.modality
        codes[r, P - len(p) :] = p.visual_codes
    mask = torch.arange(P)[None] >= (P - lengths)[:, None]
    return ids, modality, codes, mask


def image_positions(modality: torch.Tensor) -> torch.Tensor:
    """[B, T] raster index of each visual position within its run of consecutive visual
    positions (one image); 0 at text positions."""
    visual = modality == Modality.VISUAL
    count = torch.cumsum(visual.long(), dim=-1)
    before = torch.where(visual, torch.zeros_like(count), count)
    start = torch.cummax(before, dim=-1).values
    return torch.where(visual, count - start - 1, torch.zeros_like(count))


class UnifiedModel(nn.Module, ABC):
    """One decoder over text and visual positions, with a text and a visual head."""

    kind: str
    visual_head: VisualHead
    tokenizer: Any
    codec: Any
    # Whether `prepare` accepts packed batches (`TrajectoryBatch.segment_ids`): the body
    # honours a block-causal [B, 1, T, T] mask and positions restart per sequence.
    supports_packing: bool = False

    @property
    def supports_prefix_sharing(self) -> bool:
        """Whether replay may run each distinct prompt once and its rows' completions
        against its KV cache (`uniweave.forward.shared_prefix_hidden`): RoPE positions
        [B, T], and a body whose cached continuation equals the full forward with
        gradient. Default: no."""
        return False

    # The largest H or W of a generated image the model's own serialisation allows (UniAR:
    # 30); None: no limit of its own. The rollout engine bounds sampled and forced image
    # grids by it as well as by `rollout.min_grid_side`..`max_grid_side`.
    max_grid_side: int | None = None

    @abstractmethod
    def embed(self, inputs: ModelInputs) -> torch.Tensor:
        """Input embeddings [B, T, d]: text embedding at text positions, visual embedding of
        the code (VQ index or BSQ bit vector, at `inputs.image_position` within its image)
        at visual positions, and whatever the model reads of `inputs.images`."""

    @abstractmethod
    def body(
        self,
        embeds: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any = None,
    ) -> BodyOutput:
        """Run the decoder. `attention_mask` [B, T_past + T] covers cached and new positions."""

    @abstractmethod
    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Text-vocabulary logits [N, V] for hidden states [N, d] at scored positions."""

    @abstractmethod
    def visual_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """VQ: codebook logits [N, K]; BSQ: one Bernoulli logit per bit [N, L]."""

    @property
    @abstractmethod
    def n_visual_outputs(self) -> int:
        """K (VQ codebook size) or L (bits per visual position)."""

    @abstractmethod
    def save_pretrained(
        self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Write weights (safetensors; `state_dict` instead of the live one if given),
        config, tokenizer and codec to `path`."""

    @abstractmethod
    def enable_gradient_checkpointing(self) -> None:
        """Recompute the body's activations in backward instead of storing them."""

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # ---- model inputs ------------------------------------------------------------------
    def position_ids(self, attention_mask: torch.Tensor, modality: torch.Tensor) -> torch.Tensor:
        """Position ids of a padded batch in this model's shape (RoPE: `rope_positions`)."""
        return rope_positions(attention_mask)

    def prepare(
        self, batch: TrajectoryBatch, visual_inputs: torch.Tensor | None = None
    ) -> ModelInputs:
        """The inputs of a teacher-forced forward of a right-padded batch on the model's
        device. `visual_inputs` replaces `batch.visual_codes` as input codes (BitFlip). A
        packed batch (`segment_ids`, models with `supports_packing`) gets the block-causal
        mask and positions restarted per sequence (RoPE)."""
        device = self.device
        batch = batch.to(device)
        codes = batch.visual_codes if visual_inputs is None else visual_inputs.to(device)
        mask, positions = batch.attention_mask, None
        if batch.segment_ids is not None:
            if not self.supports_packing:
                raise ValueError(f"{type(self).__name__} does not support packed batches")
            mask = packed_attention_mask(batch.segment_ids)
            positions = packed_positions(batch.segment_ids)
        return ModelInputs(
            token_ids=batch.token_ids,
            modality=batch.modality,
            visual_codes=codes,
            attention_mask=mask,
            position_ids=self.position_ids(mask, batch.modality)
            if positions is None
            else positions,
            image_position=image_positions(batch.modality),
            images=batch.images,
        )

    def prepare_prompts(self, prompts: Sequence[Trajectory], pad_id: int) -> ModelInputs:
        """The inputs of a rollout prefill: `prompts` left-padded (`left_pad`), so every
        row's last prompt position is the batch's last column."""
        ids, modality, codes, mask = left_pad(prompts, pad_id)
        device = self.device
        ids, modality, codes, mask = (x.to(device) for x in (ids, modality, codes, mask))
        return ModelInputs(
            token_ids=ids,
            modality=modality,
            visual_codes=codes,
            attention_mask=mask,
            position_ids=self.position_ids(mask, modality),
            image_position=image_positions(modality),
            images=[[x.to(device) for x in p.images] for p in prompts],
        )

    def decode_positions(self, prefill: ModelInputs) -> DecodePositions:
        """Where decoding continues after `prefill` (RoPE: one past each row's last)."""
        return DecodePositions(prefill.attention_mask.long().sum(-1))

    def hidden(self, inputs: ModelInputs, cache: Any = None) -> BodyOutput:
        """Decoder hidden states [B, T, d] of `inputs` (and the updated cache when given)."""
        embeds = self.embed(inputs)
        return self.body(embeds, inputs.attention_mask, inputs.position_ids, cache)

    def plain_decoder(self) -> nn.Module | None:
        """The transformers decoder that `body` runs and nothing else (`run_decoder`), so a
        decode loop may run its steps op for op (`uniweave.rollout.lean_step`); None (the
        default) when `body` does more or is not a transformers decoder."""
        return None

    def new_cache(self) -> Any:
        """An empty KV cache for incremental decoding."""
        from transformers import DynamicCache

        return DynamicCache()

    @property
    def special_ids(self) -> StreamIds:
        """The rollout's special ids (default: the ChatML tokens of `uniweave.data.tokenizer`)."""
        from uniweave.data.tokenizer import SpecialIds

        sp = SpecialIds.from_tokenizer(self.tokenizer)
        return StreamIds(sp.pad, sp.eos, sp.vision_start, sp.vision_end, sp.image_pad)

    def prompt_trajectory(self, sample: Sample, add_generation_prompt: bool = True) -> Trajectory:
        """The sample's token stream in this model's chat format (default: ChatML,
        `uniweave.data.template.serialize`, images encoded with the codec)."""
        from uniweave.data.template import serialize

        bits = self.n_visual_outputs if self.visual_head == "bsq" else None
        return serialize(
            sample,
            self.tokenizer,
            encode_image=self.codec.encode,
            add_generation_prompt=add_generation_prompt,
            bits=bits,
        )

    def image_generation_prefix(self, height: int, width: int) -> list[int]:
        """Token ids that announce a generated image of height x width visual positions
        (default: ``<image_gen> generate image H W<|vision_start|>``)."""
        from uniweave.data.template import image_generation_prefix

        return image_generation_prefix(height, width, self.tokenizer)

    def parse_image_header(self, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """(H, W) of the image announced by text `token_ids` that end just before a sampled
        `special_ids.vision_start`, or None for no valid announcement (default: the last
        ``<image_gen> generate image H W`` header, `uniweave.data.template.parse_image_header`)."""
        from uniweave.data.template import parse_image_header

        return parse_image_header(token_ids, self.tokenizer)

    def parse_response(self, traj: Trajectory) -> list[Part] | None:
        """The response parts (final assistant turn) of a rollout trajectory, or None when it
        does not parse (default: `uniweave.data.template.parse_response`, ChatML)."""
        from uniweave.data.template import parse_response

        return parse_response(traj, self.tokenizer)

    def unconditional_prompt(self, traj: Trajectory) -> Trajectory:
        """The unconditional twin of a prompt for classifier-free guidance (same length).

        Default (ChatML, docs/models.md §1): every PROMPT-owned position strictly inside a user turn
        (after ``<|im_start|>user\\n``, before its ``<|im_end|>``) becomes the pad token:
        text modality, no visual code, and the images there are dropped from
        ``image_grids``. The chat scaffold, other turns, the open assistant header and an
        image-generation prefix are kept, so the guided rows share positions with the
        conditional ones. Understanding-image inputs (user-turn content) are dropped.
        Adapters with another convention (Janus) override this.
        """
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        header = [im_start, *tok.encode("user\n", add_special_tokens=False)]
        ids = traj.token_ids.tolist()
        owner = traj.owner.tolist()
        visual = (traj.modality == Modality.VISUAL).tolist()
        blank = [False] * len(ids)
        t = 0
        while t < len(ids):
            if ids[t : t + len(header)] != header:
                t += 1
                continue
            t += len(header)
            while t < len(ids) and ids[t] != im_end and owner[t] == Owner.PROMPT:
                blank[t] = True
                t += 1
        keep_grids, image, t = [], 0, 0
        while t < len(ids):
            if visual[t]:
                h, w = traj.image_grids[image]
                if not blank[t]:
                    keep_grids.append((h, w))
                image, t = image + 1, t + h * w
            else:
                t += 1
        mask = torch.tensor(blank, dtype=torch.bool, device=traj.token_ids.device)
        codes = traj.visual_codes.clone()
        codes[mask] = -1 if codes.dim() == 1 else 0
        return replace(
            traj,
            token_ids=traj.token_ids.masked_fill(mask, pad),
            modality=traj.modality.masked_fill(mask, Modality.TEXT),
            visual_codes=codes,
            image_grids=keep_grids,
            rollout_logp=None,
            rollout_logp_factors=None,
            images=[],
        )
