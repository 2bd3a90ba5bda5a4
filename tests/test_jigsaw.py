"""Visual Jigsaw: `uniweave data jigsaw` rows from a folder of images, and the
`visual_jigsaw` reward plugin against an independent implementation.

The generator is checked by reassembling each shown image with the row's answer (a
reassembly written here, with its own slicing) and comparing it with the cropped
original; the reward by hand-built orders scored by `reference_reward` below.
"""

from __future__ import annotations

import json
from itertools import permutations

import numpy as np
import pytest
from PIL import Image

from uniweave.cli import main
from uniweave.config.schema import RewardPluginConfig
from uniweave.core.sample import ImagePart, Sample, TextPart
from uniweave.data.digits_images import load_split
from uniweave.data.loader import load_rows
from uniweave.rewards import Response, build_plugin

GAMMA = 0.2


def reference_reward(text: str, solution: list[int], gamma: float = GAMMA) -> float:
    """Independent scorer: the response is valid when, after dropping one enclosing
    pair of [] or (), replacing commas by spaces, it splits into len(solution) decimal
    numbers using each of 0..n-1 once."""
    n = len(solution)
    body = text.strip()
    for left, right in ("[]", "()"):
        if body.startswith(left) and body.endswith(right):
            body = body[1:-1]
            break
    words = body.replace(",", " ").split()
    if len(words) != n or any(not w.isdecimal() or not w.isascii() for w in words):
        return 0.0
    numbers = list(map(int, words))
    if set(numbers) != set(range(n)):
        return 0.0
    if numbers == solution:
        return 1.0
    return gamma * np.mean(np.array(numbers) == np.array(solution))


def respond(text: str, image: bool = False) -> Response:
    parts = [TextPart(text, "assistant")]
    if image:
        parts.insert(0, ImagePart(pixels=np.zeros((8, 8), np.float32), role="assistant"))
    images = tuple(p.pixels for p in parts if isinstance(p, ImagePart))
    return Response(tuple(parts), images)


def jigsaw_sample(solution: list[int]) -> Sample:
    return Sample(
        id="j",
        parts=[TextPart("q", "user")],
        answer=" ".join(map(str, solution)),
        task="visual_jigsaw",
        meta={"solution": solution},
    )


SOL4 = [2, 0, 3, 1]
SOL9 = [4, 0, 8, 1, 7, 2, 6, 3, 5]
HAND_BUILT = [
    ("2 0 3 1", SOL4),  # exact
    ("  2, 0, 3, 1 ", SOL4),  # commas: exact
    ("[2 0 3 1]", SOL4),  # brackets: exact
    ("2 0 1 3", SOL4),  # positions 0, 1 right
    ("0 1 2 3", SOL4),  # identity: none right
    ("1 3 0 2", SOL4),  # none right
    ("2 1 3 0", SOL4),  # positions 0, 2 right
    ("2 0 3", SOL4),  # too few: invalid
    ("2 0 3 1 1", SOL4),  # too many: invalid
    ("2 0 3 3", SOL4),  # repeated: invalid
    ("2 0 3 4", SOL4),  # out of range: invalid
    ("two 0 3 1", SOL4),  # a word: invalid
    ("-2 0 3 1", SOL4),  # a sign: invalid
    ("", SOL4),  # empty: invalid
    ("2 0 3 1.", SOL4),  # trailing dot: invalid
    ("4 0 8 1 7 2 6 3 5", SOL9),  # 3x3 exact
    ("4 0 8 1 7 2 6 5 3", SOL9),  # 3x3: 7 of 9 right
    ("0 4 8 1 7 2 6 3 5", SOL9),  # 3x3: 7 of 9 right
    ("6 3 8 0 7 1 4 2 5", SOL9),  # 3x3: positions 2, 4, 8 right
]


def test_visual_jigsaw_reward_equals_an_independent_implementation():
    plugin = build_plugin(RewardPluginConfig(name="visual_jigsaw"))
    samples = [jigsaw_sample(sol) for _, sol in HAND_BUILT]
    responses = [respond(text) for text, _ in HAND_BUILT]
    scores = plugin.score(samples, responses)
    expected = [reference_reward(text, sol) for text, sol in HAND_BUILT]
    # both sides compute gamma * k / n from the same integers in float64: equal up to
    # the last bit of one division and one product
    np.testing.assert_allclose(scores, expected, rtol=4 * np.finfo(float).eps, atol=0)
    # the hand-derived values themselves (not only agreement of two implementations)
    assert scores[:7] == [1.0, 1.0, 1.0, GAMMA * 2 / 4, 0.0, 0.0, GAMMA * 2 / 4]
    assert scores[7:15] == [0.0] * 8
    assert scores[15] == 1.0 and scores[18] == pytest.approx(GAMMA * 3 / 9, rel=1e-15)
    assert scores[16] == scores[17] == pytest.approx(GAMMA * 7 / 9, rel=1e-15)
    invalid = plugin.invalid_format(samples, responses)
    assert invalid == [s == 0.0 and t != "0 1 2 3" and t != "1 3 0 2" for (t, _), s in
                       zip(HAND_BUILT, expected)]  # fmt: skip


def test_every_order_of_four_pieces_and_an_image_response():
    """All 24 orders of a 2x2 solution (and a response with an image: invalid)."""
    plugin = build_plugin(RewardPluginConfig(name="visual_jigsaw", kwargs={"gamma": 0.5}))
    orders = [" ".join(map(str, p)) for p in permutations(range(4))]
    samples = [jigsaw_sample(SOL4)] * 25
    responses = [respond(o) for o in orders] + [respond("2 0 3 1", image=True)]
    scores = plugin.score(samples, responses)
    assert scores == pytest.approx([reference_reward(o, SOL4, 0.5) for o in orders] + [0.0])
    assert plugin.invalid_format(samples, responses) == [False] * 24 + [True]


def test_gamma_and_meta_are_checked():
    from uniweave.config import ConfigError

    with pytest.raises(ConfigError, match="gamma"):
        build_plugin(RewardPluginConfig(name="visual_jigsaw", kwargs={"gamma": 1.5}))
    with pytest.raises(ConfigError, match="no option"):
        build_plugin(RewardPluginConfig(name="visual_jigsaw", kwargs={"beta": 1}))
    plugin = build_plugin(RewardPluginConfig(name="visual_jigsaw"))
    bad = Sample(id="x", parts=[TextPart("q", "user")], meta={"solution": [0, 0]})
    with pytest.raises(ValueError, match="solution"):
        plugin.score([bad], [respond("0 1")])


def write_digit_folder(folder, n: int) -> None:
    images = load_split("train").images[:n]
    (folder / "sub").mkdir(parents=True)
    for k, image in enumerate(images):
        where = folder / "sub" if k % 2 else folder
        Image.fromarray(np.round(image * 255).astype(np.uint8)).save(where / f"d{k:03d}.png")


def reassemble(shown: np.ndarray, answer: str, grid: int) -> np.ndarray:
    """Put the shown piece answer[q] at position q (independent slicing)."""
    ph, pw = shown.shape[0] // grid, shown.shape[1] // grid
    out = np.zeros_like(shown)
    for q, p in enumerate(int(t) for t in answer.split()):
        r, c = divmod(p, grid)
        rq, cq = divmod(q, grid)
        out[rq * ph : (rq + 1) * ph, cq * pw : (cq + 1) * pw] = shown[
            r * ph : (r + 1) * ph, c * pw : (c + 1) * pw
        ]
    return out


@pytest.mark.parametrize("grid", [2, 3])
def test_jigsaw_rows_from_an_image_folder(tmp_path, capsys, grid):
    folder = tmp_path / "imgs"
    write_digit_folder(folder, 20)
    colour = np.random.default_rng(0).integers(0, 256, (11, 13, 4), dtype=np.uint8)
    Image.fromarray(colour, mode="RGBA").save(folder / "colour.png")  # odd size, alpha
    (folder / "broken.png").write_bytes(b"not an image")
    Image.fromarray(np.zeros((6, 6), np.uint8)).save(folder / "blank.png")  # equal pieces
    (folder / "notes.txt").write_text("ignored")
    out = tmp_path / "out"
    assert main(["data", "jigsaw", str(folder), str(out), "--grid", str(grid)]) == 0
    # images whose cropped pieces repeat (blank corners of a digit at 3x3, the blank
    # image): counted here with numpy's own view of the pieces
    identical = 0
    for path in sorted(folder.rglob("*.png")):
        if path.name == "broken.png":
            continue
        pixels = np.asarray(Image.open(path).convert("RGB"))
        h, w = pixels.shape[0] // grid, pixels.shape[1] // grid
        top, left = (pixels.shape[0] - h * grid) // 2, (pixels.shape[1] - w * grid) // 2
        blocks = pixels[top : top + h * grid, left : left + w * grid].reshape(grid, h, grid, w, 3)
        flat = blocks.transpose(0, 2, 1, 3, 4).reshape(grid * grid, -1)
        identical += len(np.unique(flat, axis=0)) < grid * grid
    assert identical >= 1
    printed = capsys.readouterr().out
    assert f"skipped: identical_pieces {identical}, unreadable 1" in printed
    rows = [json.loads(line) for line in (out / "jigsaw.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    n = 23 - 1 - identical
    assert summary["images"] == 23 and summary["rows"] == len(rows) == n
    assert sum(summary["splits"].values()) == n and summary["splits"]["test"] == 0
    assert summary["splits"]["val"] == sum(r["split"] == "val" for r in rows) <= 2
    for row in rows:
        assert row["task"] == "visual_jigsaw" and row["meta"]["grid"] == grid
        assert row["answer"] == " ".join(map(str, row["meta"]["solution"]))
        assert row["messages"][1] == {
            "role": "assistant",
            "content": [{"type": "text", "text": row["answer"]}],
        }
        shown = np.asarray(Image.open(out / row["messages"][0]["content"][0]["path"]))
        source = folder / row["meta"]["source"]
        original = np.asarray(Image.open(source).convert("RGB"))
        h, w = original.shape[0] // grid * grid, original.shape[1] // grid * grid
        top, left = (original.shape[0] - h) // 2, (original.shape[1] - w) // 2
        cropped = original[top : top + h, left : left + w]
        assert not np.array_equal(shown, cropped)  # shuffled
        np.testing.assert_array_equal(reassemble(shown, row["answer"], grid), cropped)
    # the rows load with the project's loader, and their own answers score 1
    samples = load_rows(out).samples
    plugin = build_plugin(RewardPluginConfig(name="visual_jigsaw"))
    assert plugin.score(samples, [respond(s.answer) for s in samples]) == [1.0] * n
    # deterministic: the same folder and seed give the same rows
    again = tmp_path / "again"
    assert main(["data", "jigsaw", str(folder), str(again), "--grid", str(grid)]) == 0
    assert (again / "jigsaw.jsonl").read_bytes() == (out / "jigsaw.jsonl").read_bytes()


def test_jigsaw_bad_input_is_exit_2(tmp_path, capsys):
    assert main(["data", "jigsaw", str(tmp_path / "none"), str(tmp_path / "o"), "--grid", "2"]) == 2
    assert "image folder not found" in capsys.readouterr().err
    assert main(["data", "jigsaw", str(tmp_path), str(tmp_path / "o"), "--grid", "4"]) == 2
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    assert (
        main(["data", "jigsaw", str(tmp_path / "empty"), str(tmp_path / "o"), "--grid", "2"]) == 2
    )
    assert "no image files" in capsys.readouterr().err
