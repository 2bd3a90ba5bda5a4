"""The embedded model's text tokenizers, as `PreTrainedTokenizerFast`s with the same
special tokens: the digits WordLevel tokenizer (`build_tokenizer`, the default of the
built-in digits tasks) and a byte-level BPE trained on a run's own text
(`train_bpe_tokenizer`, `load_or_train_bpe`), which reads any text without an unknown id.

The byte-level BPE (GPT-2 style): text is split by the ByteLevel pre-tokenizer, mapped
to bytes, and merged by BPE merges learned from the given texts (plus the template words
and the numbers 0..`MAX_NUMBER`) up to `vocab_size` ids; the 256 byte symbols are always
in the vocabulary, so every string encodes, and decode(encode(text)) == text exactly.
Ids: the special tokens first (`SPECIAL_TOKENS` order), then bytes and merges. It has no
unknown token.

WordLevel (the digits tokenizer):

Pre-tokenisation isolates, in order of precedence, a newline "\\n", a run of decimal
digits, a run of letters (and "_"), or one punctuation character; other whitespace
separates pieces and is dropped. Case is kept (answers like "B" round-trip exactly).
"\\n" is an ordinary vocabulary token, so ChatML's newlines are real positions.

Decoding joins pieces with one space, except that no space is put next to a newline:
`decode(encode("Which is 3 + 4?\\nDraw"))` == "Which is 3 + 4 ?\\nDraw". This is the
*normalised* form of a text (`normalize_text`), and what `template.parse` returns.

Vocabulary (deterministic): the special tokens first, in `SPECIAL_TOKENS` order (so
`<pad>` is id 0), then "\\n", then the sorted set of every piece of the digits tasks' texts,
the template words ("generate", "image", the roles), the integers 0..`MAX_NUMBER`
(image grid sizes in the generation header), the letters A-D and every ASCII punctuation
character. Anything else encodes to `<unk>`.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from uniweave.core.atomic import write_dir_atomic
from uniweave.data.digits import vocabulary_texts

PAD = "<pad>"
UNK = "<unk>"
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
IMAGE_GEN = "<image_gen>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD,
    UNK,
    ENDOFTEXT,
    IM_START,
    IM_END,
    IMAGE_GEN,
    VISION_START,
    VISION_END,
    IMAGE_PAD,
)
NEWLINE = "\n"
MAX_NUMBER = 64
TEMPLATE_WORDS: tuple[str, ...] = ("generate", "image", "user", "assistant", "system")
PIECE_PATTERN = r"\n|\d+|[^\W\d]+|[^\w\s]"

# ChatML for plain-string contents, for `apply_chat_template` on text-only messages; it
# renders the same string that `template.serialize` tokenises.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{% if messages %}{{ '\\n' }}{% endif %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="removed", invert=True)


def pieces(text: str) -> list[str]:
    """The pre-tokenised pieces of `text` (what WordLevel looks up)."""
    return [p for p, _ in _pre_tokenizer().pre_tokenize_str(text)]


def build_vocab(extra_texts: Iterable[str] = ()) -> dict[str, int]:
    """token -> id: specials, "\\n", then the sorted pieces (see the module docstring)."""
    words: set[str] = set(TEMPLATE_WORDS) | set("ABCD") | set(string.punctuation)
    words |= {str(k) for k in range(MAX_NUMBER + 1)}
    for text in [*vocabulary_texts(), *extra_texts]:
        words.update(pieces(text))
    words -= {NEWLINE, *SPECIAL_TOKENS}
    ordered = [*SPECIAL_TOKENS, NEWLINE, *sorted(words)]
    return {tok: i for i, tok in enumerate(ordered)}


def build_tokenizer(extra_texts: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """The WordLevel tokenizer over the digits tasks (+ `extra_texts`), ready to save.

    eos is `<|im_end|>` (the end of an assistant turn), pad `<pad>`, unk `<unk>`; the
    other special tokens are extra special tokens. No BOS/EOS is added on encode.
    """
    tok = Tokenizer(models.WordLevel(build_vocab(extra_texts), unk_token=UNK))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.Sequence(
        [
            decoders.WordPiece(prefix="##", cleanup=False),
            decoders.Fuse(),
            decoders.Replace(Regex(r" ?\n ?"), NEWLINE),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return _fast(tok, UNK)


def _fast(tok: Tokenizer, unk: str | None) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=unk,
        eos_token=IM_END,
        extra_special_tokens=[ENDOFTEXT, IM_START, IMAGE_GEN, VISION_START, VISION_END, IMAGE_PAD],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
        chat_template=CHAT_TEMPLATE,
    )


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most `vocab_size` ids trained on `texts` (module docstring)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    fixed = [*TEMPLATE_WORDS, NEWLINE, *(str(k) for k in range(MAX_NUMBER + 1))]
    tok.train_from_iterator([*fixed, *texts], trainer=trainer)
    return _fast(tok, None)


def load_or_train_bpe(
    directory: Path | None, texts: Iterable[str], vocab_size: int
) -> PreTrainedTokenizerFast:
    """The BPE saved in `directory` (a resumed run), else one trained on `texts` and saved
    there atomically (written to a temporary sibling, then renamed)."""
    if directory is not None and (directory / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    tokenizer = train_bpe_tokenizer(texts, vocab_size)
    if directory is not None:
        directory.parent.mkdir(parents=True, exist_ok=True)
        write_dir_atomic(
            directory.parent,
            directory.name,
            lambda tmp: tokenizer.save_pretrained(str(tmp)),
            unique=True,
        )
    return tokenizer


def normalize_text(text: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """decode(encode(text)): the form in which `text` comes back from a token stream."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens the template and rollout use (eos is `<|im_end|>`)."""

    pad: int
    eos: int
    im_start: int
    im_end: int
    image_gen: int
    vision_start: int
    vision_end: int
    image_pad: int
    endoftext: int

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> SpecialIds:
        """Look every special token up; ValueError naming any the tokenizer lacks."""
        names = {
            "pad": PAD,
            "im_start": IM_START,
            "im_end": IM_END,
            "image_gen": IMAGE_GEN,
            "vision_start": VISION_START,
            "vision_end": VISION_END,
            "image_pad": IMAGE_PAD,
            "endoftext": ENDOFTEXT,
        }
        # one token in, one id (or None) out
        found: dict[str, Any] = {
            tok: tokenizer.convert_tokens_to_ids(tok) for tok in names.values()
        }
        unk = tokenizer.unk_token_id
        missing = [tok for tok, i in found.items() if i is None or (i == unk and tok != UNK)]
        if missing:
            raise ValueError(f"tokenizer lacks special token(s) {', '.join(missing)}")
        ids = {field: int(found[tok]) for field, tok in names.items()}
        return cls(eos=ids["im_end"], **ids)

    def as_set(self) -> frozenset[int]:
        """Every special id (for checking that text holds none)."""
        return frozenset(vars(self).values())
