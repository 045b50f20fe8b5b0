"""Packed token bitmasks (32 tokens per int32 word, as the grammar libraries write them) applied to logits."""

from __future__ import annotations

import math

import torch


def words_for(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """Host int32 [num_rows, words]; all bits set (everything allowed) until a matcher writes its row."""
    return torch.full((num_rows, words_for(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits`` with every token not allowed in ``bitmask[i]`` set to -inf in row ``rows[i]`` (in place)."""
    vocab_size = logits.shape[1]
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    selected = logits.index_select(0, index).masked_fill(~allowed, -math.inf)
    return logits.index_copy_(0, index, selected)
