"""The llguidance backend: JSON schemas compiled to Earley grammars, masks computed lazily per token.

Chosen by measurement (bench/grammar.py, bench/RESULTS.md): sub-millisecond compiles of any schema and
free-form JSON, and masks in tens of microseconds on the SmolLM2 vocabulary.
"""

from __future__ import annotations

import llguidance
import torch

from services.contract.sampling_params import StructuredSpec
from services.contract.structured import StructuredOutputError, grammar_of
from services.text.tokenizer import Tokenizer


class LLGuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # Straight into the row's memory. Not through llguidance.torch: importing it runs torch.compile,
        # which imports triton (and would fix triton's interpreter mode off for the whole process).
        words = bitmask[row]
        if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not words.is_contiguous():
            raise ValueError("a grammar bitmask is a contiguous int32 tensor on the host")
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token_id: int) -> None:
        """Checked first, so a refused token leaves the matcher where it was."""
        if self._matcher.validate_tokens([token_id]) != 1 or not self._matcher.consume_token(token_id):
            raise StructuredOutputError(f"token {token_id} does not continue the document")

    def is_finished(self) -> bool:
        return self._matcher.is_stopped()


class LLGuidanceBackend:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        """``vocab_size``: the model's logits width (may exceed the tokenizer's: padded rows stay masked)."""
        self._tokenizer = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size,
                                                 eos_token=sorted(tokenizer.eos_token_ids))

    def check(self, spec: StructuredSpec) -> None:
        grammar_of(spec)

    def matcher(self, spec: StructuredSpec) -> LLGuidanceMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_of(spec))
        if matcher.is_error():
            raise StructuredOutputError(f"the grammar cannot be used: {matcher.get_error()}")
        return LLGuidanceMatcher(matcher)
