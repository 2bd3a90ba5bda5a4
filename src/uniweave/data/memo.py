"""Reuse of deterministic encodings while many rows are serialised.

Building a data set serialises thousands of samples that repeat the same texts (roles,
prompt templates, options) and the same images. Inside `with memoized_encodings():`,
`memoized(key, compute)` computes each distinct key once and returns that value again
for every later use, so e.g. `uniweave.data.template.serialize` tokenises a text and encodes
an image once per tokenizer / image encoder. The values are those a fresh computation
gives, because tokenizers and codecs are deterministic; they must not change (no tokens
added, no codec refitted) inside the block. Outside any block `memoized` just computes.
Callers treat the returned values as read-only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")
_MEMO: ContextVar[dict[Hashable, Any] | None] = ContextVar("uniweave_encoding_memo", default=None)


@contextmanager
def memoized_encodings() -> Iterator[None]:
    """A block in which `memoized` values are kept (nested blocks share the outer one)."""
    if _MEMO.get() is not None:
        yield
        return
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def memoized(key: Hashable, compute: Callable[[], T]) -> T:
    """`compute()`, reused for an equal `key` inside a `memoized_encodings` block."""
    memo = _MEMO.get()
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]
