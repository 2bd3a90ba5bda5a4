"""The Janus-Pro chat format (DeepSeek's "deepseek" SFT template), its CFG twin and parse.

A sample becomes (BOS first, empty system prompt unless the sample has one)::

    <｜begin▁of▁sentence｜>{system}\\n\\n<|User|>: {user}\\n\\n<|Assistant|>: {answer}<｜end▁of▁sentence｜>

and a rollout prompt ends with the open header ``<|Assistant|>:``. An input (user) image
is ``<begin_of_image>`` + N x ``<image_placeholder>`` + ``<end_of_image>`` (N = 576 for
Janus-Pro), separated from neighbouring parts by "\\n"; its positions are TEXT (the
placeholders receive the SigLIP features, see `JanusProModel.embed`) and its pixels are
returned alongside the trajectory. A generated (assistant) image is ``<begin_of_image>``
(PROMPT: text-to-image appends it to the prompt, as Janus does) + N VISUAL positions
(POLICY, holding ``<image_placeholder>`` and their VQ code) + ``<end_of_image>``
(CONTROLLER). An assistant turn is either text (" " + text + EOS, all POLICY) or one
image: Janus-Pro does not interleave them. Every text that precedes a policy segment is
tokenised as one string, so prompts match the processor's tokenisation.

Owners: everything but the assistant answers is PROMPT. Special-token ids are looked up
from the tokenizer (`JanusTokens`), never hard-coded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from uniweave.core.sample import GenerationRequest, ImagePart, Part, Sample, TextPart
from uniweave.core.trajectory import Trajectory
from uniweave.core.types import Modality, Owner
from uniweave.data.template import turns_of

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
IMAGE = "<image_placeholder>"
BOI = "<begin_of_image>"
EOI = "<end_of_image>"
USER = "<|User|>"
ASSISTANT = "<|Assistant|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IMAGE, BOI, EOI)
TURN_SEP = "\n\n"

EncodeImage = Callable[[torch.Tensor], torch.Tensor]
"""pixels float [N, H, W(, C)] in [0, 1] -> VQ codes long [N, gh, gw]."""


@dataclass(frozen=True)
class JanusTokens:
    """Ids of Janus-Pro's special tokens, looked up by their tags (the pad id by its tag
    ``<｜▁pad▁｜>``, as the original processor does, not `tokenizer.pad_token_id`)."""

    bos: int
    eos: int
    pad: int
    image: int
    boi: int
    eoi: int

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> JanusTokens:
        """ValueError naming every Janus-Pro special token the tokenizer lacks."""
        found = {tag: tokenizer.convert_tokens_to_ids(tag) for tag in SPECIAL_TOKENS}
        unk = tokenizer.unk_token_id
        missing = [tag for tag, i in found.items() if i is None or i == unk]
        if missing:
            raise ValueError(
                f"tokenizer lacks Janus-Pro special token(s) {', '.join(missing)} "
                "(is it a Janus-Pro tokenizer?)"
            )
        return cls(*(int(found[tag]) for tag in SPECIAL_TOKENS))  # type: ignore[arg-type]  # one token -> one id


class _Stream:
    """Positions under construction; PROMPT text accumulates in `pending` until a policy
    segment (or the end) tokenises it as one string."""

    def __init__(self, template: JanusTemplate) -> None:
        self.t = template
        self.ids: list[int] = [template.tokens.bos]
        self.modality: list[int] = [Modality.TEXT]
        self.owner: list[int] = [Owner.PROMPT]
        self.codes: list[int] = [-1]
        self.grids: list[tuple[int, int]] = []
        self.pending = ""

    def add(self, ids: Sequence[int], owner: Owner) -> None:
        self.ids += ids
        self.modality += [Modality.TEXT] * len(ids)
        self.owner += [owner] * len(ids)
        self.codes += [-1] * len(ids)

    def flush(self) -> None:
        if self.pending:
            self.add(self.t.encode(self.pending), Owner.PROMPT)
            self.pending = ""

    def image(self, codes: torch.Tensor) -> None:
        flat = codes.reshape(-1).tolist()
        self.ids += [self.t.tokens.image] * len(flat)
        self.modality += [Modality.VISUAL] * len(flat)
        self.owner += [Owner.POLICY] * len(flat)
        self.codes += flat
        self.grids.append((int(codes.shape[0]), int(codes.shape[1])))


class JanusTemplate:
    """Serialise samples in the Janus-Pro format, build the CFG unconditional prompt and
    read responses back (module docstring). `grid` is the (side, side) image grid of
    `n_image_tokens` positions; `check_pixels` validates an input image (it raises
    ValueError naming `where`)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        grid: tuple[int, int],
        check_pixels: Callable[[np.ndarray, str], np.ndarray],
    ) -> None:
        self.tokenizer = tokenizer
        self.tokens = JanusTokens.from_tokenizer(tokenizer)
        self.grid = grid
        self.n_image_tokens = grid[0] * grid[1]
        self.check_pixels = check_pixels
        self.image_block = BOI + IMAGE * self.n_image_tokens + EOI

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_grid(self, height: int, width: int, where: str) -> None:
        """ValueError unless (height, width) is the native grid (Janus generates one size)."""
        if (height, width) != self.grid:
            h, w = self.grid
            raise ValueError(
                f"{where}: Janus-Pro generates images of {h}x{w} = {self.n_image_tokens} "
                f"tokens; a {height}x{width} request ({height * width} tokens) does not fill "
                "that grid"
            )

    # ---- serialisation -------------------------------------------------------------
    def serialize(
        self,
        sample: Sample,
        add_generation_prompt: bool = False,
        encode_image: EncodeImage | None = None,
    ) -> Trajectory:
        """The sample's trajectory; its `images` are the checked pixels of its input images
        in order, float [S, S, 3] in [0, 1] (they travel with it). `add_generation_prompt`:
        only the prompt (parts before the first assistant part, plus that part if it is a
        `GenerationRequest`) and the open header ``<|Assistant|>:`` (+ ``<begin_of_image>``
        for a generation request). `encode_image` gives the codes of assistant images
        given as pixels."""
        parts = list(sample.parts)
        if add_generation_prompt:
            first = next((k for k, p in enumerate(parts) if p.role == "assistant"), len(parts))
            keep = first + int(first < len(parts) and isinstance(parts[first], GenerationRequest))
            parts = parts[:keep]
        for k, part in enumerate(parts[:-1]):
            if isinstance(part, GenerationRequest):
                raise ValueError(
                    f"sample {sample.id!r} parts[{k}]: a GenerationRequest must be last"
                )
        stream = _Stream(self)
        pixels: list[Any] = []
        open_turn = False
        for role, members in turns_of(parts):
            if role == "assistant":
                open_turn = self._assistant(stream, members, sample.id, encode_image)
            else:
                content = self._content(members, sample.id, pixels, role)
                stream.pending += (f"{USER}: " if role == "user" else "") + content + TURN_SEP
        if add_generation_prompt and not open_turn:
            stream.pending += f"{ASSISTANT}:"
        stream.flush()
        traj = Trajectory(
            token_ids=torch.tensor(stream.ids, dtype=torch.long),
            modality=torch.tensor(stream.modality, dtype=torch.long),
            owner=torch.tensor(stream.owner, dtype=torch.long),
            visual_codes=torch.tensor(stream.codes, dtype=torch.long),
            image_grids=stream.grids,
            sample_id=sample.id,
            images=[torch.from_numpy(px) for px in pixels],
        ).validate()
        n_placeholders = int(((traj.token_ids == self.tokens.image) & (traj.modality == 0)).sum())
        if n_placeholders != len(pixels) * self.n_image_tokens:
            raise ValueError(
                f"sample {sample.id!r}: the tokenizer does not encode {IMAGE} as one token "
                f"({n_placeholders} placeholders for {len(pixels)} image(s)); mismatched tokenizer?"
            )
        return traj

    def _content(self, members, sample_id: str, pixels: list, role: str) -> str:
        pieces: list[tuple[bool, str]] = []
        for k, part in members:
            where = f"sample {sample_id!r} parts[{k}]"
            if isinstance(part, TextPart):
                bad = [tag for tag in SPECIAL_TOKENS if tag in part.text]
                if bad:
                    raise ValueError(f"{where}: text contains special token(s) {', '.join(bad)}")
                pieces.append((False, part.text))
            elif isinstance(part, ImagePart):
                if role == "system":
                    raise ValueError(f"{where}: Janus-Pro takes no image in the system prompt")
                if part.pixels is None:
                    raise ValueError(f"{where}: Janus-Pro reads {role} images as pixels, got codes")
                pixels.append(self.check_pixels(part.pixels, where))
                pieces.append((True, self.image_block))
            else:
                raise ValueError(f"{where}: a GenerationRequest must have role 'assistant'")
        out = ""
        for n, (is_image, text) in enumerate(pieces):
            if n > 0 and (is_image or pieces[n - 1][0]):
                out += "\n"
            out += text
        return out

    def _assistant(self, stream: _Stream, members, sample_id: str, encode_image) -> bool:
        """Write one assistant turn; True when it leaves the stream open for generation."""
        where = f"sample {sample_id!r} parts[{members[0][0]}]"
        parts = [p for _, p in members]
        stream.pending += f"{ASSISTANT}:"
        if all(isinstance(p, TextPart) for p in parts):
            stream.flush()
            stream.add(self.encode(" " + "".join(p.text for p in parts)), Owner.POLICY)
            stream.add([self.tokens.eos], Owner.POLICY)
            return False
        if len(parts) != 1:
            raise ValueError(f"{where}: a Janus-Pro answer is text or one image, not both")
        part = parts[0]
        if isinstance(part, GenerationRequest):
            self.check_grid(part.height, part.width, where)
            stream.pending += BOI
            stream.flush()
            return True
        codes = part.codes
        if codes is None:
            if encode_image is None:
                raise ValueError(f"{where}: the image has pixels but no codes; pass encode_image")
            pixels = self.check_pixels(part.pixels, where)
            codes = encode_image(torch.from_numpy(pixels)[None])[0]
        if codes.dtype != torch.long or codes.dim() != 2:
            raise ValueError(f"{where}: Janus-Pro image codes must be VQ long [gh, gw]")
        self.check_grid(int(codes.shape[0]), int(codes.shape[1]), where)
        stream.pending += BOI
        stream.flush()
        stream.image(codes)
        stream.add([self.tokens.eoi], Owner.CONTROLLER)
        return False

    # ---- classifier-free guidance ---------------------------------------------------
    def unconditional(self, traj: Trajectory) -> Trajectory:
        """The CFG twin of a prompt, as Janus builds it: every PROMPT position except BOS
        and ``<begin_of_image>`` becomes the pad token (text, no code); images there are
        dropped from `image_grids`, input images from `images`. Same length as `traj`."""
        keep = (traj.token_ids == self.tokens.bos) | (traj.token_ids == self.tokens.boi)
        blank = (traj.owner == Owner.PROMPT) & ~keep
        visual = (traj.modality == Modality.VISUAL).tolist()
        grids, image, t = [], 0, 0
        while t < len(traj):
            if visual[t]:
                h, w = traj.image_grids[image]
                if not bool(blank[t]):
                    grids.append((h, w))
                image, t = image + 1, t + h * w
            else:
                t += 1
        return replace(
            traj,
            token_ids=traj.token_ids.masked_fill(blank, self.tokens.pad),
            modality=traj.modality.masked_fill(blank, Modality.TEXT),
            visual_codes=traj.visual_codes.masked_fill(blank, -1),
            image_grids=grids,
            rollout_logp=None,
            rollout_logp_factors=None,
            images=[],
        )

    # ---- reading responses ----------------------------------------------------------
    def parse_response(self, traj: Trajectory) -> list[Part] | None:
        """The response: the parts from the first POLICY position on, role "assistant" —
        text up to EOS (decoded, the template's leading space removed) and images (a full
        grid of VISUAL positions, as `ImagePart(codes=[gh, gw])`, closed by
        ``<end_of_image>`` or by the end of the row). None when a row stops inside an
        image or something else follows one."""
        policy = (traj.owner == Owner.POLICY).nonzero()
        if policy.numel() == 0:
            return []
        ids, visual = traj.token_ids.tolist(), (traj.modality == Modality.VISUAL).tolist()
        parts: list[Part] = []
        text: list[int] = []
        t = int(policy[0])
        while t < len(ids) and ids[t] != self.tokens.eos:
            if not visual[t]:
                if ids[t] != self.tokens.boi:
                    text.append(ids[t])
                t += 1
                continue
            n = self.n_image_tokens
            if t + n > len(ids) or not all(visual[t : t + n]):
                return None  # stopped inside the image
            if t + n < len(ids) and ids[t + n] != self.tokens.eoi:
                return None
            parts += self._text(text)
            text = []
            codes = traj.visual_codes[t : t + n].reshape(self.grid).clone()
            parts.append(ImagePart(codes=codes, role="assistant"))
            t += n + 1
        return parts + self._text(text)

    def _text(self, ids: list[int]) -> list[Part]:
        if not ids:
            return []
        text = str(self.tokenizer.decode(ids, skip_special_tokens=False))
        return [TextPart(text[1:] if text.startswith(" ") else text, "assistant")]
