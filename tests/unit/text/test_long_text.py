"""Long prompts encoded in pieces on the tokenizer's thread pool give the ids of the whole text."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, trainers

from services.text import long_text
from services.text.long_text import MIN_SPLIT_CHARS, splits_at_word_spaces, word_space_cuts
from services.text.tokenizer import Tokenizer
from tests.unit._smollm2 import smollm2_tokenizer

_PHRASES = ["the cat sat", "über café", "Ελληνικά γράμματα", "кириллица тоже", "日本語の文", "x=y+z*2",
            "don't stop", "  two  spaces", "\ttab", "\n\nlines\n", "12345 67", "CamelCase words", "🙂 ok",
            "https://example.com/a?b=c", "<|im_start|>user", "(parens) [brackets]"]


def _long_text(seed: int, size: int = 3 * MIN_SPLIT_CHARS) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    while sum(map(len, parts)) < size:
        parts.append(rng.choice(_PHRASES) if rng.random() < 0.3 else
                     "".join(rng.choice("etaoinshrdlucmfwypvbgkqjxz") for _ in range(rng.randint(1, 12))))
    return " ".join(parts)


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return smollm2_tokenizer()


def test_byte_level_bpe_is_encoded_in_pieces(smollm2):
    """SmolLM2's byte-level BPE passes the check, so long prompts really take the pieces path."""
    assert splits_at_word_spaces(smollm2._backend)
    assert smollm2._splits_at_word_spaces()


@pytest.mark.parametrize("seed", range(3))
def test_pieces_give_the_whole_texts_ids(smollm2, seed):
    text = _long_text(seed)
    cuts = word_space_cuts(text)
    assert len(cuts) >= 2 and all(text[c] == " " and text[c - 1].isalpha() and text[c + 1].isalpha() for c in cuts)
    whole = smollm2._backend.encode(text, add_special_tokens=False).ids
    assert long_text.encode_pieces(smollm2._backend, text, cuts) == whole
    assert smollm2.encode(text, add_special_tokens=False) == whole


def test_every_word_space_cut_of_a_short_text(smollm2):
    text = _long_text(7, size=600)
    cuts = word_space_cuts(text, piece_chars=1)
    assert long_text.encode_pieces(smollm2._backend, text, cuts) == smollm2._backend.encode(text).ids


def _merges_across_spaces() -> BackendTokenizer:
    """A BPE with no pre-tokenizer: its merges join a word's last letter and the space after it, so cutting
    before that space changes the ids."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    corpus = [_long_text(seed, size=400) for seed in range(20)]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    return backend


def test_a_tokenizer_that_sees_the_cut_is_encoded_whole():
    backend = _merges_across_spaces()
    text = _long_text(3)
    cuts = word_space_cuts(text)
    assert long_text.encode_pieces(backend, text, cuts) != backend.encode(text).ids  # the cut would show
    assert not splits_at_word_spaces(backend)
    assert long_text.encode_long(backend, text, splittable=False) == backend.encode(text).ids


def test_an_added_token_with_a_space_turns_pieces_off(smollm2):
    backend = BackendTokenizer.from_str(smollm2.backend_json())
    backend.add_special_tokens(["<tool call>"])
    assert not splits_at_word_spaces(backend)
