"""Token ids in, client-facing text out: incremental detokenizing, then stop strings.

Both places that turn tokens into text use this one stream, so they cut at the same place: the
engine (a worker's ``RequestOutput.text``) and the router, which detokenizes every token of a
request itself whichever worker it came from (the first from the prefill worker, the rest from the
decode worker), so the client sees one consistent text.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.text.detokenizer import IncrementalDetokenizer
from services.text.stop_strings import StopStringMatcher
from services.text.tokenizer import Tokenizer


class TextStream:
    """Token ids in, text deltas out; never half a character, never part of a stop string."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: Sequence[int], stops: tuple[str, ...],
                 keep_special_tokens: bool = False) -> None:
        """Without a tokenizer there is no text (the client asked with token ids); stops need one.

        ``keep_special_tokens``: special tokens are written as text (the tool-call and reasoning parsers read
        markers such as harmony's ``<|channel|>``), all but the end-of-sequence ones.
        """
        if tokenizer is None and stops:
            raise ValueError("stop strings need a tokenizer")
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, not keep_special_tokens) \
            if tokenizer else None
        self._hidden = tokenizer.eos_token_ids if tokenizer is not None and keep_special_tokens else frozenset()
        self._matcher = StopStringMatcher(stops) if stops else None
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """A stop string was found: the text ended and no further token may add to it."""
        return self._stopped

    @property
    def matched(self) -> str | None:
        """The stop string the text was cut at, once one was found."""
        return self._matcher.matched if self._matcher is not None else None

    def feed(self, token_ids: Sequence[int], final: bool) -> str:
        """Text the new tokens complete; ``final`` flushes what was held back (the request ended)."""
        if self._detokenizer is None or self._stopped:
            return ""
        if self._hidden:
            token_ids = [t for t in token_ids if t not in self._hidden]
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
