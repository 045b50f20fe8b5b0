"""Streaming text from token ids, one decode step at a time, without emitting broken characters.

Byte-level BPE splits a multi-byte UTF-8 character (an emoji, a CJK ideograph) over several tokens,
so the text of the tokens seen so far can end in half a character. We hold such a tail back until
the character completes, and decode only a short window each step, so a step costs O(window)::

    tokens:   ... p0 p1 p2 | r0 r1 | n0 n1
                  ^          ^       ^
                  prefix     read    new this step
    prefix_text = decode(p0..p2 r0 r1 minus the new part) = decode(tokens[prefix:read])
    new_text    = decode(tokens[prefix:])
    delta       = new_text[len(prefix_text):]   unless new_text ends in U+FFFD (an unfinished
                                                character): then nothing yet, the window grows

After emitting, ``prefix`` moves to the old ``read`` and ``read`` to the end. The window starts with
a few prompt tokens so that decoders which treat the first token of a text specially (dropping a
leading space) see the output in context.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.text.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the first output token, for context.
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output token ids, as they arrive, into text deltas."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character; output bytes must not complete it, since the
            # output is meant to decode on its own. Start without context.
            context = []
        # Only the window is kept: ids before ``_prefix_offset`` are dropped as we go.
        self._window_ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._parts: list[str] = []
        self._text_cache = ""

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the deltas)."""
        if self._parts:
            self._text_cache += "".join(self._parts)
            self._parts.clear()
        return self._text_cache

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add output tokens; return the text they complete (possibly ''), holding back half characters."""
        self._window_ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is held back, broken characters included (decoded as U+FFFD, as decode does)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._window_ids):
            return ""
        prefix_text = self._decode(self._window_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._window_ids[self._prefix_offset :])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        # Slide the window: the emitted tokens become the next step's prefix.
        del self._window_ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._window_ids)
        if delta:
            self._parts.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
