"""What a grammar library provides: compile a spec for a vocabulary, and a matcher per request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from services.contract.sampling_params import StructuredSpec

if TYPE_CHECKING:
    import torch


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit ``t % 32`` of word ``t // 32``)."""

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; StructuredOutputError if the grammar did not allow it."""

    def is_finished(self) -> bool:
        """The document is complete (nothing more may be generated)."""


class GrammarBackend(Protocol):
    """A grammar library bound to one tokenizer; thread-safe ``check`` and ``matcher``."""

    def check(self, spec: StructuredSpec) -> None:
        """StructuredOutputError naming what is wrong with ``spec``; cheap, needs no tokenizer state."""

    def matcher(self, spec: StructuredSpec) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar (compiles, or reuses a compiled grammar)."""
