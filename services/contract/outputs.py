"""What a request produced, in the torch-free form the router and both workers share."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely tokens at one position, best first: log-softmax of the raw logits."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def head(self, k: int) -> TopLogprobs:
        return TopLogprobs(self.token_ids[:k], self.logprobs[:k])
