from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from uniweave.core.sample import TextPart
from uniweave.data.digits import TASKS, make_mixed
from uniweave.data.tokenizer import (
    SPECIAL_TOKENS,
    SpecialIds,
    build_tokenizer,
    build_vocab,
    normalize_text,
)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def test_vocab_is_deterministic_and_specials_come_first(tok):
    # the vocabulary is a function of the code alone: another interpreter, with its own
    # string-hash randomisation, builds the same one (same tokens at the same ids)
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from uniweave.data.tokenizer import build_vocab; "
            "print(json.dumps(build_vocab()))",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "random"},
    )
    assert json.loads(other.stdout) == build_vocab()
    assert build_tokenizer().get_vocab() == tok.get_vocab()
    vocab = tok.get_vocab()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert vocab[t] == i
    assert vocab["\n"] == len(SPECIAL_TOKENS)
    assert len(vocab) == len(set(vocab.values())) == max(vocab.values()) + 1
    for word in ["generate", "image", "user", "assistant", "system", "A", "B", "C", "D", "?"]:
        assert word in vocab
    for d in range(10):
        assert str(d) in vocab


def test_special_ids_and_named_tokens(tok):
    sp = SpecialIds.from_tokenizer(tok)
    assert sp.pad == tok.pad_token_id == 0
    assert sp.eos == sp.im_end == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert sp.im_start == tok.convert_tokens_to_ids("<|im_start|>")
    assert sp.image_gen == tok.convert_tokens_to_ids("<image_gen>")
    assert sp.vision_start == tok.convert_tokens_to_ids("<|vision_start|>")
    assert sp.vision_end == tok.convert_tokens_to_ids("<|vision_end|>")
    assert sp.image_pad == tok.convert_tokens_to_ids("<|image_pad|>")
    assert sp.endoftext == tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.unk_token_id == 1
    assert len(sp.as_set()) == 8  # eos and im_end are the same id


def test_special_ids_name_missing_tokens():
    from tokenizers import Tokenizer, models

    bare = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    )
    with pytest.raises(ValueError, match=r"<\|im_start\|>"):
        SpecialIds.from_tokenizer(bare)


def test_every_task_text_is_in_vocabulary(tok):
    unk = tok.unk_token_id
    for split in ("train", "test"):
        for s in make_mixed(list(TASKS), split, 25, seed=3):
            for p in s.parts:
                if isinstance(p, TextPart):
                    ids = tok.encode(p.text, add_special_tokens=False)
                    assert unk not in ids, (s.id, p.text)
            assert unk not in tok.encode(s.answer, add_special_tokens=False)


def test_pieces_newline_numbers_and_unknown_words(tok):
    ids = tok.encode("Which is 3 + 4?\nDraw 12 zebras", add_special_tokens=False)
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens == ["Which", "is", "3", "+", "4", "?", "\n", "Draw", "12", "<unk>"]
    assert tok.encode("<|im_start|>user\n", add_special_tokens=False) == [
        tok.convert_tokens_to_ids("<|im_start|>"),
        tok.convert_tokens_to_ids("user"),
        tok.convert_tokens_to_ids("\n"),
    ]
    # no BOS/EOS is added implicitly
    assert tok.encode("A") == tok.encode("A", add_special_tokens=False)


def test_normalized_text(tok):
    assert normalize_text("Which is 3 + 4?\nDraw it.", tok) == "Which is 3 + 4 ?\nDraw it ."
    assert normalize_text("  A)   3\n\n B ", tok) == "A ) 3\n\nB"
    assert normalize_text("B", tok) == "B"
    text = "Which digit is shown ? A ) 3 B ) 7 C ) 1 D ) 9 ."
    assert normalize_text(text, tok) == text  # normalised text is a fixed point


def test_extra_texts_extend_the_vocabulary():
    assert "zebras" in build_tokenizer(["two zebras"]).get_vocab()
    assert "zebras" not in build_vocab()


def test_save_and_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    texts = [
        "<|im_start|>user\nWhat is 3 + 4? Draw the answer, then state it.<|im_end|>\n",
        "<image_gen> generate image 4 4<|vision_start|><|image_pad|><|vision_end|>",
        "unknown words stay unknown",
    ]
    for loaded in (
        PreTrainedTokenizerFast.from_pretrained(tmp_path),
        AutoTokenizer.from_pretrained(tmp_path),
    ):
        assert loaded.get_vocab() == tok.get_vocab()
        assert SpecialIds.from_tokenizer(loaded) == SpecialIds.from_tokenizer(tok)
        assert loaded.pad_token == "<pad>" and loaded.eos_token == "<|im_end|>"
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False)
            assert loaded.encode(text, add_special_tokens=False) == ids
            assert loaded.decode(ids) == tok.decode(ids)


def test_chat_template_renders_chatml(tok):
    messages = [
        {"role": "system", "content": "You draw digits."},
        {"role": "user", "content": "draw the digit 7"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou draw digits.<|im_end|>\n"
        "<|im_start|>user\ndraw the digit 7<|im_end|>\n<|im_start|>assistant\n"
    )
