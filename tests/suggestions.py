"""The changes a message proposes, parsed as a user reads them (tests/test_suggested_fixes.py,
tests/test_bad_inputs.py): `set KEY=VALUE [KEY=VALUE ...]` (one change of one or more
overrides) and `pass --FLAG [value]`."""

from __future__ import annotations

import re

SET = re.compile(r"\bset ((?:[a-z_][a-z0-9_.]*=\S+)(?: [a-z_][a-z0-9_.]*=\S+)*)")
FLAG = re.compile(r"\bpass (--[a-z][a-z-]*)(?: ([a-z0-9_]+)\b)?")


def _value(text: str) -> str:
    """A proposed value without the sentence around it: trailing punctuation and a closing
    bracket the value did not open are cut."""
    while (
        text
        and text[-1] in ".,;:)"
        and not (text[-1] == ")" and text.count("(") >= text.count(")"))
    ):
        text = text[:-1]
    return text


def proposals(message: str) -> list[list[str]]:
    """Each change `message` proposes, as the argument words that apply it: KEY=VALUE
    overrides (`set A=1 B=2` is one change of two overrides) or a flag with its value."""
    out = []
    for m in SET.finditer(message):
        out.append([_value(pair) for pair in m.group(1).split(" ")])
    for m in FLAG.finditer(message):
        out.append([m.group(1)] + ([m.group(2)] if m.group(2) else []))
    return out
