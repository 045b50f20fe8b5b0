"""The KV digest: a 32-bit checksum of a ticket's KV, computed where the KV lives, on both sides.

A ticket's bytes cross two layouts (block sizes, block orders and TP slices may differ between the
owner and the reader), so the digest is a function of the KV's *logical* content, not of its
memory. Each (layer, K or V, token, head) row of ``head_dim`` elements (an MLA layer: its one latent
row, keyed as K, and no V) is read as 32-bit words (four FP8 elements, two 16-bit elements, little-endian, or
one 32-bit element per word), every word contributes one term, and the digest is the sum of the terms modulo
2**32::

    term = mix(word XOR key(layer, kv, token, head, word index))
    mix(x) = fmix32-style: x *= M1; x ^= x >> 15; x *= M2; x ^= x >> 13   (all mod 2**32)

``key`` is a 32-bit hash of the word's position, ``head`` the index in the READING rank's head
slice. ``mix`` is a bijection of 32-bit words, so changing any one word (any of its bits, in either
element) changes its term and therefore the sum: a one-bit flip is always detected, a random
corruption of several words escapes with odds near 2**-32, and moving a value to another position
(a block read into the wrong slot, heads swapped) changes its key. A 64-bit sum of the same terms
would be no stronger (its high bits only count carries) and costs a second accumulator; pairing
16-bit elements halves the work per byte (the kernel is bound by integer arithmetic, not memory).
Because the digest is a sum, it splits: by token unit (so the reader checks exactly the tokens it
pulled), by owner rank (each owner rank adds its share of a reader rank's heads), by source
(host-tier and device parts), and it does not depend on where a token sits in memory.

It digests the bytes both sides hold, never the values they stand for: FP8 KV (``float8_e4m3fn``, stored as
``x / scale``) is read as its raw bytes through an int32 view (no float8 kernel is needed, on the host or in
Triton), so a pair whose scales differ would digest equal bytes equally; the scales are checked by the
compatibility hash instead (``spec.kv_quant``), before any READ.

A ticket carries, per KV group and reading rank, the digest of each ``unit`` tokens from token 0
(``unit`` = the smaller of the two sides' block sizes, so every token run a reader can start at is
a unit boundary); the reader sums the units it pulled and compares with its own digest of the same
tokens in its blocks. On CUDA one Triton kernel computes a group's units (``digest.kernel``); on
CPU the same arithmetic runs in numpy (this module), chunked to stay in cache; ``digest.runner``
picks one for a job.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from services.kv.spec.compat import DIGEST_SCHEME
from services.kv.spec.layout import KVLayoutSpec

SCHEME = DIGEST_SCHEME  # the name both sides present in their compatibility fields

MASK32 = 0xFFFFFFFF
# Odd multipliers of the position key and the mix (golden-ratio and murmur3 fmix32 constants).
K_LAYER, K_KV, K_TOKEN, K_HEAD, K_DIM = 0x9E3779B1, 0x7F4A7C15, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F
M1, M2 = 0x85EBCA6B, 0xC2B2AE35
_CHUNK_ELEMENTS = 1 << 22  # host path: a chunk's elements times 64 (so ~64K elements, in cache)


class DigestJob(msgspec.Struct, frozen=True):
    """One digest over one rank's KV: group ``group_id``'s tokens ``[start, end)``, read through the
    block table ``block_ids`` (this rank's block ids from token 0), heads ``[head_start, head_end)``
    of this rank keyed as heads ``head_key ..`` of the reading rank. ``start`` is a multiple of
    ``unit``, which divides the group's block size here or is a multiple of it. ``host_tier``: the
    rank's host KV tier holds these blocks. ``corrupt``: flip one bit in every block first (fault
    injection)."""

    group_id: int
    block_ids: Sequence[int]  # a list off the wire; an int array where the reader made it (no conversion)
    start: int
    end: int
    unit: int
    head_start: int
    head_end: int
    head_key: int
    host_tier: bool = False
    corrupt: bool = False

    @property
    def num_units(self) -> int:
        return -(-self.end // self.unit) - self.start // self.unit


def check_job(layout: KVLayoutSpec, job: DigestJob) -> None:
    """Refuse a job the layout cannot answer (a bad unit, range, head slice or block id)."""
    if not 0 <= job.group_id < len(layout.groups):
        raise ValueError(f"digest job names KV group {job.group_id}, the layout has {len(layout.groups)}")
    bs = layout.block_size(job.group_id)
    if job.unit < 1 or (bs % job.unit and job.unit % bs) or job.start % job.unit:
        raise ValueError(f"digest unit {job.unit} must divide the start {job.start}, and divide or be a multiple "
                         f"of the block size {bs}")
    if not 0 <= job.start < job.end <= len(job.block_ids) * bs:
        raise ValueError(f"digest tokens [{job.start}, {job.end}) outside {len(job.block_ids)} blocks of {bs}")
    if not 0 <= job.head_start < job.head_end <= layout.kv_heads(job.group_id):
        raise ValueError(f"digest heads [{job.head_start}, {job.head_end}) outside the rank's "
                         f"{layout.kv_heads(job.group_id)}")
    used = np.asarray(job.block_ids[job.start // bs: -(-job.end // bs)], dtype=np.int64)
    if used.size and not (int(used.min()) >= 0 and int(used.max()) < layout.num_blocks):
        raise ValueError(f"digest block ids outside the layout's {layout.num_blocks} blocks")


def layer_views(layout: KVLayoutSpec, buffers: Sequence[torch.Tensor], group_id: int
                ) -> list[tuple[int, int, torch.Tensor]]:
    """(layer id, K/V, [num_blocks, block_size, heads, words per row] int32 view of the rows' 32-bit words)
    of every plane of every layer of a group: K and V, or an MLA layer's one latent row (kv 0)."""
    per_word = 4 // layout.element_size  # elements per 32-bit word
    out = []
    for layer in layout.groups[group_id].layer_ids:
        for kv in range(layout.num_kv_planes(group_id)):
            v = layout.view(layer, kv)
            if v.offset % per_word or any(s % per_word for s in (*v.strides[:3], v.shape[3])):
                raise ValueError(f"KV rows of layer {layer} are not whole 32-bit words (head_dim {v.shape[3]}, "
                                 f"{layout.element_size}-byte elements): the digest cannot read them")
            words = buffers[v.buffer_index].view(-1).view(torch.int32)
            shape = (*v.shape[:3], v.shape[3] // per_word)
            strides = (*(s // per_word for s in v.strides[:3]), 1)
            out.append((layer, kv, words.as_strided(shape, strides, v.offset // per_word)))
    return out


#: The bits ``corrupt_blocks`` flips, as int32 words: the top exponent bit of each element (bit 6 of an e4m3 byte,
#: bit 14 of a 16-bit float, bit 30 of an fp32).
_EXPONENT_BITS = {1: 0x40404040, 2: 0x40004000, 4: 0x40000000}


def corrupt_blocks(views: list[tuple[int, int, torch.Tensor]], block_size: int, job: DigestJob,
                   element_size: int) -> None:
    """``PDSERVE_FAULT_INJECT=kv_corrupt``: in every block of the job's range, flip a high exponent bit of
    every element of the block's first token in range, in every layer's K (a change that must show in the
    output when nothing checks it, and that the digest always catches)."""
    bits = _EXPONENT_BITS[element_size]
    first, last = job.start // block_size, -(-job.end // block_size)
    device = views[0][2].device
    ids = torch.tensor(job.block_ids[first:last], dtype=torch.long, device=device)
    # Each block's first token inside the range (the first block may start mid-block).
    tokens = torch.tensor([max(job.start - b * block_size, 0) for b in range(first, last)], device=device)
    for _, kv, view in views:
        if kv == 0:
            view[ids, tokens, job.head_start:job.head_end] ^= bits


def digest_units_host(views: list[tuple[int, int, torch.Tensor]], block_size: int, job: DigestJob
                      ) -> torch.Tensor:
    """The reference arithmetic on the host: numpy uint32 (wrapping) in place, a few blocks at a time so
    the temporaries stay in cache; int64 [num_units], each in [0, 2**32)."""
    h0, h1 = job.head_start, job.head_end
    d = views[0][2].shape[3]
    heads = np.arange(h1 - h0, dtype=np.uint32)[:, None] + np.uint32(job.head_key)
    head_dim_keys = heads * np.uint32(K_HEAD) + np.arange(d, dtype=np.uint32)[None, :] * np.uint32(K_DIM)
    first_unit = job.start // job.unit
    sums = np.zeros(job.num_units, dtype=np.uint64)
    blocks_per_chunk = max(1, _CHUNK_ELEMENTS // 64 // (block_size * (h1 - h0) * d))
    first, last = job.start // block_size, -(-job.end // block_size)
    ids = torch.tensor(job.block_ids[first:last], dtype=torch.long, device=views[0][2].device)
    for c in range(0, last - first, blocks_per_chunk):
        begin = (first + c) * block_size  # the chunk's first token (a block boundary)
        lo, hi = max(begin, job.start), min(begin + blocks_per_chunk * block_size, job.end)
        tokens = np.arange(lo, hi, dtype=np.uint32)
        # unit boundaries inside [lo, hi): reduceat's segment starts, relative to lo
        cuts = np.unique(np.concatenate([[0], np.arange(-(-lo // job.unit) * job.unit, hi, job.unit) - lo]))
        slots = (lo + cuts) // job.unit - first_unit
        token_sums = np.zeros(hi - lo, dtype=np.uint64)
        x = np.empty((hi - lo, h1 - h0, d), dtype=np.uint32)
        tmp = np.empty_like(x)
        for layer, kv, view in views:  # the chunk's blocks gathered where they live, then to the host
            blocks = view[ids[c:c + blocks_per_chunk]].cpu().numpy()
            rows = blocks.reshape(-1, view.shape[2], d)[lo - begin:hi - begin, h0:h1]
            base = np.uint32((layer * K_LAYER + kv * K_KV) & MASK32)
            np.add((tokens * np.uint32(K_TOKEN) + base)[:, None, None], head_dim_keys[None], out=x)
            np.bitwise_xor(x, rows.view(np.uint32), out=x)
            _mix_inplace(x, tmp)
            token_sums += x.reshape(hi - lo, -1).sum(axis=1, dtype=np.uint64)
        sums[slots] += np.add.reduceat(token_sums, cuts)
    return torch.from_numpy((sums & np.uint64(MASK32)).view(np.int64))


def _mix_inplace(x: np.ndarray, tmp: np.ndarray) -> None:
    """The module docstring's ``mix`` on uint32 arrays, in place (numpy's uint32 arithmetic wraps mod 2**32)."""
    np.multiply(x, np.uint32(M1), out=x)
    np.right_shift(x, 15, out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, np.uint32(M2), out=x)
    np.right_shift(x, 13, out=tmp)
    np.bitwise_xor(x, tmp, out=x)


def ticket_units(digests: Sequence[int], unit: int, start: int, end: int) -> int:
    """The sum (mod 2**32) of a ticket's unit digests covering tokens ``[start, end)`` (start on a unit)."""
    if start % unit:
        raise ValueError(f"pulled tokens start at {start}, not on the ticket's digest unit of {unit}")
    first, last = start // unit, -(-end // unit)
    if last > len(digests):
        raise ValueError(f"the ticket has {len(digests)} digest units of {unit} tokens, {end} tokens were pulled")
    # One conversion of the whole field (a protobuf repeated field converts in microseconds; a slice of it is a
    # list built an element at a time, ~40 ns each).
    return int(np.asarray(digests, dtype=np.uint64)[first:last].sum(dtype=np.uint64)) & MASK32


def total(units: np.ndarray) -> int:
    """Sum of unit digests, mod 2**32."""
    return int(units.sum(dtype=np.uint64)) & MASK32


K_STATE = 0x165667B1  # the state digest's position key base (a state slot is not a (layer, token, head) row)
_STATE_CHUNK_WORDS = 1 << 20


def state_digest(slot: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> int:
    """The digest of a request's state bytes (``state_runs``): for each ``(offset, length, key)`` run of the uint8
    ``slot`` row, the module's ``mix`` of every 32-bit word XOR ``K_STATE + (key / 4 + i) * K_DIM``, summed mod
    2**32. ``key`` is where the run lands in the READING rank's slot, so the owner (its own offsets, the reader's
    keys) and the reader (the reader's offsets and keys) compute the same sum, and a run read into the wrong place
    changes it. Runs where the slot lives (int64 torch arithmetic, masked to 32 bits after each step)."""
    total_sum, mask = 0, MASK32
    for offset, length, key in runs:
        words = slot[offset:offset + length].view(torch.int32)
        for begin in range(0, words.numel(), _STATE_CHUNK_WORDS):
            x = words[begin:begin + _STATE_CHUNK_WORDS].to(torch.int64) & mask
            first = key // 4 + begin
            keys = (torch.arange(first, first + len(x), device=x.device, dtype=torch.int64) * K_DIM + K_STATE) & mask
            x = x ^ keys
            x = (x * M1) & mask
            x = x ^ (x >> 15)
            x = (x * M2) & mask
            x = x ^ (x >> 13)
            total_sum += int(x.sum())
    return total_sum & MASK32
