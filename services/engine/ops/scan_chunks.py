"""Where a step's scan chunks lie: the host-side table the chunked-scan kernels index by program id.

A prefill step packs several requests' tokens back to back (``query_lens``). A chunked scan cuts each
request's tokens into chunks of ``chunk_size`` from the request's own first token, so no chunk spans two
requests and every kernel of the scan can run over all requests' chunks in one launch (no per-request
Python loop). The table is built from host lists (the step's lengths, state slots and whether each request
starts at token 0), copied to the device once (from pinned memory, so the host does not wait for the GPU), and
cached: every state layer of a step asks for the same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

CHUNK_FIELDS = 4  # per chunk: first token, tokens, sequence, unused
SEQ_FIELDS = 8  # per sequence: first token, tokens, state slot, fresh, first chunk, chunks, unused x2


@dataclass(frozen=True)
class ScanChunks:
    """``chunks`` int32 [num_chunks, CHUNK_FIELDS] and ``seqs`` int32 [num_seqs, SEQ_FIELDS] (views of one
    device tensor); ``fresh`` sequences start from the zero state whatever their slot holds."""

    chunks: torch.Tensor
    seqs: torch.Tensor
    num_chunks: int
    num_seqs: int
    num_tokens: int
    chunk_size: int


def scan_chunks(lengths: Sequence[int], slots: Sequence[int], fresh: Sequence[bool], chunk_size: int,
                device: torch.device) -> ScanChunks:
    """The chunk table of sequences of ``lengths`` tokens packed in order, each with its state ``slot``."""
    if not (len(lengths) == len(slots) == len(fresh)) or not lengths:
        raise ValueError(f"lengths, slots and fresh must be equally long and not empty, got {len(lengths)}, "
                         f"{len(slots)}, {len(fresh)}")
    if min(lengths) < 1 or chunk_size < 1:
        raise ValueError(f"every sequence needs a token and chunk_size must be positive: {list(lengths)}, "
                         f"{chunk_size}")
    return _cached(tuple(int(n) for n in lengths), tuple(int(s) for s in slots), tuple(bool(f) for f in fresh),
                   int(chunk_size), torch.device(device))


@lru_cache(maxsize=8)
def _cached(lengths: tuple[int, ...], slots: tuple[int, ...], fresh: tuple[bool, ...], chunk_size: int,
            device: torch.device) -> ScanChunks:
    chunks: list[int] = []
    seqs: list[int] = []
    start = 0
    for seq, (n, slot, is_fresh) in enumerate(zip(lengths, slots, fresh, strict=True)):
        first = len(chunks) // CHUNK_FIELDS
        for at in range(0, n, chunk_size):
            chunks += [start + at, min(chunk_size, n - at), seq, 0]
        seqs += [start, n, slot, int(is_fresh), first, len(chunks) // CHUNK_FIELDS - first, 0, 0]
        start += n
    table = torch.tensor(chunks + seqs, dtype=torch.int32)
    pinned = device.type == "cuda"  # a pageable copy would stall the host until the GPU catches up
    table = (table.pin_memory() if pinned else table).to(device, non_blocking=pinned)
    num_chunks = len(chunks) // CHUNK_FIELDS
    return ScanChunks(table[:len(chunks)].view(num_chunks, CHUNK_FIELDS),
                      table[len(chunks):].view(len(lengths), SEQ_FIELDS), num_chunks, len(lengths), start, chunk_size)
