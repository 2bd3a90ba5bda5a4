"""Stop conditions of a rollout row (docs/architecture.md §4): the cycle detector and image headers.

A row's `finish_reason` (`uniweave.core.types.FinishReason`) is, in order of precedence:
"eos" (EOS `<|im_end|>` or a stop token), "invalid" (a malformed or out-of-bounds image
header, when so configured), "cycle" (the detector below), "length_exact" / "cap" (the
`max_new_tokens` bound, exact or cap semantics), "context" (the model's context length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from uniweave.data.template import parse_image_header
from uniweave.rollout.params import SamplingParams


def has_cycle(tokens: Sequence[int], max_period: int = 4, repeats: int = 3) -> bool:
    """True if the last `repeats * p` tokens are one block of p tokens repeated `repeats`
    times, for some period 1 <= p <= `max_period` (0 disables the detector).

    Example: [..., 5, 6, 5, 6, 5, 6] has period 2 repeated 3 times.
    """
    n = len(tokens)
    for p in range(1, max_period + 1):
        span = p * repeats
        if span > n:
            break
        block = tokens[n - p :]
        if all(tokens[n - span + k] == block[k % p] for k in range(span - p)):
            return True
    return False


def image_header(
    token_ids: Sequence[int],
    tokenizer: PreTrainedTokenizerBase,
    params: SamplingParams,
    parse: Callable[[Sequence[int]], tuple[int, int] | None] | None = None,
) -> tuple[int, int] | None:
    """(H, W) of the `<image_gen> generate image H W` header ending `token_ids` (or of the
    announcement `parse` reads, e.g. a model's own format), or None when it is malformed
    (`uniweave.data.template.parse_image_header`) or a side lies outside
    [params.min_grid_side, params.max_grid_side]."""
    grid = parse_image_header(token_ids, tokenizer) if parse is None else parse(token_ids)
    if grid is None or not params.grid_allowed(*grid):
        return None
    return grid
