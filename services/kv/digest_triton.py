"""The KV digest on the device: one Triton kernel per job, reading each word once.

Same arithmetic as ``digest.py``'s host path (which the tests compare it with, here under Triton's
CPU interpreter and on a GPU): a program takes one (block, layer and K/V) and walks its heads in
``[block_size, words per row]`` tiles of 32-bit words, mixes each word with its position key and adds
it into a tile of uint32 accumulators (wrapping, as the digest's sum does), reduces that tile once,
and writes each unit's sum to a cell of its own (no atomics); a torch sum over the cells gives the
units. Layers reach the kernel as a table of base addresses and strides, so per-layer and
cross-layer buffers, NHD and HND blocks take the same launch. Imported only when a CUDA digest runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kv import digest as d

# The digest's constants, as Triton sees module globals: compile-time values.
_M1, _M2 = tl.constexpr(d.M1), tl.constexpr(d.M2)
_K_TOKEN, _K_HEAD, _K_DIM = tl.constexpr(d.K_TOKEN), tl.constexpr(d.K_HEAD), tl.constexpr(d.K_DIM)


@triton.jit
def _mix(x):
    x = x * _M1
    x = x ^ (x >> 15)
    x = x * _M2
    return x ^ (x >> 13)


NUM_WARPS = 2  # on an H100, 2 warps beat 4 and 8 at 2k tokens (0.22 vs 0.31/0.29 ms) and tie at 8k (bench/RESULTS.md)


# Token ranges, heads and slots change per request: not specialised on, so a new value never recompiles.
@triton.jit(do_not_specialize=["first_block", "start", "end", "first_slot", "head_start", "head_key", "num_heads",
                               "out_stride"])
def _digest_kernel(
    Bases, Meta, BlockIds, Out,
    first_block, start, end, first_slot, head_start, head_key, num_heads, out_stride,
    block_size, row_words,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, UNIT: tl.constexpr,
):
    """Grid (blocks, layer views). ``Meta[v]`` = (offset, block stride, token stride, head stride, position
    key of the view's layer and K/V), in 32-bit words; ``Bases[v]`` the view's buffer address. Each program
    walks its block's heads and writes the sums of its slots (units, or its block when a unit spans
    blocks) to its own column of ``Out``, so nothing contends (the caller adds rows and columns)."""
    blk = tl.program_id(0)
    v = tl.program_id(1)
    block_id = tl.load(BlockIds + first_block + blk).to(tl.int64)
    offset = tl.load(Meta + v * 5 + 0)
    block_stride = tl.load(Meta + v * 5 + 1)
    token_stride = tl.load(Meta + v * 5 + 2)
    head_stride = tl.load(Meta + v * 5 + 3)
    base_key = tl.load(Meta + v * 5 + 4).to(tl.uint32)
    base = tl.load(Bases + v).to(tl.pointer_type(tl.int32))
    t = tl.arange(0, BLOCK_T)
    words = tl.arange(0, BLOCK_W)
    token = (first_block + blk) * block_size + t
    row_ok = (t < block_size) & (token >= start) & (token < end)
    mask = row_ok[:, None] & (words < row_words)[None, :]
    tile = t[:, None].to(tl.int64) * token_stride + words[None, :]
    # The position key without its head term, once per program: a head adds K_HEAD to every word's key.
    key = (base_key + token.to(tl.uint32) * _K_TOKEN + (head_key.to(tl.uint32) * _K_HEAD))[:, None] + \
        words.to(tl.uint32)[None, :] * _K_DIM
    rows = base + offset + block_id * block_stride + head_start.to(tl.int64) * head_stride + tile
    acc = tl.zeros((BLOCK_T, BLOCK_W), dtype=tl.uint32)
    for _ in range(num_heads):
        bits = tl.load(rows, mask=mask, other=0).to(tl.uint32)
        acc += tl.where(mask, _mix(bits ^ key), 0)
        rows += head_stride
        key += _K_HEAD
    sums = tl.sum(acc, axis=1)  # per token, wrapping mod 2**32
    if UNIT >= BLOCK_T:  # a slot per block (a unit holds one or more blocks)
        slot = first_block + blk - first_slot
        tl.store(Out + slot * out_stride + v, tl.sum(sums, axis=0).to(tl.int64))
    else:  # a slot per unit
        per_unit = tl.sum(tl.reshape(sums, (BLOCK_T // UNIT, UNIT)), axis=1).to(tl.int64)
        units = ((first_block + blk) * block_size) // UNIT + tl.arange(0, BLOCK_T // UNIT)
        slot = units - first_slot
        unit_ok = (tl.arange(0, BLOCK_T // UNIT) * UNIT < block_size) & (slot >= 0) & (units * UNIT < end)
        tl.store(Out + slot * out_stride + v, per_unit, mask=unit_ok)


def digest_units_cuda(views: list[tuple[int, int, torch.Tensor]], block_size: int, job: d.DigestJob
                      ) -> torch.Tensor:
    """int64 [num_units] (each in [0, 2**32)) of ``job`` over ``views`` (``digest.layer_views``), one
    launch; the host path for a block size or unit that is not a power of two."""
    if block_size & (block_size - 1) or job.unit & (job.unit - 1):
        return d.digest_units_host(views, block_size, job)
    device = views[0][2].device
    first, last = job.start // block_size, -(-job.end // block_size)
    if last == first:
        return torch.zeros(job.num_units, dtype=torch.int64, device=device)
    bases, meta = _view_table(views)
    ids = torch.tensor(job.block_ids[:last], dtype=torch.int64).to(device, non_blocking=True)
    # Slots of the finer of a unit and a block; every program writes its own (slot, view) cells.
    slot_tokens = min(job.unit, block_size)
    per_unit = job.unit // slot_tokens
    partials = torch.zeros(job.num_units * per_unit, len(views), dtype=torch.int64, device=device)
    row_words = views[0][2].shape[3]
    _digest_kernel[(last - first, len(views))](
        bases, meta, ids, partials,
        first, job.start, job.end, job.start // slot_tokens, job.head_start, job.head_key,
        job.head_end - job.head_start, len(views), block_size, row_words,
        BLOCK_T=block_size, BLOCK_W=triton.next_power_of_2(row_words), UNIT=job.unit, num_warps=NUM_WARPS,
    )
    return partials.view(job.num_units, -1).sum(dim=1) & d.MASK32


_TABLES: dict[int, tuple[list, torch.Tensor, torch.Tensor]] = {}


def _view_table(views: list[tuple[int, int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The views' base addresses and (offset, strides, position key) rows on the device, made once per list of
    views (a rank makes its lists once and keeps them, and its buffers never move)."""
    entry = _TABLES.get(id(views))
    if entry is None or entry[0] is not views:  # the list itself is kept, so its id is not reused meanwhile
        device = views[0][2].device
        bases = torch.tensor([v.untyped_storage().data_ptr() for _, _, v in views], dtype=torch.int64)
        meta = torch.tensor([[v.storage_offset(), *v.stride()[:3], ((layer * d.K_LAYER + kv * d.K_KV) & d.MASK32)]
                             for layer, kv, v in views], dtype=torch.int64)
        if len(_TABLES) >= 64:  # callers without a views cache (tests, tools) make a list per call
            _TABLES.clear()
        entry = _TABLES[id(views)] = (views, bases.to(device), meta.to(device))
    return entry[1], entry[2]
