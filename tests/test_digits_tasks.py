from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache

import numpy as np
import pytest

from uniweave.core.sample import ImagePart, TextPart
from uniweave.data.digits import (
    LETTERS,
    NEXT_PROMPT,
    TASKS,
    inverse_permutation,
    make_mixed,
    make_task_samples,
    permute_quadrants,
)
from uniweave.data.digits_images import load_split, split_indices

OPTION_RE = re.compile(r"([A-D])\) ([0-9 ]+?)(?= [A-D]\)|\.)")


@lru_cache(maxsize=1)
def _digits():
    from sklearn.datasets import load_digits

    return load_digits()


TEXT_ONLY = ("mc_lookup",)


def image_of(index: int) -> tuple[np.ndarray, int]:
    """The real image and label at scikit-learn row `index` (independent of the tasks)."""
    bunch = _digits()
    return (bunch.images[index] / 16.0).astype(np.float32), int(bunch.target[index])


def signature(s):
    out = [s.id, s.answer, s.task, repr(s.meta)]
    for p in s.parts:
        out.append((type(p).__name__, p.role, getattr(p, "text", None)))
        if isinstance(p, ImagePart):
            out.append(p.pixels.tobytes())
    return out


@pytest.mark.parametrize("task", TASKS)
def test_ids_determinism_and_prefix_stability(task):
    a = make_task_samples(task, "val", 12, seed=5)
    b = make_task_samples(task, "val", 12, seed=5)
    short = make_task_samples(task, "val", 5, seed=5)
    assert [signature(s) for s in a] == [signature(s) for s in b]
    assert [signature(s) for s in a[:5]] == [signature(s) for s in short]
    assert [s.id for s in a] == [f"{task}-val-{i:05d}" for i in range(12)]
    assert all(s.task == task and isinstance(s.answer, str) for s in a)
    other = make_task_samples(task, "val", 12, seed=6)
    assert [signature(s) for s in other] != [signature(s) for s in a]


@pytest.mark.parametrize("task", TASKS)
def test_images_come_from_their_split(task):
    test_rows = set(split_indices("test").tolist())
    train_rows = set(split_indices("train").tolist())
    samples = make_task_samples(task, "test", 40, seed=0)
    for s in samples:
        assert s.meta["image_index"] in test_rows and s.meta["image_index"] not in train_rows
        original, label = image_of(s.meta["image_index"])
        images = [p for p in s.parts if isinstance(p, ImagePart)]
        if task == "draw_then_answer":  # the shown image, then the drawn one
            assert s.meta["shown_digit"] == label and len(images) == 2
            drawn = s.meta["drawn_index"]
            assert drawn in test_rows and drawn not in train_rows
            # the same float32 division of the same row: the same bits
            np.testing.assert_array_equal(images[1].pixels, image_of(drawn)[0])
            images = images[:1]
        else:
            assert s.meta["digit"] == label
        if task in TEXT_ONLY:  # the split's label picks the digit; no image is shown
            assert images == []
            continue
        assert len(images) == 1 and images[0].pixels.shape == (8, 8)
        if task != "jigsaw_mc":
            np.testing.assert_array_equal(images[0].pixels, original)
    # each sample uses a different image while the split lasts
    assert len({s.meta["image_index"] for s in samples}) == len(samples)


def test_image_stream_cycles_through_the_whole_split():
    n = len(load_split("val"))
    samples = make_task_samples("t2i", "val", n + 3, seed=0)
    assert len({s.meta["image_index"] for s in samples[:n]}) == n


def test_t2i():
    for s in make_task_samples("t2i", "train", 20, seed=1):
        prompt, target = s.parts
        assert isinstance(prompt, TextPart) and prompt.role == "user"
        assert prompt.text == f"draw the digit {s.meta['digit']}"
        assert isinstance(target, ImagePart) and target.role == "assistant"
        assert s.answer == str(s.meta["digit"])


def test_i2t_mc():
    samples = make_task_samples("i2t_mc", "train", 60, seed=2)
    letters = Counter()
    for s in samples:
        image, question, answer = s.parts
        assert image.role == question.role == "user" and answer.role == "assistant"
        assert question.text.startswith("Which digit is shown? A) ")
        assert question.text.endswith(". Answer with the letter only.")
        options = {k: int(v) for k, v in OPTION_RE.findall(question.text)}
        assert list(options) == list(LETTERS)
        assert list(options.values()) == s.meta["options"]
        assert len(set(options.values())) == 4
        assert options[s.answer] == s.meta["digit"] and answer.text == s.answer
        letters[s.answer] += 1
    assert set(letters) == set(LETTERS)  # the true option is shuffled


def test_i2t_mc_say_answers_the_digit_then_its_letter():
    samples = make_task_samples("i2t_mc_say", "train", 60, seed=2)
    letters = Counter()
    for s in samples:
        image, question, answer = s.parts
        assert isinstance(image, ImagePart) and image.role == question.role == "user"
        assert question.text.startswith("Which digit is shown? A) ")
        assert question.text.endswith(". Answer with the digit and the letter.")
        options = {k: int(v) for k, v in OPTION_RE.findall(question.text)}
        assert list(options.values()) == s.meta["options"] and len(set(options.values())) == 4
        digit, letter = answer.text.split(" ")
        assert int(digit) == s.meta["digit"] == options[letter] and answer.text == s.answer
        letters[letter] += 1
    assert set(letters) == set(LETTERS)


def test_mc_lookup_is_text_only_and_names_the_digit():
    samples = make_task_samples("mc_lookup", "train", 60, seed=2)
    for s in samples:
        question, answer = s.parts
        assert question.role == "user" and answer.role == "assistant"
        assert question.text.startswith(f"Which option is {s.meta['digit']}? A) ")
        assert question.text.endswith(". Answer with the letter only.")
        options = {k: int(v) for k, v in OPTION_RE.findall(question.text)}
        assert list(options.values()) == s.meta["options"] and len(set(options.values())) == 4
        assert options[s.answer] == s.meta["digit"] and answer.text == s.answer
    assert {s.answer for s in samples} == set(LETTERS)


def test_i2t_pick_lists_one_to_four_options_under_shuffled_letters():
    samples = make_task_samples("i2t_pick", "train", 80, seed=2)
    counts, letters = Counter(), Counter()
    for s in samples:
        image, question, answer = s.parts
        assert isinstance(image, ImagePart) and question.role == "user"
        assert question.text.startswith("Which digit is shown? ")
        assert question.text.endswith(". Answer with the letter only.")
        pairs = OPTION_RE.findall(question.text)
        labels = "".join(k for k, _ in pairs)
        options = [int(v) for _, v in pairs]
        assert labels == s.meta["labels"] and options == s.meta["options"]
        assert len(set(labels)) == len(labels) and len(set(options)) == len(options)
        assert dict(pairs)[s.answer] == str(s.meta["digit"]) and answer.text == s.answer
        counts[len(pairs)] += 1
        letters[s.answer] += 1
    assert set(counts) == {1, 2, 3, 4} and set(letters) == set(LETTERS)


def test_i2t_mc_first_puts_the_options_before_the_image():
    for s in make_task_samples("i2t_mc_first", "train", 40, seed=2):
        options_part, image, question, answer = s.parts
        assert isinstance(image, ImagePart) and options_part.role == question.role == "user"
        assert question.text == "Which digit is shown? Answer with the letter only."
        options = {k: int(v) for k, v in OPTION_RE.findall(options_part.text)}
        assert list(options) == list(LETTERS) and list(options.values()) == s.meta["options"]
        assert options[s.answer] == s.meta["digit"] and answer.text == s.answer


def test_i2t_open():
    samples = make_task_samples("i2t_open", "train", 30, seed=2)
    for s in samples:
        image, question, answer = s.parts
        assert isinstance(image, ImagePart) and image.role == "user"
        assert question.text == "Which digit is shown? Answer with the digit only."
        assert answer.role == "assistant" and answer.text == s.answer == str(s.meta["digit"])
    assert len({s.answer for s in samples}) > 5


def test_i2t_hint_names_the_digit_seventy_percent_of_the_time():
    from uniweave.data.tokenizer import build_tokenizer

    tok = build_tokenizer()
    n = 2000
    samples = make_task_samples("i2t_hint", "train", n, seed=3)
    for s in samples:
        image, question, answer = s.parts
        assert isinstance(image, ImagePart) and image.role == "user"
        hint = int(
            re.fullmatch(
                r"The digit is (\d)\. Which digit is shown\? Answer with the "
                r"digit only\.",
                question.text,
            ).group(1)
        )
        assert hint == s.meta["hint"] and s.meta["hint_correct"] == (hint == s.meta["digit"])
        assert answer.text == s.answer == str(s.meta["digit"])
    assert tok.unk_token_id not in tok(samples[0].parts[1].text)["input_ids"]
    share = np.mean([s.meta["hint_correct"] for s in samples])
    # Binomial(2000, 0.7): SE = sqrt(0.7 * 0.3 / 2000) = 0.0102; 4 SE = 0.041.
    assert abs(share - 0.7) < 0.041
    wrong = [s.meta["hint"] for s in samples if not s.meta["hint_correct"]]
    assert len(set(wrong)) == 10  # the wrong hint is drawn over the other digits


def test_i2t_hint_wrong_never_names_the_digit():
    samples = make_task_samples("i2t_hint_wrong", "test", 300, seed=0)
    assert not any(s.meta["hint_correct"] or s.meta["hint"] == s.meta["digit"] for s in samples)
    assert {s.parts[1].text[:13] for s in samples} == {"The digit is "[:13]}


def test_permute_quadrants_against_explicit_blocks():
    image = np.zeros((8, 8), dtype=np.float32)
    for q, (r, c) in enumerate([(0, 0), (0, 4), (4, 0), (4, 4)]):
        image[r : r + 4, c : c + 4] = q
    out = permute_quadrants(image, (2, 0, 3, 1))
    assert out[0, 0] == 2 and out[0, 4] == 0 and out[4, 0] == 3 and out[4, 4] == 1
    assert inverse_permutation((2, 0, 3, 1)) == (1, 3, 0, 2)
    np.testing.assert_array_equal(permute_quadrants(out, (1, 3, 0, 2)), image)
    with pytest.raises(ValueError):
        permute_quadrants(image, (0, 0, 1, 2))


def test_jigsaw_mc():
    samples = make_task_samples("jigsaw_mc", "val", 200, seed=3)
    letters = Counter()
    for s in samples:
        image, question, answer = s.parts
        original, _ = image_of(s.meta["image_index"])
        perm, solution = s.meta["permutation"], s.meta["solution"]
        assert perm != [0, 1, 2, 3] and inverse_permutation(perm) == tuple(solution)
        # quadrants are moved, not recomputed: exact comparisons
        assert not np.array_equal(image.pixels, original)
        np.testing.assert_array_equal(image.pixels, permute_quadrants(original, perm))
        options = {k: [int(x) for x in v.split()] for k, v in OPTION_RE.findall(question.text)}
        assert list(options) == list(LETTERS)
        assert list(options.values()) == s.meta["options"]
        # canonical order: option k puts shown quadrant k at the top left; never the identity
        assert [o[0] for o in options.values()] == [0, 1, 2, 3]
        assert all(sorted(o) == [0, 1, 2, 3] and o != [0, 1, 2, 3] for o in options.values())
        restoring = [
            k
            for k, o in options.items()
            if np.array_equal(permute_quadrants(image.pixels, o), original)
        ]
        assert restoring == [s.answer] and options[s.answer] == solution
        assert s.answer == LETTERS[solution[0]]  # the shown quadrant that goes top left
        assert answer.text == s.answer and answer.role == "assistant"
        letters[s.answer] += 1
    # solution[0] is drawn uniformly: each letter near 200 / 4 = 50 (binomial sd 6.1)
    assert set(letters) == set(LETTERS) and min(letters.values()) >= 30


def test_draw_then_answer():
    shown = Counter()
    for s in make_task_samples("draw_then_answer", "train", 60, seed=4):
        image, prompt, lead, drawn, final = s.parts
        assert isinstance(image, ImagePart) and image.role == "user"
        assert prompt.text == NEXT_PROMPT and prompt.role == "user"
        assert isinstance(lead, TextPart) and isinstance(drawn, ImagePart)
        assert [lead.role, drawn.role, final.role] == ["assistant"] * 3
        d = s.meta["shown_digit"]
        assert image_of(s.meta["image_index"])[1] == d
        assert s.meta["digit"] == (d + 1) % 10 == int(s.answer) and final.text == s.answer
        assert image_of(s.meta["drawn_index"])[1] == s.meta["digit"]
        shown[d] += 1
    assert set(shown) == set(range(10))


def test_make_mixed():
    mixed = make_mixed(list(TASKS), "test", 6, seed=7)
    assert Counter(s.task for s in mixed) == {t: 6 for t in TASKS}
    assert len({s.id for s in mixed}) == len(mixed)
    assert [signature(s) for s in mixed] == [
        signature(s) for s in make_mixed(list(TASKS), "test", 6, seed=7)
    ]
    assert [s.task for s in mixed] != sorted(s.task for s in mixed)  # interleaved
    by_id = {s.id: s for s in make_task_samples("i2t_mc", "test", 6, seed=7)}
    for s in mixed:
        if s.task == "i2t_mc":
            assert signature(s) == signature(by_id[s.id])


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown digits task 'nope'"):
        make_task_samples("nope", "train", 1)
    with pytest.raises(ValueError, match="unknown digits split"):
        make_task_samples("t2i", "dev", 1)
    with pytest.raises(ValueError, match="seed"):
        make_task_samples("t2i", "train", 1, seed=-1)
    with pytest.raises(ValueError, match="repeats"):
        make_mixed(["t2i", "t2i"], "train", 1)
