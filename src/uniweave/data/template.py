"""ChatML serialisation of a `Sample` into one `Trajectory`, and its exact inverse `parse`.

Layout (turns are runs of consecutive parts with one role; turns are joined by "\\n"):

    <|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n{content}<|im_end|>

Content is the turn's parts in order, with nothing between them. Text is tokenised as is
(with the WordLevel tokenizer "\\n" is a token; see `uniweave.data.tokenizer`). An image in a
user/system turn is an input image:

    <|vision_start|> + H*W visual positions + <|vision_end|>

An image in an assistant turn is a generated image, announced by a header:

    <image_gen> generate image H W<|vision_start|> + H*W visual positions + <|vision_end|>

Visual positions hold `<|image_pad|>` with modality VISUAL and their code in
`visual_codes` (row-major over the (H, W) code grid). A `GenerationRequest` in an
assistant turn writes the header (through `<|vision_start|>`) and ends the stream there:
the image is left for the rollout to generate; it must be the last part.

Owners: every position of a user/system turn, the "\\n" between turns, the assistant
header `<|im_start|>assistant\\n` and a `GenerationRequest`'s forced header are PROMPT.
Every other assistant position (text, `<image_gen>`, the header words, `<|vision_start|>`,
visual positions, `<|im_end|>`) is POLICY, except `<|vision_end|>`, which the rollout's
controller inserts: CONTROLLER.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import NoReturn, get_args

import torch
from transformers import PreTrainedTokenizerBase

from uniweave.core.sample import (
    ROLES,
    GenerationRequest,
    ImagePart,
    Part,
    Role,
    Sample,
    TextPart,
)
from uniweave.core.trajectory import Trajectory
from uniweave.core.types import Modality, Owner
from uniweave.data.memo import memoized
from uniweave.data.tokenizer import NEWLINE, SpecialIds

EncodeImage = Callable[[torch.Tensor], torch.Tensor]
"""pixels float [N, H, W] in [0, 1] -> VQ long [N, gh, gw] or BSQ float {0,1} [N, gh, gw, L]."""

_HEADER_RE = re.compile(r"\s*generate image (\d+) (\d+)\s*")


def header_text(h: int, w: int) -> str:
    """The words between `<image_gen>` and `<|vision_start|>`."""
    return f"generate image {h} {w}"


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    def encode() -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return list(memoized(("text", tokenizer, text), encode))


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> SpecialIds:
    return memoized(("special", tokenizer), lambda: SpecialIds.from_tokenizer(tokenizer))


def image_generation_prefix(h: int, w: int, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of `<image_gen> generate image H W<|vision_start|>`."""
    sp = _special_ids(tokenizer)
    return [sp.image_gen, *_encode(tokenizer, header_text(h, w)), sp.vision_start]


def parse_image_header(
    token_ids: Sequence[int], tokenizer: PreTrainedTokenizerBase
) -> tuple[int, int] | None:
    """(H, W) announced by the last `<image_gen>` in `token_ids`, or None.

    `token_ids` ends just before a `<|vision_start|>` (e.g. a rollout row that has just
    sampled it); the tokens after the last `<image_gen>` must decode to
    "generate image H W" with H, W > 0, otherwise None (no valid header).
    """
    sp = SpecialIds.from_tokenizer(tokenizer)
    ids = [int(t) for t in token_ids]
    if sp.image_gen not in ids:
        return None
    start = len(ids) - ids[::-1].index(sp.image_gen)
    text = str(tokenizer.decode(ids[start:], skip_special_tokens=False))
    m = _HEADER_RE.fullmatch(text)
    if m is None or int(m.group(1)) == 0 or int(m.group(2)) == 0:
        return None
    return int(m.group(1)), int(m.group(2))


class _Stream:
    """Positions under construction."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.modality: list[int] = []
        self.owner: list[int] = []
        self.images: list[tuple[int, torch.Tensor]] = []  # (first position, codes [h*w, ...])
        self.grids: list[tuple[int, int]] = []

    def text(self, ids: Sequence[int], owner: Owner) -> None:
        self.ids += ids
        self.modality += [Modality.TEXT] * len(ids)
        self.owner += [owner] * len(ids)

    def image(self, codes: torch.Tensor, pad_id: int, owner: Owner) -> None:
        h, w = int(codes.shape[0]), int(codes.shape[1])
        flat = codes.reshape(h * w, *codes.shape[2:])
        if h * w:
            self.images.append((len(self.ids), flat))
        self.ids += [pad_id] * (h * w)
        self.modality += [Modality.VISUAL] * (h * w)
        self.owner += [owner] * (h * w)
        self.grids.append((h, w))

    def visual_codes(self, bits: int | None, where: str) -> torch.Tensor:
        found = {(c.dim() - 1, c.shape[-1] if c.dim() > 1 else 0) for _, c in self.images}
        if len(found) > 1:
            raise ValueError(f"{where}: images mix VQ and BSQ codes (or bit widths)")
        if found:
            dim, width = found.pop()
            kind_bits = int(width) if dim == 1 else None
            if bits is not None and kind_bits != bits:
                kind = "VQ codes" if kind_bits is None else f"BSQ codes of {kind_bits} bits"
                raise ValueError(f"{where}: images have {kind} but bits={bits}")
            bits = kind_bits
        T = len(self.ids)
        if bits is None:
            out = torch.full((T,), -1, dtype=torch.long)
        else:
            out = torch.zeros((T, bits), dtype=torch.float32)
        for start, codes in self.images:
            out[start : start + codes.shape[0]] = codes.to(out.dtype)
        return out


def _image_codes(part: ImagePart, encode_image: EncodeImage | None, where: str) -> torch.Tensor:
    if part.codes is not None:
        codes = part.codes
    elif encode_image is None:
        raise ValueError(f"{where}: the image has pixels but no codes; pass encode_image")
    else:
        pixels = torch.as_tensor(part.pixels, dtype=torch.float32)[None]
        key = ("image", encode_image, tuple(pixels.shape), pixels.numpy().tobytes())
        codes = memoized(key, lambda: encode_image(pixels)[0])
    if codes.dim() == 2 and codes.dtype == torch.long:
        if (codes < 0).any():
            raise ValueError(f"{where}: VQ codes must be >= 0")
        return codes
    if codes.dim() == 3 and codes.is_floating_point():
        if not ((codes == 0) | (codes == 1)).all():
            raise ValueError(f"{where}: BSQ codes must be 0/1 bits")
        return codes.to(torch.float32)
    raise ValueError(
        f"{where}: codes must be VQ long [gh, gw] or BSQ float [gh, gw, L], "
        f"got {codes.dtype} {tuple(codes.shape)}"
    )


def turns_of(parts: Sequence[Part]) -> list[tuple[str, list[tuple[int, Part]]]]:
    """Runs of consecutive parts with the same role: [(role, [(index, part), ...]), ...]."""
    turns: list[tuple[str, list[tuple[int, Part]]]] = []
    for k, part in enumerate(parts):
        if not turns or turns[-1][0] != part.role:
            turns.append((part.role, []))
        turns[-1][1].append((k, part))
    return turns


def _prompt_for_generation(parts: Sequence[Part]) -> list[Part]:
    first = next((k for k, p in enumerate(parts) if p.role == "assistant"), len(parts))
    prompt = list(parts[:first])
    if first < len(parts) and isinstance(parts[first], GenerationRequest):
        prompt.append(parts[first])
    return prompt


def serialize(
    sample: Sample,
    tokenizer: PreTrainedTokenizerBase,
    encode_image: EncodeImage | None = None,
    add_generation_prompt: bool = False,
    bits: int | None = None,
) -> Trajectory:
    """The sample's token stream (layout and owners in the module docstring).

    Images use `ImagePart.codes` when set, else `encode_image(pixels[None])[0]`.
    `add_generation_prompt=True` serialises only the prompt (the parts before the first
    assistant part, plus that part if it is a `GenerationRequest`) followed by the open
    assistant header `\\n<|im_start|>assistant\\n`, for rollout. `bits` gives the BSQ code
    width L for a stream without images (codes float [T, L]); None means VQ (long [T]).
    """
    sp = _special_ids(tokenizer)
    specials = sp.as_set()
    newline = _encode(tokenizer, NEWLINE)
    parts = _prompt_for_generation(sample.parts) if add_generation_prompt else list(sample.parts)
    for k, part in enumerate(parts[:-1]):
        if isinstance(part, GenerationRequest):
            raise ValueError(f"sample {sample.id!r} parts[{k}]: a GenerationRequest must be last")
    turns = turns_of(parts)
    stream = _Stream()
    open_turn = False
    for n, (role, members) in enumerate(turns):
        if n > 0:
            stream.text(newline, Owner.PROMPT)
        stream.text([sp.im_start, *_encode(tokenizer, role), *newline], Owner.PROMPT)
        owner = Owner.POLICY if role == "assistant" else Owner.PROMPT
        for k, part in members:
            where = f"sample {sample.id!r} parts[{k}]"
            if isinstance(part, TextPart):
                ids = _encode(tokenizer, part.text)
                if specials.intersection(ids):
                    raise ValueError(f"{where}: text contains a special token")
                stream.text(ids, owner)
            elif isinstance(part, GenerationRequest):
                if role != "assistant":
                    raise ValueError(f"{where}: a GenerationRequest must have role 'assistant'")
                prefix = image_generation_prefix(part.height, part.width, tokenizer)
                stream.text(prefix, Owner.PROMPT)
                open_turn = True
            else:
                codes = _image_codes(part, encode_image, where)
                if role == "assistant":
                    h, w = int(codes.shape[0]), int(codes.shape[1])
                    stream.text(image_generation_prefix(h, w, tokenizer), owner)
                else:
                    stream.text([sp.vision_start], owner)
                stream.image(codes, sp.image_pad, owner)
                stream.text([sp.vision_end], Owner.CONTROLLER if role == "assistant" else owner)
        if not open_turn:
            stream.text([sp.im_end], owner)
    if add_generation_prompt and not open_turn:
        if turns:
            stream.text(newline, Owner.PROMPT)
        stream.text([sp.im_start, *_encode(tokenizer, "assistant"), *newline], Owner.PROMPT)
    traj = Trajectory(
        token_ids=torch.tensor(stream.ids, dtype=torch.long),
        modality=torch.tensor(stream.modality, dtype=torch.long),
        owner=torch.tensor(stream.owner, dtype=torch.long),
        visual_codes=stream.visual_codes(bits, f"sample {sample.id!r}"),
        image_grids=stream.grids,
        sample_id=sample.id,
    )
    return traj.validate()


class _Reader:
    """A cursor over a trajectory for `parse`."""

    def __init__(self, traj: Trajectory, tokenizer: PreTrainedTokenizerBase) -> None:
        self.traj = traj
        self.tok = tokenizer
        self.ids = traj.token_ids.tolist()
        self.visual = (traj.modality == Modality.VISUAL).tolist()
        self.sp = SpecialIds.from_tokenizer(tokenizer)
        self.newline = _encode(tokenizer, NEWLINE)
        self.t = 0
        self.image = 0

    def fail(self, what: str) -> NoReturn:
        raise ValueError(f"parse {self.traj.sample_id!r} at position {self.t}: {what}")

    def done(self) -> bool:
        return self.t >= len(self.ids)

    def take(self, seq: Sequence[int]) -> bool:
        if self.ids[self.t : self.t + len(seq)] == list(seq):
            self.t += len(seq)
            return True
        return False

    def role(self) -> Role:
        if not self.take([self.sp.im_start]):
            self.fail("expected <|im_start|>")
        for role in sorted(get_args(Role)):
            if self.take([*_encode(self.tok, role), *self.newline]):
                return role
        self.fail(f"expected a role ({', '.join(sorted(ROLES))}) and a newline")

    def text(self, ids: list[int], role: Role) -> list[Part]:
        if not ids:
            return []
        return [TextPart(str(self.tok.decode(ids, skip_special_tokens=False)), role)]

    def codes(self, h: int, w: int) -> torch.Tensor:
        n = h * w
        if self.t + n > len(self.ids) or not all(self.visual[self.t : self.t + n]):
            self.fail(f"image {self.image} needs {n} visual positions")
        codes = self.traj.visual_codes[self.t : self.t + n].clone()
        self.t += n
        if not self.take([self.sp.vision_end]):
            self.fail("expected <|vision_end|> after the visual positions")
        grids = self.traj.image_grids
        if self.image >= len(grids) or tuple(grids[self.image]) != (h, w):
            self.fail(f"image {self.image} is {h}x{w} but image_grids says {grids}")
        self.image += 1
        return codes.reshape(h, w, *codes.shape[1:])

    def header(self) -> tuple[int, int]:
        start = self.t
        while not self.done() and self.ids[self.t] != self.sp.vision_start:
            self.t += 1
        grid = parse_image_header(self.ids[start - 1 : self.t], self.tok)
        if grid is None or not self.take([self.sp.vision_start]):
            self.fail("expected 'generate image H W' then <|vision_start|> after <image_gen>")
        return grid

    def content(self, role: Role) -> list[Part]:
        parts: list[Part] = []
        text: list[int] = []
        while not self.done() and self.ids[self.t] != self.sp.im_end:
            tok = self.ids[self.t]
            if self.visual[self.t]:
                self.fail("a visual position outside an image")
            if tok == self.sp.image_gen:
                parts += self.text(text, role)
                text = []
                self.t += 1
                h, w = self.header()
                if self.done():
                    parts.append(GenerationRequest(h, w, role))
                    return parts
                parts.append(ImagePart(codes=self.codes(h, w), role=role))
            elif tok == self.sp.vision_start:
                parts += self.text(text, role)
                text = []
                self.t += 1
                grids = self.traj.image_grids
                if self.image >= len(grids):
                    self.fail(f"image {self.image} has no entry in image_grids")
                h, w = grids[self.image]
                parts.append(ImagePart(codes=self.codes(h, w), role=role))
            elif tok in (self.sp.im_start, self.sp.vision_end):
                self.fail("unexpected special token inside a turn")
            else:
                text.append(tok)
                self.t += 1
        parts += self.text(text, role)
        self.take([self.sp.im_end])
        return parts


def parse(trajectory: Trajectory, tokenizer: PreTrainedTokenizerBase) -> list[Part]:
    """The parts of a serialised (or generated) trajectory, with their roles.

    Inverse of `serialize` up to text normalisation: a text comes back as
    `normalize_text(text)`, and adjacent text parts of one turn come back as one part.
    Images come back as `ImagePart(codes=...)` with exact codes (VQ long [H, W] or BSQ
    float [H, W, L]); a stream ending right after a generation header gives a
    `GenerationRequest`; a turn left open (no `<|im_end|>` yet) ends the stream. Any
    other deviation from the layout raises ValueError naming the position.
    """
    r = _Reader(trajectory, tokenizer)
    parts: list[Part] = []
    while not r.done():
        if r.t > 0:
            if not r.take(r.newline):
                r.fail("expected a newline between turns")
        parts += r.content(r.role())
    if r.image != len(trajectory.image_grids):
        r.fail(f"found {r.image} images but image_grids lists {len(trajectory.image_grids)}")
    return parts


def response_parts(parts: Sequence[Part]) -> list[Part]:
    """The trailing run of assistant-role parts (the final assistant turn)."""
    k = len(parts)
    while k > 0 and parts[k - 1].role == "assistant":
        k -= 1
    return list(parts[k:])


def parse_response(trajectory: Trajectory, tokenizer: PreTrainedTokenizerBase) -> list[Part] | None:
    """The response parts of a rollout trajectory, or None when it does not parse (e.g. a
    row truncated inside an image, or a malformed header)."""
    try:
        return response_parts(parse(trajectory, tokenizer))
    except ValueError:
        return None
