from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from uniweave.core import (
    GenerationRequest,
    ImagePart,
    Sample,
    TextPart,
    group_ids,
    parse_sample_id,
    validate_groups,
)


def _sample() -> Sample:
    return Sample(
        id="prompt-7",
        parts=[
            TextPart("you are helpful", role="system"),
            ImagePart(pixels=np.zeros((8, 8), np.float32)),
            TextPart("which digit?"),
            TextPart("7", role="assistant"),
            GenerationRequest(2, 3),
        ],
        answer="7",
        task="i2t_mc",
        meta={"digit": 7},
    )


def test_prompt_and_response_parts_keep_order():
    s = _sample()
    assert [type(p).__name__ for p in s.prompt_parts] == ["TextPart", "ImagePart", "TextPart"]
    assert s.response_parts == [TextPart("7", role="assistant"), GenerationRequest(2, 3)]
    assert GenerationRequest(2, 3).n_positions == 6


def test_fork_builds_lineage_and_copies_meta():
    s = _sample()
    child = s.fork(3)
    assert child.id == "prompt-7/3"
    assert (child.group_id, child.member) == ("prompt-7", 3)
    assert (s.group_id, s.member) == ("prompt-7", None)
    child.meta["digit"] = 1
    assert s.meta["digit"] == 7
    assert child.parts == s.parts and child.parts is not s.parts
    assert child.fork(1).id == "prompt-7/3/1"
    with pytest.raises(ValueError, match="member"):
        s.fork(-1)
    with pytest.raises(ValueError, match="member"):
        s.fork(True)


@pytest.mark.parametrize(
    "sid, expected",
    [
        ("prompt-7/3", ("prompt-7", 3)),
        ("prompt-7", ("prompt-7", None)),
        ("a/b/12", ("a/b", 12)),
        ("a/b", ("a/b", None)),
        ("a/03", ("a/03", None)),
        ("x/0", ("x", 0)),
    ],
)
def test_parse_sample_id(sid, expected):
    assert parse_sample_id(sid) == expected


def test_parse_rejects_empty():
    with pytest.raises(ValueError):
        parse_sample_id("")


def test_group_ids_one_per_id():
    assert group_ids(["a/0", "a/1", "b/0", "c"]) == ["a", "a", "b", "c"]


def test_validate_groups_good():
    ids = [f"p{g}/{m}" for g in range(3) for m in range(4)]
    assert validate_groups(ids) == (3, 4)
    assert validate_groups(["only/0"]) == (1, 1)


@pytest.mark.parametrize(
    "ids, offender",
    [
        (["a/0", "a/1", "b/0", "b/1", "a/2"], "a/2"),  # non-contiguous
        (["a/0", "b/0", "a/1", "b/1"], "a/1"),  # interleaved
        (["a/0", "a/1", "b/0"], "'b'"),  # last group too small
        (["a/0", "b/0", "b/1", "c/0"], "'b'"),  # non-uniform in the middle
        (["a/0", "a/2"], "a/2"),  # gap in member numbers
        (["a/1", "a/2"], "a/1"),  # does not start at 0
        (["a/1", "a/0"], "a/1"),  # out of order
        (["a/0", "a/0"], "a/0"),  # duplicate
        (["a/0", "b"], "'b'"),  # no member number
    ],
)
def test_validate_groups_bad(ids, offender):
    with pytest.raises(ValueError, match=re.escape(offender)):
        validate_groups(ids)


def test_validate_groups_empty():
    with pytest.raises(ValueError):
        validate_groups([])


def test_part_validation():
    with pytest.raises(ValueError, match="role"):
        TextPart("x", role="bot")
    with pytest.raises(ValueError, match="pixels or codes"):
        ImagePart()
    with pytest.raises(ValueError, match="codes"):
        ImagePart(codes=torch.zeros(2, 2))  # float VQ-shaped codes
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ImagePart(pixels=np.full((8, 8), 2.0, np.float32))
    with pytest.raises(ValueError, match="height"):
        GenerationRequest(0, 3)
    with pytest.raises(ValueError, match="width"):
        GenerationRequest(2, True)
    with pytest.raises(TypeError, match=r"parts\[1\]"):
        Sample(id="s", parts=[TextPart("a"), "not a part"])
    with pytest.raises(ValueError, match="id"):
        Sample(id="", parts=[])


def test_image_part_grids():
    vq = ImagePart(codes=torch.zeros(2, 3, dtype=torch.long))
    bsq = ImagePart(codes=torch.zeros(2, 3, 5), role="assistant")
    assert vq.grid == (2, 3) and bsq.grid == (2, 3)
    assert ImagePart(pixels=np.zeros((8, 8, 3), np.float32)).grid is None
