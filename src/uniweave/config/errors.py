"""The one exception the config system raises, and the typo suggester it uses.

Every problem with a config — a missing file, a YAML syntax error, an unknown key, a wrong
type, an incompatible combination, a malformed command-line override — becomes a
`ConfigError` whose `str()` is ONE line of the form

    <source>[:<line>[:<col>]]: <dotted.key>: <problem>; expected <expected>; did you mean '<x>'?

where `<source>` is the YAML file the offending key came from, or `<command line>` for an
override. The parts are also available as attributes for programmatic use.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

COMMAND_LINE = "<command line>"

# Names people bring from other frameworks, mapped to this schema's field names; a typo of
# one of these (``lerning_rate``) is suggested as the real field (``lr``).
KEY_SYNONYMS: dict[str, str] = {
    "learning_rate": "lr",
    "adam_betas": "betas",
    "adam_epsilon": "eps",
    "batch_size": "global_batch_size",
    "train_batch_size": "global_batch_size",
    "max_steps": "total_updates",
    "num_updates": "total_updates",
    "max_grad_norm": "grad_clip",
    "lora_rank": "r",
    "rank": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "num_generations": "group_size",
    "cfg_scale": "guidance",
    "guidance_scale": "guidance",
}


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class ConfigError(ValueError):
    """A config problem, reported as one line naming the source, the dotted key and the fix."""

    def __init__(
        self,
        problem: str,
        *,
        key: str | None = None,
        source: str | None = None,
        line: int | None = None,
        column: int | None = None,
        expected: str | None = None,
        suggestion: str | None = None,
        more: int = 0,
    ) -> None:
        self.problem = _one_line(problem)
        self.key = key
        self.source = source
        self.line = line
        self.column = column
        self.expected = _one_line(expected) if expected else None
        self.suggestion = suggestion
        self.more = more
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """The one-line message (also `str(self)`)."""
        where = self.source or "<config>"
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        text = f"{where}: "
        if self.key:
            text += f"{self.key}: "
        text += self.problem
        if self.expected:
            text += f"; expected {self.expected}"
        if self.suggestion:
            text += f"; did you mean '{self.suggestion}'?"
        if self.more:
            text += f" (and {self.more} more error{'s' if self.more > 1 else ''})"
        return text

    def __str__(self) -> str:
        return self.message


class InputError(ConfigError):
    """A file the config names cannot be used, on one line: "FILE[:LINE]: what (KEY in
    SOURCE)", KEY the config key that named the file, SOURCE the config file or
    `<command line>` that set it (filled in by the CLI)."""

    def __init__(self, text: str, key: str | None = None) -> None:
        self.text = _one_line(text)
        super().__init__(self.text, key=key)

    @property
    def message(self) -> str:
        if not self.key:
            return self.text
        return f"{self.text} ({self.key}{f' in {self.source}' if self.source else ''})"


def suggest(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to `name` (difflib ratio >= 0.6), also trying `KEY_SYNONYMS`.

    ``suggest("lerning_rate", ["lr", "eps"])`` is ``"lr"``: the typo is close to the
    synonym ``learning_rate``, whose schema name ``lr`` is a candidate.
    """
    pool = [c for c in candidates if c != name]
    if KEY_SYNONYMS.get(name) in pool:  # batch_size: global_batch_size, not micro_batch_size
        return KEY_SYNONYMS[name]
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.6)
    if close:
        return close[0]
    synonyms = {alias: real for alias, real in KEY_SYNONYMS.items() if real in pool}
    close = difflib.get_close_matches(name, list(synonyms), n=1, cutoff=0.75)
    return synonyms[close[0]] if close else None
