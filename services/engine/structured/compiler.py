"""Grammar matchers for requests, compiled off the engine's step loop and cached by spec."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from services.contract.sampling_params import StructuredSpec
from services.engine.structured.backend import GrammarBackend, GrammarMatcher
from services.engine.structured.llguidance_backend import LLGuidanceBackend
from services.text.tokenizer import Tokenizer

# name -> backend class (tokenizer, vocab size); a new library is a new file and a line here.
BACKENDS: dict[str, Callable[[Tokenizer, int], GrammarBackend]] = {"llguidance": LLGuidanceBackend}
DEFAULT_BACKEND = "llguidance"


class GrammarCompiler:
    """Makes matchers on a small thread pool, so neither the event loop nor the engine thread compiles."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, backend: str = DEFAULT_BACKEND) -> None:
        self.backend = BACKENDS[backend](tokenizer, vocab_size)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-grammar")

    def matcher(self, spec: StructuredSpec, prefix: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher past ``prefix`` (output tokens already generated elsewhere: a pulled first token)."""
        matcher = self.backend.matcher(spec)
        for token_id in prefix:
            matcher.accept(token_id)
        return matcher

    async def matcher_async(self, spec: StructuredSpec, prefix: Sequence[int] = ()) -> GrammarMatcher:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.matcher, spec, prefix)
