"""The four embedded digits tasks, built on the real 8x8 scans of `digits_images`.

Every task draws its images from one split only (`load_split`), so no image crosses
splits. Sample `i` of (task, split, seed) is a pure function of those four values: its
image is entry `i` of a stream of permutations of the split's images (seeded by
(seed, task, split)), and its other random choices come from a generator seeded by
(seed, task, split, i). A longer request therefore extends a shorter one unchanged, and
ids are stable: f"{task}-{split}-{i:05d}".

Tasks (parts are user prompt parts followed by assistant target parts):

- `t2i`: "draw the digit 7" -> ImagePart (the real image). answer "7".
- `i2t_mc`: ImagePart + "Which digit is shown? A) 3 B) 7 C) 1 D) 9. Answer with the letter
  only." -> "B". Options: the true digit and three distinct distractors, shuffled.
- `jigsaw_mc`: the image cut into four 4x4 quadrants numbered 0 top left, 1 top right,
  2 bottom left, 3 bottom right, shown with its quadrants permuted: the shown image's
  quadrant at position p is the original's quadrant `permutation[p]` (the shown image
  always differs from the original). Each option "A) 2 0 3 1" lists, for positions
  0 1 2 3, which quadrant of the shown image to put there; the correct option is
  `solution`, the inverse of `permutation`, because
  `permute_quadrants(permute_quadrants(x, permutation), solution) == x`. -> the letter.
  The options are in a canonical order: option k (letter "ABCD"[k]) puts shown quadrant
  k at the top left, so the four options differ in the piece they put there, and the
  three distractors (the rest of each a uniform random permutation, never the identity)
  do not restore the image. Finding the shown quadrant that belongs at the top left (its
  ink leans towards the image centre, down and right) therefore names the letter, with no
  lookup of a shuffled letter. solution[0] (the answer's index) is uniform over 0..3 and
  the rest of `solution` is uniform given it, so the answer letter is uniform and, as the
  distractors' tails are drawn the same way, the text alone says nothing about it:
  chance and the text-only optimum are both 0.25.
- `i2t_mc_say` (a helper for i2t_mc): ImagePart + "Which digit is shown? A) 3 B) 7 C) 1
  D) 9. Answer with the digit and the letter." -> "7 B" (same options as i2t_mc). It trains
  the option lookup from the digit the model has just said (a one-hop match of the
  current token against the option digits) next to recognition.
- `mc_lookup` (text only, a helper for i2t_mc): "Which option is 7? A) 3 B) 7 C) 1 D) 9.
  Answer with the letter only." -> "B". It trains the letter lookup that i2t_mc composes
  with recognition, on rows a fraction of an image row's length.
- `i2t_pick` (a helper for i2t_mc): i2t_mc's prompt with 1-4 options under distinct
  letters in random order, e.g. "Which digit is shown? C) 7 A) 2. Answer with the letter
  only." -> "C". One option copies its letter (no image needed), two halve the search:
  easier steps towards i2t_mc's lookup. meta "labels" holds the letters in option order.
- `i2t_mc_first` (i2t_mc with the options before the image): "A) 3 B) 7 C) 1 D) 9." +
  ImagePart + "Which digit is shown? Answer with the letter only." -> "B"; the text after
  the image is as short as i2t_open's, so the answer position sees the image as closely.
- `i2t_hint` (a task with a strong text prior, for Information Gain / Necessity studies):
  ImagePart + "The digit is 7. Which digit is shown? Answer with the digit only." -> the
  shown digit. The hint names the shown digit with probability `HINT_CORRECT` (0.7) and
  otherwise a uniformly drawn other digit, so a model can score 0.7 without looking at
  the image. meta "hint" (the hinted digit) and "hint_correct".
- `i2t_hint_wrong` (evaluation of i2t_hint models): the same prompt with the hint always
  wrong (a uniformly drawn other digit), so only the image names the answer; a model that
  follows the hint scores 0. Train on `i2t_hint`, evaluate this task with `uniweave eval
  ... data.tasks=[i2t_hint_wrong]`. Its words are all in the digits vocabulary already.
- `draw_then_answer`: ImagePart (a digit d) + "Draw the digit that comes after this one
  (9 is followed by 0), then state it." -> "The next digit is drawn below." + ImagePart (a
  real image of (d + 1) mod 10 from the same split) + "(d + 1) mod 10". Every stage is one
  the tiny model learns (recognise, draw, read back); meta "digit" is the drawn digit.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator, Sequence

import numpy as np

from uniweave.config.schema import DIGITS_TASKS
from uniweave.core.sample import ImagePart, Sample, TextPart
from uniweave.data.digits_images import SPLITS, DigitImages, Split, load_split

TASKS: tuple[str, ...] = DIGITS_TASKS  # the config layer validates `data.tasks` against it
LETTERS = "ABCD"
QUADRANT = 4

T2I_PROMPT = "draw the digit {digit}"
I2T_PROMPT = "Which digit is shown? {options}. Answer with the letter only."
JIGSAW_PROMPT = (
    "The quadrants of this digit are shuffled. Each option lists which shown quadrant "
    "(0 top left, 1 top right, 2 bottom left, 3 bottom right) goes to positions 0 1 2 3; "
    "option A puts quadrant 0 at the top left, B 1, C 2, D 3. Which option restores the "
    "digit? {options}. Answer with the letter only."
)
LOOKUP_PROMPT = "Which option is {digit}? {options}. Answer with the letter only."
I2T_OPEN_PROMPT = "Which digit is shown? Answer with the digit only."
I2T_FIRST_PROMPT = "Which digit is shown? Answer with the letter only."
HINT_PROMPT = "The digit is {hint}. " + I2T_OPEN_PROMPT
HINT_CORRECT = 0.7
I2T_SAY_PROMPT = "Which digit is shown? {options}. Answer with the digit and the letter."
NEXT_PROMPT = "Draw the digit that comes after this one (9 is followed by 0), then state it."
NEXT_RESPONSE = "The next digit is drawn below."

_PERMUTATIONS: tuple[tuple[int, ...], ...] = tuple(itertools.permutations(range(4)))
_JIGSAW_TRIES = 64  # redraws for an image with identical quadrants (module docstring)


def permute_quadrants(image: np.ndarray, perm: Sequence[int]) -> np.ndarray:
    """out's quadrant at position p = image's quadrant perm[p] (positions row-major 0..3)."""
    q = QUADRANT
    if image.shape[:2] != (2 * q, 2 * q):
        raise ValueError(f"permute_quadrants expects an 8x8 image, got {image.shape}")
    if sorted(perm) != [0, 1, 2, 3]:
        raise ValueError(f"perm must be a permutation of 0..3, got {list(perm)}")
    blocks = [
        image[(k // 2) * q : (k // 2 + 1) * q, (k % 2) * q : (k % 2 + 1) * q] for k in range(4)
    ]
    out = np.empty_like(image)
    for p, src in enumerate(perm):
        out[(p // 2) * q : (p // 2 + 1) * q, (p % 2) * q : (p % 2 + 1) * q] = blocks[src]
    return out


def inverse_permutation(perm: Sequence[int]) -> tuple[int, ...]:
    """inv with inv[perm[p]] = p."""
    inv = [0] * len(perm)
    for p, v in enumerate(perm):
        inv[v] = p
    return tuple(inv)


def format_options(options: Sequence[object]) -> str:
    """ "A) x B) y C) z D) w"; a sequence option is written space-separated."""
    texts = [" ".join(map(str, o)) if isinstance(o, (tuple, list)) else str(o) for o in options]
    return " ".join(f"{LETTERS[k]}) {t}" for k, t in enumerate(texts))


def _stable_code(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def _image_stream(n_images: int, seed: int, task: str, split: Split) -> Iterator[int]:
    rng = np.random.default_rng([seed, _stable_code(task), SPLITS.index(split)])
    while True:
        yield from rng.permutation(n_images).tolist()


def _t2i(
    rng: np.random.Generator, image: np.ndarray, digit: int, data: DigitImages
) -> tuple[list, str, dict]:
    parts = [
        TextPart(T2I_PROMPT.format(digit=digit), "user"),
        ImagePart(pixels=image, role="assistant"),
    ]
    return parts, str(digit), {}


def _digit_options(rng: np.random.Generator, digit: int) -> tuple[list[int], str]:
    """Four digit options (`digit` and three distinct distractors, shuffled) and the
    letter of `digit` among them."""
    others = [d for d in range(10) if d != digit]
    options = [digit] + [int(d) for d in rng.choice(others, size=3, replace=False)]
    options = [options[k] for k in rng.permutation(4)]
    return options, LETTERS[options.index(digit)]


def _i2t_mc(
    rng: np.random.Generator, image: np.ndarray, digit: int, data: DigitImages
) -> tuple[list, str, dict]:
    options, letter = _digit_options(rng, digit)
    parts = [
        ImagePart(pixels=image, role="user"),
        TextPart(I2T_PROMPT.format(options=format_options(options)), "user"),
        TextPart(letter, "assistant"),
    ]
    return parts, letter, {"options": options}


def _mc_lookup(
    rng: np.random.Generator, image: np.ndarray, digit: int, data: DigitImages
) -> tuple[list, str, dict]:
    options, letter = _digit_options(rng, digit)
    prompt = LOOKUP_PROMPT.format(digit=digit, options=format_options(options))
    return [TextPart(prompt, "user"), TextPart(letter, "assistant")], letter, {"options": options}


def _i2t_pick(
    rng: np.random.Generator, image: np.ndarray, digit: int, data: DigitImages
) -> tuple[list, str, dict]:
    n = int(rng.integers(1, 5))
    others = [d for d in range(10) if d != digit]
    options = [digit] + [int(d) for d in rng.choice(others, size=n - 1, replace=False)]
    options = [options[k] for k in rng.permutation(n)]
    labels = "".join(LETTERS[k] for k in rng.permutation(4)[:n])
    letter = labels[options.index(digit)]
    listed = " ".join(f"{a}) {d}" for a, d in zip(labels, options))
    parts = [
        ImagePart(pixels=image, role="user"),
        TextPart(I2T_PROMPT.format(options=listed), "user"),
        TextPart(letter, "assistant"),
    ]
    return parts, letter, {"options": options, "labels": labels}


def _i2t_mc_first(
    rng: np.random.Generator, image: np.ndarray, digit: int, data: DigitImages
) -> tuple[list, str, dict]:
    options, letter = _digit_options(rng, digit)
    parts = [
        TextPart(f"{format_options(options)}.", "user"),
        ImagePart(pixels=image, role="user"),
        TextPart(I2T_FIRST_PROMPT, "user"),
        TextPart(letter, "assistant"),
    ]
    return parts, letter, {"options": options}


def _i2t_open(
    rng: np.random.Generator, image: np.ndarray, digit: int, data: DigitImages
) -> tuple[list, str, dict]:
    parts = [
        ImagePart(pixels=image, role="user"),
        TextPart(I2T_OPEN_PROMPT, "user"),
        TextPart(str(digit), "assistant"),
    ]
    return parts, str(digit), {}


def _hinted(image: np.ndarray, digit: int, hint: int) -> tuple[list, str, dict]:
    parts = [
        ImagePart(pixels=image, role="user"),
        TextPart(HINT_PROMPT.format(hint=hint), "user"),
        TextPart(str(digit), "assistant"),
    ]
    return parts, str(digit), {"hint": hint, "hint_correct": hint == digit}


def _other_digit(rng: np.random.Generator, digit: int) -> int:
    return int(rng.choice([d for d in range(10) if d != digit]))


def _i2t_hint(
    rng: np.random.Generator, image: np.ndarray, digit: int, data: DigitImages
) -> tuple[list, str, dict]:
    correct = bool(rng.random() < HINT_CORRECT)
    return _hinted(image, digit, digit if correct else _other_digit(rng, digit))


def _i2t_hint_wrong(
    rng: np.random.Generator, image: np.ndarray, digit: int, data: DigitImages
) -> tuple[list, str, dict]:
    return _hinted(image, digit, _other_digit(rng, digit))


def _i2t_mc_say(
    rng: np.random.Generator, image: np.ndarray, digit: int, data: DigitImages
) -> tuple[list, str, dict]:
    options, letter = _digit_options(rng, digit)
    answer = f"{digit} {letter}"
    parts = [
        ImagePart(pixels=image, role="user"),
        TextPart(I2T_SAY_PROMPT.format(options=format_options(options)), "user"),
        TextPart(answer, "assistant"),
    ]
    return parts, answer, {"options": options}


def _restores(shown: np.ndarray, perm: Sequence[int], image: np.ndarray) -> bool:
    return bool(np.array_equal(permute_quadrants(shown, perm), image))


def _jigsaw_draw(
    rng: np.random.Generator, image: np.ndarray
) -> tuple[tuple[int, ...], np.ndarray, list[tuple[int, ...]]] | None:
    """One draw of (solution, shown image, options) for `image` (module docstring), or None when the
    drawn solution leaves the image unchanged or some letter has no non-restoring
    distractor (possible only with identical quadrants)."""
    top_left = int(rng.integers(4))
    heads = [p for p in _PERMUTATIONS if p[0] == top_left and p != _PERMUTATIONS[0]]
    solution = heads[int(rng.integers(len(heads)))]
    shown = permute_quadrants(image, inverse_permutation(solution))
    if np.array_equal(shown, image):
        return None
    options = []
    for k in range(4):
        if k == top_left:
            options.append(solution)
            continue
        tails = [
            p
            for p in _PERMUTATIONS
            if p[0] == k and p != _PERMUTATIONS[0] and not _restores(shown, p, image)
        ]
        if not tails:
            return None
        options.append(tails[int(rng.integers(len(tails)))])
    return solution, shown, options


def _jigsaw_mc(
    rng: np.random.Generator, image: np.ndarray, digit: int, data: DigitImages
) -> tuple[list, str, dict]:
    drawn = None
    for _ in range(_JIGSAW_TRIES):
        drawn = _jigsaw_draw(rng, image)
        if drawn is not None:
            break
    if drawn is None:
        raise ValueError(f"no jigsaw question for a {digit} image in {_JIGSAW_TRIES} draws")
    solution, shown, options = drawn
    permutation = inverse_permutation(solution)
    letter = LETTERS[solution[0]]
    parts = [
        ImagePart(pixels=shown, role="user"),
        TextPart(JIGSAW_PROMPT.format(options=format_options(options)), "user"),
        TextPart(letter, "assistant"),
    ]
    meta = {
        "permutation": list(permutation),
        "solution": list(solution),
        "options": [list(o) for o in options],
    }
    return parts, letter, meta


def _draw_then_answer(
    rng: np.random.Generator, image: np.ndarray, digit: int, data: DigitImages
) -> tuple[list, str, dict]:
    nxt = (digit + 1) % 10
    candidates = np.flatnonzero(data.labels == nxt)
    k = int(candidates[int(rng.integers(len(candidates)))])
    parts = [
        ImagePart(pixels=image, role="user"),
        TextPart(NEXT_PROMPT, "user"),
        TextPart(NEXT_RESPONSE, "assistant"),
        ImagePart(pixels=data.images[k].copy(), role="assistant"),
        TextPart(str(nxt), "assistant"),
    ]
    meta = {"digit": nxt, "shown_digit": digit, "drawn_index": int(data.indices[k])}
    return parts, str(nxt), meta


_BUILDERS = {
    "t2i": _t2i,
    "i2t_mc": _i2t_mc,
    "jigsaw_mc": _jigsaw_mc,
    "draw_then_answer": _draw_then_answer,
    "i2t_open": _i2t_open,
    "i2t_mc_say": _i2t_mc_say,
    "mc_lookup": _mc_lookup,
    "i2t_pick": _i2t_pick,
    "i2t_mc_first": _i2t_mc_first,
    "i2t_hint": _i2t_hint,
    "i2t_hint_wrong": _i2t_hint_wrong,
}


def _check_args(task: str, split: str, n: int, seed: int) -> None:
    if task not in _BUILDERS:
        raise ValueError(f"unknown digits task {task!r}; expected one of {', '.join(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown digits split {split!r}; expected one of {', '.join(SPLITS)}")
    for name, v in (("n", n), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")


def make_task_samples(task: str, split: Split, n: int, seed: int = 0) -> list[Sample]:
    """`n` samples of `task` on `split` (deterministic in (task, split, seed, index)).

    meta holds "digit" (the label of the image used), "image_index" (its row in
    scikit-learn's dataset) and the task's own fields: i2t_mc "options" (digits in
    option order); jigsaw_mc "permutation", "solution", "options" (see the module
    docstring); draw_then_answer "digit" (the drawn digit), "shown_digit" (the label of
    the shown image, row "image_index") and "drawn_index" (the target image's row).
    """
    _check_args(task, split, n, seed)
    data: DigitImages = load_split(split)
    stream = _image_stream(len(data), seed, task, split)
    samples = []
    for i in range(n):
        k = next(stream)
        digit = int(data.labels[k])
        rng = np.random.default_rng([seed, _stable_code(task), SPLITS.index(split), i])
        parts, answer, extra = _BUILDERS[task](rng, data.images[k].copy(), digit, data)
        meta = {"digit": digit, "image_index": int(data.indices[k]), **extra}
        samples.append(
            Sample(id=f"{task}-{split}-{i:05d}", parts=parts, answer=answer, task=task, meta=meta)
        )
    return samples


def make_mixed(tasks: Sequence[str], split: Split, n_per_task: int, seed: int = 0) -> list[Sample]:
    """`n_per_task` samples of each task, shuffled together deterministically by `seed`."""
    if len(tasks) == 0 or len(set(tasks)) != len(tasks):
        raise ValueError(f"tasks must be a non-empty list without repeats, got {list(tasks)}")
    samples = [s for t in tasks for s in make_task_samples(t, split, n_per_task, seed)]
    order = np.random.default_rng([seed, _stable_code("mixed"), SPLITS.index(split)])
    return [samples[k] for k in order.permutation(len(samples))]


def vocabulary_texts() -> list[str]:
    """Every text the tasks can produce, up to the digits and letters filled in."""
    texts = [T2I_PROMPT.format(digit=d) for d in range(10)]
    texts.append(I2T_PROMPT.format(options=format_options([0, 1, 2, 3])))
    texts.append(JIGSAW_PROMPT.format(options=format_options(_PERMUTATIONS[:4])))
    texts += [NEXT_PROMPT, NEXT_RESPONSE]
    texts.append(I2T_OPEN_PROMPT)
    texts.append(HINT_PROMPT.format(hint=0))
    texts.append(I2T_SAY_PROMPT.format(options=format_options([0, 1, 2, 3])))
    texts.append(LOOKUP_PROMPT.format(digit=0, options=format_options([0, 1, 2, 3])))
    texts += list(LETTERS) + [str(d) for d in range(10)]
    return texts
