from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from uniweave.core.sample import GenerationRequest, ImagePart, Sample, TextPart
from uniweave.core.trajectory import TrajectoryBatch
from uniweave.core.types import Modality, Owner
from uniweave.data.digits import TASKS, make_task_samples
from uniweave.data.template import (
    image_generation_prefix,
    parse,
    parse_image_header,
    serialize,
)
from uniweave.data.tokenizer import SpecialIds, build_tokenizer, normalize_text

P, POL, CTL = Owner.PROMPT, Owner.POLICY, Owner.CONTROLLER
GRID = (2, 3)  # non-square, so a swapped H/W would show
CODEBOOK = 512
BITS = 5


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def sp(tok):
    return SpecialIds.from_tokenizer(tok)


def vq_codes(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, CODEBOOK, GRID, generator=g)


def bsq_codes(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (*GRID, BITS), generator=g).float()


def with_codes(sample: Sample, make) -> Sample:
    """The sample with every image replaced by codes only (pixels dropped)."""
    parts = [
        ImagePart(codes=make(), role=p.role) if isinstance(p, ImagePart) else p
        for p in sample.parts
    ]
    return dataclasses.replace(sample, parts=parts)


def ids_of(tok, *tokens: str) -> list[int]:
    return [tok.convert_tokens_to_ids(t) for t in tokens]


def assert_parts_equal(got, expected, tok):
    """Parts equal up to text normalisation (adjacent texts of one role merge)."""
    merged = []
    for p in expected:
        if isinstance(p, TextPart) and merged and isinstance(merged[-1], TextPart):
            if merged[-1].role == p.role:
                merged[-1] = TextPart(merged[-1].text + " " + p.text, p.role)
                continue
        merged.append(p)
    assert len(got) == len(merged)
    for g, e in zip(got, merged):
        assert type(g) is type(e) and g.role == e.role
        if isinstance(e, TextPart):
            assert g.text == normalize_text(e.text, tok)
        elif isinstance(e, ImagePart):
            assert g.codes.dtype == e.codes.dtype
            assert torch.equal(g.codes, e.codes)
        else:
            assert (g.height, g.width) == (e.height, e.width)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("kind", ["vq", "bsq"])
def test_round_trip_all_tasks(tok, task, kind):
    g = torch.Generator().manual_seed(2 * TASKS.index(task) + (kind == "bsq"))
    make = (lambda: vq_codes(g)) if kind == "vq" else (lambda: bsq_codes(g))
    for sample in make_task_samples(task, "val", 4, seed=1):
        coded = with_codes(sample, make)
        traj = serialize(coded, tok, bits=BITS if kind == "bsq" else None)  # text-only: needs L
        n_images = sum(isinstance(p, ImagePart) for p in coded.parts)
        assert traj.image_grids == [GRID] * n_images
        assert traj.is_bits == (kind == "bsq")
        if kind == "bsq":
            assert traj.visual_codes.shape == (len(traj), BITS)
        assert traj.sample_id == sample.id
        assert_parts_equal(parse(traj, tok), coded.parts, tok)


def test_encode_image_is_called_on_pixels(tok):
    calls = []

    def encode_image(pixels: torch.Tensor) -> torch.Tensor:
        assert pixels.shape == (1, 8, 8) and pixels.dtype == torch.float32
        codes = torch.randint(0, 2, (1, *GRID, BITS), generator=torch.Generator().manual_seed(0))
        calls.append((pixels.clone(), codes[0]))
        return codes.float()

    sample = make_task_samples("draw_then_answer", "train", 1)[0]
    traj = serialize(sample, tok, encode_image=encode_image)
    assert len(calls) == 2  # the shown image, then the drawn one
    assert np.array_equal(calls[0][0][0].numpy(), sample.parts[0].pixels)
    (pixels, codes), image = calls[1], sample.parts[3]
    assert np.array_equal(pixels[0].numpy(), image.pixels)
    parsed = parse(traj, tok)
    assert torch.equal(parsed[3].codes, codes.float())
    assert [p.role for p in parsed] == ["user", "user", "assistant", "assistant", "assistant"]
    assert parsed[4].text == sample.answer


def test_t2i_positions_owners_and_codes(tok, sp):
    codes = torch.tensor([[5, 0, 511], [7, 8, 9]])
    sample = Sample("s", [TextPart("draw the digit 7"), ImagePart(codes=codes, role="assistant")])
    traj = serialize(sample, tok)
    expected = (
        ids_of(tok, "<|im_start|>", "user", "\n", "draw", "the", "digit", "7", "<|im_end|>")
        + ids_of(tok, "\n", "<|im_start|>", "assistant", "\n")
        + ids_of(tok, "<image_gen>", "generate", "image", "2", "3", "<|vision_start|>")
        + [sp.image_pad] * 6
        + [sp.vision_end, sp.im_end]
    )
    assert traj.token_ids.tolist() == expected
    assert traj.owner.tolist() == [P] * 12 + [POL] * 6 + [POL] * 6 + [CTL, POL]
    assert traj.modality.tolist() == [Modality.TEXT] * 18 + [Modality.VISUAL] * 6 + [0, 0]
    assert traj.visual_codes.tolist() == [-1] * 18 + [5, 0, 511, 7, 8, 9] + [-1, -1]
    assert traj.image_grids == [(2, 3)]


def test_input_image_is_prompt_and_answer_is_policy(tok, sp):
    bits = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # grid (1, 2), L = 2
    sample = Sample("s", [ImagePart(codes=bits), TextPart("Which?"), TextPart("B", "assistant")])
    traj = serialize(sample, tok)
    expected = (
        ids_of(tok, "<|im_start|>", "user", "\n", "<|vision_start|>")
        + [sp.image_pad] * 2
        + ids_of(tok, "<|vision_end|>", "Which", "?", "<|im_end|>")
        + ids_of(tok, "\n", "<|im_start|>", "assistant", "\n", "B", "<|im_end|>")
    )
    assert traj.token_ids.tolist() == expected
    assert traj.owner.tolist() == [P] * 14 + [POL, POL]
    assert traj.modality.tolist() == [0] * 4 + [1, 1] + [0] * 10
    assert traj.visual_codes[4:6].tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert traj.visual_codes[:4].abs().sum() == 0 and traj.visual_codes[6:].abs().sum() == 0


def test_interleaved_owners(tok, sp):
    codes = torch.zeros(2, 2, dtype=torch.long)
    sample = Sample(
        "s",
        [
            TextPart("What is 3 + 4?"),
            TextPart("The answer is drawn below.", "assistant"),
            ImagePart(codes=codes, role="assistant"),
            TextPart("7", "assistant"),
        ],
    )
    traj = serialize(sample, tok)
    ids, owner = traj.token_ids.tolist(), traj.owner.tolist()
    header = ids.index(sp.im_start, 1)
    assert owner[: header + 3] == [P] * (header + 3)  # up to and including "assistant\n"
    rest = owner[header + 3 :]
    assert rest.count(CTL) == 1 and ids[header + 3 + rest.index(CTL)] == sp.vision_end
    assert all(o == POL for o in rest if o != CTL)
    assert ids[-2:] == ids_of(tok, "7", "<|im_end|>")


@pytest.mark.parametrize("task", TASKS)
def test_generation_prompt_is_a_prefix_of_the_full_stream(tok, task):
    g = torch.Generator().manual_seed(0)
    sample = with_codes(make_task_samples(task, "test", 1)[0], lambda: vq_codes(g))
    full = serialize(sample, tok)
    prompt = serialize(sample, tok, add_generation_prompt=True)
    n = len(prompt)
    assert torch.equal(full.token_ids[:n], prompt.token_ids)
    assert torch.equal(full.visual_codes[:n], prompt.visual_codes)
    assert (prompt.owner == P).all()
    assert prompt.token_ids[-3:].tolist() == ids_of(tok, "<|im_start|>", "assistant", "\n")
    assert (full.owner[n:] != P).all()  # everything after the header is generated


def test_generation_request_forces_the_image_header(tok):
    sample = Sample("s", [TextPart("draw the digit 7"), GenerationRequest(2, 3)])
    prefix = image_generation_prefix(2, 3, tok)
    for add in (False, True):
        traj = serialize(sample, tok, add_generation_prompt=add, bits=BITS)
        assert traj.token_ids[-len(prefix) :].tolist() == prefix
        assert (traj.owner == P).all()
        assert traj.visual_codes.shape == (len(traj), BITS)
        parts = parse(traj, tok)
        assert isinstance(parts[-1], GenerationRequest) and parts[-1].role == "assistant"
        assert (parts[-1].height, parts[-1].width) == (2, 3)
    with pytest.raises(ValueError, match=r"parts\[0\].*must be last"):
        serialize(Sample("s", [GenerationRequest(2, 2), TextPart("x", "assistant")]), tok)


def test_image_header_helpers(tok, sp):
    prefix = image_generation_prefix(12, 3, tok)
    assert prefix[0] == sp.image_gen and prefix[-1] == sp.vision_start
    assert tok.decode(prefix[1:-1]) == "generate image 12 3"
    head = ids_of(tok, "The", "answer") + prefix[:-1]
    assert parse_image_header(head, tok) == (12, 3)
    assert parse_image_header(ids_of(tok, "The", "answer"), tok) is None
    assert parse_image_header(prefix[:-2], tok) is None  # width missing
    assert (
        parse_image_header([sp.image_gen, *ids_of(tok, "generate", "image", "0", "3")], tok) is None
    )


def test_text_stream_matches_tokenizing_the_chat_string(tok):
    sample = Sample(
        "s",
        [
            TextPart("You answer briefly.", "system"),
            TextPart("What is 3 + 4? Draw the answer, then state it."),
            TextPart("7", "assistant"),
        ],
    )
    messages = [{"role": p.role, "content": p.text} for p in sample.parts]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert serialize(sample, tok).token_ids.tolist() == tok.encode(text, add_special_tokens=False)
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    ids = serialize(sample, tok, add_generation_prompt=True).token_ids.tolist()
    assert ids == tok.encode(prompt, add_special_tokens=False)


def test_multi_turn_round_trip(tok):
    g = torch.Generator().manual_seed(3)
    parts = [
        TextPart("system text", "system"),
        ImagePart(codes=vq_codes(g)),
        TextPart("first"),
        TextPart("one", "assistant"),
        TextPart("second"),
        ImagePart(codes=vq_codes(g), role="assistant"),
    ]
    traj = serialize(Sample("m", parts), tok)
    assert_parts_equal(parse(traj, tok), parts, tok)
    assert (traj.owner == CTL).sum() == 1


def test_serialized_trajectories_collate(tok):
    g = torch.Generator().manual_seed(0)
    samples = [with_codes(make_task_samples(t, "val", 1)[0], lambda: bsq_codes(g)) for t in TASKS]
    trajs = [serialize(s, tok, bits=BITS) for s in samples]  # mc_lookup is text-only
    trajs.append(serialize(Sample("text", [TextPart("hi")]), tok, bits=BITS))
    batch = TrajectoryBatch.collate(trajs, pad_id=tok.pad_token_id)
    back = batch.unbatch()
    for a, b in zip(trajs, back):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.visual_codes, b.visual_codes)


def test_serialize_errors(tok):
    pixels_only = make_task_samples("t2i", "val", 1)[0]
    with pytest.raises(ValueError, match=r"t2i-val-00000.*parts\[1\].*encode_image"):
        serialize(pixels_only, tok)
    with pytest.raises(ValueError, match="special token"):
        serialize(Sample("s", [TextPart("hi <|im_end|> there")]), tok)
    mixed = Sample(
        "s",
        [
            ImagePart(codes=torch.zeros(2, 2, dtype=torch.long)),
            ImagePart(codes=torch.zeros(2, 2, 3)),
        ],
    )
    with pytest.raises(ValueError, match="mix VQ and BSQ"):
        serialize(mixed, tok)
    vq = Sample("s", [ImagePart(codes=torch.zeros(2, 2, dtype=torch.long))])
    with pytest.raises(ValueError, match="bits=4"):
        serialize(vq, tok, bits=4)


def test_parse_rejects_malformed_streams(tok, sp):
    codes = torch.arange(6).reshape(2, 3)
    traj = serialize(Sample("s", [TextPart("x"), ImagePart(codes=codes, role="assistant")]), tok)
    end = traj.token_ids.tolist().index(sp.vision_end)
    broken = dataclasses.replace(traj, token_ids=traj.token_ids.clone())
    broken.token_ids[end] = tok.convert_tokens_to_ids("x")
    with pytest.raises(ValueError, match=r"'s' at position \d+: expected <\|vision_end\|>"):
        parse(broken, tok)
    no_sep = dataclasses.replace(traj, token_ids=traj.token_ids.clone())
    no_sep.token_ids[traj.token_ids.tolist().index(sp.im_end) + 1] = tok.convert_tokens_to_ids("x")
    with pytest.raises(ValueError, match="expected a newline between turns"):
        parse(no_sep, tok)
    wrong_grid = dataclasses.replace(traj, image_grids=[(3, 2)])
    with pytest.raises(ValueError, match="image 0 is 2x3"):
        parse(wrong_grid, tok)


def test_memoized_encodings_serialize_the_same_rows_encoding_each_image_once(tok, small_vq_dir):
    from uniweave.codecs import load_codec
    from uniweave.data.memo import memoized_encodings

    codec = load_codec(small_vq_dir)
    images: list[bytes] = []

    def encode_image(pixels: torch.Tensor) -> torch.Tensor:
        images.append(pixels.numpy().tobytes())
        return codec.encode(pixels)

    samples = [s for task in TASKS for s in make_task_samples(task, "train", 12, seed=0)]
    plain = [serialize(s, tok, encode_image=encode_image) for s in samples]
    n_plain = len(images)
    images.clear()
    with memoized_encodings():
        memo = [serialize(s, tok, encode_image=encode_image) for s in samples]
    assert len(images) == len(set(images)) < n_plain  # each distinct image encoded once
    for a, b in zip(plain, memo, strict=True):
        for field in ("token_ids", "modality", "owner", "visual_codes"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (a.sample_id, field)
        assert a.image_grids == b.image_grids and a.sample_id == b.sample_id
