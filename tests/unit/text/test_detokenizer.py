"""IncrementalDetokenizer: streamed deltas add up to the full decode and never split a character."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.text.detokenizer import IncrementalDetokenizer
from services.text.tokenizer import Tokenizer
from tests.unit._smollm2 import smollm2_tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def fragment_ids(tokenizer) -> list[int]:
    """Ids whose bytes are not whole characters: the tokens that split emoji and CJK."""
    return [i for i in range(tokenizer.vocab_size) if REPLACEMENT in tokenizer.decode([i])]


def _stream(detokenizer: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    deltas = [detokenizer.step(chunk) for chunk in chunks]
    deltas.append(detokenizer.flush())
    return deltas


def _check_deltas_against_full_decode(deltas: list[str], full: str) -> None:
    assert "".join(deltas) == full
    offset = 0
    for delta in deltas:
        for index, char in enumerate(delta):
            if char == REPLACEMENT:
                assert full[offset + index] == REPLACEMENT
        offset += len(delta)


def test_emoji_is_held_until_complete(tokenizer):
    text = "Hi 😀 and 日本語!"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say hi:"))
    deltas = _stream(detokenizer, [[i] for i in ids])
    assert "".join(deltas) == text == detokenizer.text
    assert all(REPLACEMENT not in d for d in deltas)
    # Some tokens carried only part of a character, so some steps returned nothing.
    assert len(ids) > len([d for d in deltas if d])


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("Sure.<|im_end|>")
    skipping = IncrementalDetokenizer(tokenizer, [])
    keeping = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(_stream(skipping, [[i] for i in ids])) == "Sure."
    assert "".join(_stream(keeping, [[i] for i in ids])) == "Sure.<|im_end|>"


def test_prompt_context_keeps_leading_space(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
    assert detokenizer.step(tokenizer.encode(" world")) == " world"


def test_flush_returns_incomplete_tail_as_decode_does(tokenizer):
    ids = tokenizer.encode("ok 😀")
    partial = ids[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    streamed = detokenizer.step(partial)
    assert REPLACEMENT not in streamed
    tail = detokenizer.flush()
    assert streamed + tail == tokenizer.decode(partial)
    assert tail.endswith(REPLACEMENT)
    assert detokenizer.flush() == ""


def test_prompt_ending_mid_character(tokenizer):
    ids = tokenizer.encode("😀")
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:1])
    deltas = _stream(detokenizer, [ids[1:]])
    # The output decodes on its own: its first bytes do not complete the prompt's character.
    assert "".join(deltas) == tokenizer.decode(ids[1:])


class _CountingTokenizer:
    """Records the longest id list decoded, to show each step costs O(window), not O(sequence)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_short_window(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    ids = tokenizer.encode("word " * 500 + "😀日本" * 20)
    detokenizer = IncrementalDetokenizer(counting, tokenizer.encode("a long prompt " * 50))
    _check_deltas_against_full_decode(_stream(detokenizer, [[i] for i in ids]), tokenizer.decode(ids))
    assert counting.longest <= 12


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_streams_match_full_decode(tokenizer, fragment_ids, data):
    special_ids = list(range(17))
    token_id = st.one_of(
        st.integers(0, tokenizer.vocab_size - 1),
        st.sampled_from(fragment_ids),
        st.sampled_from(special_ids),
    )
    prompt = data.draw(st.lists(token_id, max_size=8), label="prompt")
    chunks = data.draw(st.lists(st.lists(token_id, min_size=0, max_size=4), max_size=12), label="chunks")
    skip_special_tokens = data.draw(st.booleans(), label="skip_special_tokens")
    output_ids = [i for chunk in chunks for i in chunk]

    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    seen: list[int] = []
    deltas = []
    for chunk in chunks:
        deltas.append(detokenizer.step(chunk))
        seen += chunk
        so_far = tokenizer.decode(seen, skip_special_tokens=skip_special_tokens)
        # Eager: everything up to an unfinished character is out; nothing past what decode shows.
        assert so_far.startswith(detokenizer.text)
        if not so_far.endswith(REPLACEMENT):
            assert detokenizer.text == so_far
    deltas.append(detokenizer.flush())

    full = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    _check_deltas_against_full_decode(deltas, full)
    assert detokenizer.text == full
