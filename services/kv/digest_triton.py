"""The KV digest on the device: one Triton kernel per job, reading each element once.

Same arithmetic as ``digest.py``'s host path (which the tests compare it with, here under Triton's
CPU interpreter and on a GPU): a program takes one (block, layer and K/V) and walks its heads in
``[block_size, head_dim]`` tiles, mixes each element with its position key, sums each row's terms
exactly in two int32 halves, and writes each unit's sum to a cell of its own (no atomics); a
torch sum over the cells gives the units (int64, wrapping like the host sums).
Layers reach the kernel as a table of base addresses and strides, so per-layer and cross-layer
buffers, NHD and HND blocks take the same launch. Imported only when a CUDA digest runs.
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


# Token ranges, heads and slots change per request: not specialised on, so a new value never recompiles.
@triton.jit(do_not_specialize=["first_block", "start", "end", "first_slot", "head_start", "head_key", "num_heads",
                               "out_stride"])
def _digest_kernel(
    Bases, Meta, BlockIds, Out,
    first_block, start, end, first_slot, head_start, head_key, num_heads, out_stride,
    block_size, head_dim,
    IS_16BIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, UNIT: tl.constexpr,
):
    """Grid (blocks, layer views). ``Meta[v]`` = (offset, block stride, token stride, head stride, position
    key of the view's layer and K/V), in elements; ``Bases[v]`` the view's buffer address. Each program
    walks its block's heads and writes the partial sums of its slots (units, or its block when a unit
    spans blocks) to its own column of ``Out``, so nothing contends (the caller adds rows and columns)."""
    blk = tl.program_id(0)
    v = tl.program_id(1)
    block_id = tl.load(BlockIds + first_block + blk).to(tl.int64)
    offset = tl.load(Meta + v * 5 + 0)
    block_stride = tl.load(Meta + v * 5 + 1)
    token_stride = tl.load(Meta + v * 5 + 2)
    head_stride = tl.load(Meta + v * 5 + 3)
    base_key = tl.load(Meta + v * 5 + 4).to(tl.uint32)
    t = tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    token = (first_block + blk) * block_size + t
    row_ok = (t < block_size) & (token >= start) & (token < end)
    mask = row_ok[:, None] & (dims < head_dim)[None, :]
    tile = t[:, None].to(tl.int64) * token_stride + dims[None, :]
    row_key = base_key + token.to(tl.uint32) * _K_TOKEN
    dim_key = dims.to(tl.uint32) * _K_DIM
    # Per row, the 16-bit halves of the terms summed in int32 (exact: < 2**16 * head_dim), joined once.
    lo = tl.zeros((BLOCK_T,), dtype=tl.int32)
    hi = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for h in range(num_heads):
        elem = offset + block_id * block_stride + (head_start + h) * head_stride
        if IS_16BIT:
            base = tl.load(Bases + v).to(tl.pointer_type(tl.int16))
            bits = tl.load(base + elem + tile, mask=mask, other=0).to(tl.uint16).to(tl.uint32)
        else:
            base = tl.load(Bases + v).to(tl.pointer_type(tl.int32))
            bits = tl.load(base + elem + tile, mask=mask, other=0).to(tl.uint32)
        key = (row_key + (head_key + h).to(tl.uint32) * _K_HEAD)[:, None] + dim_key[None, :]
        terms = tl.where(mask, _mix(bits ^ key), 0)
        lo += tl.sum((terms & 0xFFFF).to(tl.int32), axis=1)
        hi += tl.sum((terms >> 16).to(tl.int32), axis=1)
    rows = lo.to(tl.int64) + (hi.to(tl.int64) << 16)
    if UNIT >= BLOCK_T:  # a slot per block (a unit holds one or more blocks)
        slot = first_block + blk - first_slot
        tl.store(Out + slot * out_stride + v, tl.sum(rows, axis=0))
    else:  # a slot per unit
        per_unit = tl.sum(tl.reshape(rows, (BLOCK_T // UNIT, UNIT)), axis=1)
        units = ((first_block + blk) * block_size) // UNIT + tl.arange(0, BLOCK_T // UNIT)
        slot = units - first_slot
        unit_ok = (tl.arange(0, BLOCK_T // UNIT) * UNIT < block_size) & (slot >= 0) & (units * UNIT < end)
        tl.store(Out + slot * out_stride + v, per_unit, mask=unit_ok)


def digest_units_cuda(views: list[tuple[int, int, torch.Tensor]], block_size: int, job: d.DigestJob
                      ) -> torch.Tensor:
    """int64 [num_units] of ``job`` over ``views`` (``digest.layer_views``), one launch; the host path for
    shapes the kernel does not take (a block size or unit that is not a power of two, rows of more than
    2**15 elements)."""
    pow2 = block_size & (block_size - 1) == 0 and job.unit & (job.unit - 1) == 0
    # A row's 16-bit halves are summed in int32: exact up to 2**15 terms per row.
    if not pow2 or (job.head_end - job.head_start) * views[0][2].shape[3] > 1 << 15:
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
    head_dim = views[0][2].shape[3]
    _digest_kernel[(last - first, len(views))](
        bases, meta, ids, partials,
        first, job.start, job.end, job.start // slot_tokens, job.head_start, job.head_key,
        job.head_end - job.head_start, len(views), block_size, head_dim,
        IS_16BIT=views[0][2].element_size() == 2, BLOCK_T=block_size, BLOCK_D=triton.next_power_of_2(head_dim),
        UNIT=job.unit,
    )
    return partials.view(job.num_units, -1).sum(dim=1)


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _view_table(views: list[tuple[int, int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The views' base addresses and (offset, strides, position key) rows on the device, made once per set of
    views (a rank's buffers never move)."""
    # Everything the table holds is in the key, so a reused address can only find the right table.
    key = (views[0][2].device, *((layer, kv, v.untyped_storage().data_ptr(), v.storage_offset(), v.stride())
                                 for layer, kv, v in views))
    table = _TABLES.get(key)
    if table is None:
        device = views[0][2].device
        bases = torch.tensor([v.untyped_storage().data_ptr() for _, _, v in views], dtype=torch.int64)
        meta = torch.tensor([[v.storage_offset(), *v.stride()[:3], ((layer * d.K_LAYER + kv * d.K_KV) & d.MASK32)]
                             for layer, kv, v in views], dtype=torch.int64)
        table = _TABLES[key] = (bases.to(device), meta.to(device))
    return table
