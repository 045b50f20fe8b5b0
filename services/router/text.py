"""Client-facing text of one request's output, made by the router from token ids.

Tokens reach the router from two workers: the first from the prefill worker (a bare id, sent to the
client before the decode worker has started) and the rest from the decode worker. Detokenizing
all of them here, with the engine's own incremental detokenizer and stop-string matcher, gives
one consistent text whichever worker a token came from; the workers apply the same stop strings,
so they finish on the same token the router cuts at.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.stopping import StopStringMatcher
from services.engine.tokenizer import Tokenizer


class TextStream:
    """Token ids in, text deltas out; never half a character, never part of a stop string."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: Sequence[int], stops: tuple[str, ...]) -> None:
        """Without a tokenizer there is no text (the client asked with token ids); stops need one."""
        if tokenizer is None and stops:
            raise ValueError("stop strings need a tokenizer")
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer else None
        self._matcher = StopStringMatcher(stops) if stops else None
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """A stop string was found: the text ended and no further token may add to it."""
        return self._stopped

    def feed(self, token_ids: Sequence[int], final: bool) -> str:
        """Text the new tokens complete; ``final`` flushes what was held back (the request ended)."""
        if self._detokenizer is None or self._stopped:
            return ""
        text = self._detokenizer.step(token_ids)
        if final:
            text += self._detokenizer.flush()
        if self._matcher is None:
            return text
        text, matched = self._matcher.feed(text)
        if matched is None and final:
            text += self._matcher.flush()
            matched = self._matcher.matched
        self._stopped = matched is not None
        return text


def token_label(tokenizer: Tokenizer | None, token_id: int, as_token_id: bool) -> str:
    """How logprobs name a token: its text, or ``token_id:<id>`` (asked for, or no tokenizer)."""
    if as_token_id or tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)
