"""The KV digest on the device: one Triton kernel per job, reading each word once.

Same arithmetic as ``scheme.py``'s host path (which the tests compare it with, here under Triton's
CPU interpreter and on a GPU): a program takes one (block, layer and K/V) and walks its heads in
``[block_size, words per row]`` tiles of 32-bit words, mixes each word with its position key and adds
it into a tile of uint32 accumulators (wrapping, as the digest's sum does), reduces that tile once
(dropping the tokens outside the job's range there, once per token, not per word),
and adds the sums of its units (or of its block) into the job's slots (an atomic add per slot and program:
the slots are in [0, 2**38), so int64 never wraps, and the host masks them to 32 bits). ``CudaDigests``
runs a list of jobs with few device calls, because each is 10-50 us of host time, more than the kernel
itself at short prompts (a digest of 512 tokens reads 64 MiB in ~20 us): a copy of the block ids that are
not one run from pinned memory (a run of consecutive blocks, which a pull of the free-run allocator's blocks
mostly is, goes as its first id), a fill of the slots, the launches, one copy of the slots back. Layers reach
the kernel as a table of base addresses and strides, so per-layer and cross-layer buffers, NHD and HND blocks
take the same launch. Rows whose addresses and strides are multiples of 16 bytes (every usual layout) are read four
words a load: on an H200 under Nsight Compute that took the kernel from 85% to 55% of the SMs' issue rate and
from 81% to 88% of DRAM bandwidth (a 32k-token pull's 4 GiB in 1.01 against 1.11 ms at base clocks; at boost
clocks both are at the memory's rate), which matters when the digest shares the SMs with a prefill.
Imported only when a CUDA digest runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from services.kv.digest import scheme as d
from services.kv.plan.staging import count_runs

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
WORD_ALIGN = 4  # 32-bit words per 16 bytes: a row whose address is a multiple of it is read in 128-bit loads


# Token ranges, heads and slots change per request: not specialised on, so a new value never recompiles.
@triton.jit(do_not_specialize=["first_block", "run_start", "start", "end", "first_unit", "head_start", "head_key",
                               "num_heads"])
def _digest_kernel(
    Bases, Meta, BlockIds, Out,
    first_block, run_start, start, end, first_unit, head_start, head_key, num_heads,
    block_size, row_words,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, UNIT: tl.constexpr, ALIGN: tl.constexpr, EVEN_W: tl.constexpr,
    RUN: tl.constexpr,
):
    """Grid (blocks, layer views). ``Meta[v]`` = (offset, block stride, token stride, head stride, position
    key of the view's layer and K/V), in 32-bit words; ``Bases[v]`` the view's buffer address. Each program
    walks its block's heads and adds the sums of its slots (units, or its block when a unit spans blocks)
    into ``Out``. Its block is ``BlockIds[blk]``, or ``run_start + blk`` when ``RUN`` (the job's blocks are
    consecutive).

    Every row of the block is read, in range or not (a block is whole in memory), and a token's sum is
    dropped at the end when it is outside ``[start, end)``: one select per token, not one per word.
    ``ALIGN``: the words every address and stride is a multiple of (``WORD_ALIGN`` lets a thread read four
    words in one load); ``EVEN_W``: a row is ``BLOCK_W`` words, so no word is masked."""
    blk = tl.program_id(0)
    v = tl.program_id(1)
    if RUN:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        block_id = (run_start + blk).to(tl.int64)
    else:
        block_id = tl.load(BlockIds + blk).to(tl.int64)
    offset = tl.multiple_of(tl.load(Meta + v * 5 + 0), ALIGN)
    block_stride = tl.multiple_of(tl.load(Meta + v * 5 + 1), ALIGN)
    token_stride = tl.multiple_of(tl.load(Meta + v * 5 + 2), ALIGN)
    head_stride = tl.multiple_of(tl.load(Meta + v * 5 + 3), ALIGN)
    base_key = tl.load(Meta + v * 5 + 4).to(tl.uint32)
    base = tl.multiple_of(tl.load(Bases + v).to(tl.pointer_type(tl.int32)), ALIGN * 4)
    t = tl.arange(0, BLOCK_T)
    words = tl.arange(0, BLOCK_W)
    token = (first_block + blk) * block_size + t
    row_ok = (token >= start) & (token < end)
    tile = t[:, None].to(tl.int64) * token_stride + words[None, :]
    # The position key without its head term, once per program: a head adds K_HEAD to every word's key.
    key = (base_key + token.to(tl.uint32) * _K_TOKEN + (head_key.to(tl.uint32) * _K_HEAD))[:, None] + \
        words.to(tl.uint32)[None, :] * _K_DIM
    rows = base + offset + block_id * block_stride + head_start.to(tl.int64) * head_stride + tile
    acc = tl.zeros((BLOCK_T, BLOCK_W), dtype=tl.uint32)
    if EVEN_W:  # the usual head_dim: no mask at all
        for _ in range(num_heads):
            acc += _mix(tl.load(rows).to(tl.uint32) ^ key)
            rows += head_stride
            key += _K_HEAD
    else:
        word_ok = (words < row_words)[None, :]
        for _ in range(num_heads):
            acc += _mix(tl.load(rows, mask=word_ok, other=0).to(tl.uint32) ^ key)
            rows += head_stride
            key += _K_HEAD
        acc = tl.where(word_ok, acc, 0)
    sums = tl.where(row_ok, tl.sum(acc, axis=1), 0)  # per token, wrapping mod 2**32
    if UNIT >= BLOCK_T:  # a slot per block (a unit holds one or more blocks)
        tl.atomic_add(Out + blk, tl.sum(sums, axis=0).to(tl.int64), sem="relaxed")
    else:  # a slot per unit
        per_unit = tl.sum(tl.reshape(sums, (BLOCK_T // UNIT, UNIT)), axis=1).to(tl.int64)
        units = ((first_block + blk) * block_size) // UNIT + tl.arange(0, BLOCK_T // UNIT)
        slot = units - first_unit
        unit_ok = (tl.arange(0, BLOCK_T // UNIT) * UNIT < block_size) & (slot >= 0) & (units * UNIT < end)
        tl.atomic_add(Out + slot, per_unit, mask=unit_ok, sem="relaxed")


def digest_units_cuda(views: list[tuple[int, int, torch.Tensor]], block_size: int, job: d.DigestJob
                      ) -> torch.Tensor:
    """int64 [num_units] (each in [0, 2**32)) of ``job`` over ``views`` (``scheme.layer_views``), on the host:
    ``CudaDigests`` for one job (tests and tools; a rank keeps a ``CudaDigests``)."""
    return torch.from_numpy(CudaDigests(views[0][2].device).run([(views, block_size, job)])[0].view(np.int64))


class CudaDigests:
    """Runs digest jobs on one device through reused buffers: pinned host memory for the block ids and the
    cells, device memory for both, grown by doubling (a pinned allocation costs milliseconds, so only the
    first pulls of a new size pay it). Not thread-safe: a rank's ``DigestRunner`` holds a lock around it.
    On a CPU device (Triton's interpreter, in tests) the buffers are plain and nothing is waited for."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._ids: tuple[torch.Tensor, torch.Tensor] | None = None  # block ids: (pinned host, device)
        self._cells: tuple[torch.Tensor, torch.Tensor] | None = None  # the kernel's cells: (pinned host, device)
        self._done = torch.cuda.Event() if self._pinned else None

    def run(self, items: Sequence[tuple[list[tuple[int, int, torch.Tensor]], int, d.DigestJob]]
            ) -> list[np.ndarray]:
        """Each job's unit digests (uint64, masked), on the current stream, waiting for them. A block size or
        unit that is not a power of two takes the host path."""
        plans = []  # per item: (first block, end block, ids offset or None (a run), its first id, slots offset, slots)
        num_ids = num_slots = 0
        for _, block_size, job in items:
            first, last = job.start // block_size, -(-job.end // block_size)
            ids = np.asarray(job.block_ids[first:last], dtype=np.int64)
            run_start = _run_start(ids)
            slots = last - first if job.unit >= block_size else job.num_units
            plans.append((first, last, None if run_start is not None else num_ids, run_start or 0, num_slots, slots,
                          ids))
            num_ids += 0 if run_start is not None else len(ids)
            num_slots += slots
        ids_host, ids_dev = self._ids = self._room(self._ids, num_ids, 256)
        cells_host, cells_dev = self._cells = self._room(self._cells, num_slots, 4096)
        if num_ids:
            ids_np = ids_host.numpy()
            for _, _, at, _, _, _, ids in plans:
                if at is not None:
                    ids_np[at:at + len(ids)] = ids
            ids_dev[:num_ids].copy_(ids_host[:num_ids], non_blocking=True)
        cells_dev[:num_slots].zero_()
        for (views, block_size, job), (first, last, at, run_start, slot_at, _, _) in zip(items, plans, strict=True):
            if last == first or _host_only(block_size, job):
                continue
            bases, meta, align = _view_table(views)
            row_words = views[0][2].shape[3]
            block_w = triton.next_power_of_2(row_words)
            _digest_kernel[(last - first, len(views))](
                bases, meta, ids_dev[at or 0:], cells_dev[slot_at:],
                first, run_start, job.start, job.end, job.start // job.unit, job.head_start, job.head_key,
                job.head_end - job.head_start, block_size, row_words,
                BLOCK_T=block_size, BLOCK_W=block_w, UNIT=job.unit, ALIGN=align, EVEN_W=block_w == row_words,
                RUN=at is None, num_warps=NUM_WARPS,
            )
        cells_host[:num_slots].copy_(cells_dev[:num_slots], non_blocking=True)
        if self._done is not None:
            self._done.record()
            self._done.synchronize()
        cells = cells_host.numpy().view(np.uint64)
        out = []
        for (views, block_size, job), (first, last, _, _, slot_at, slots, _) in zip(items, plans, strict=True):
            if _host_only(block_size, job):
                out.append(d.digest_units_host(views, block_size, job).numpy().view(np.uint64))
            elif last == first:
                out.append(np.zeros(job.num_units, np.uint64))
            else:
                sums = cells[slot_at:slot_at + slots]
                if job.unit > block_size:  # blocks into units (the last unit may hold fewer blocks)
                    sums = np.add.reduceat(sums, np.arange(0, slots, job.unit // block_size))
                out.append(sums & np.uint64(d.MASK32))
        return out

    def _room(self, pair: tuple[torch.Tensor, torch.Tensor] | None, n: int, smallest: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """A (host, device) pair of int64 buffers of at least ``n`` entries: ``pair`` when it has them, else
        new ones of the next power of two (``smallest`` at least)."""
        if pair is None or len(pair[0]) < n:
            size = 1 << max(n - 1, smallest - 1).bit_length()
            pair = (torch.empty(size, dtype=torch.int64, pin_memory=self._pinned),
                    torch.empty(size, dtype=torch.int64, device=self.device))
        return pair


def _run_start(ids: np.ndarray) -> int | None:
    """The first of ``ids`` when they are consecutive (one run of blocks), else None."""
    return int(ids[0]) if count_runs(ids) == 1 else None


def _host_only(block_size: int, job: d.DigestJob) -> bool:
    """The kernel walks power-of-two blocks and units only."""
    return bool(block_size & (block_size - 1) or job.unit & (job.unit - 1))


_TABLES: dict[int, tuple[list, torch.Tensor, torch.Tensor, int]] = {}


def _view_table(views: list[tuple[int, int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The views' base addresses and (offset, strides, position key) rows on the device, and the words every
    address and stride is a multiple of (at most ``WORD_ALIGN``), made once per list of views (a rank makes its
    lists once and keeps them, and its buffers never move)."""
    entry = _TABLES.get(id(views))
    if entry is None or entry[0] is not views:  # the list itself is kept, so its id is not reused meanwhile
        device = views[0][2].device
        addresses = [v.untyped_storage().data_ptr() for _, _, v in views]
        rows = [[v.storage_offset(), *v.stride()[:3], ((layer * d.K_LAYER + kv * d.K_KV) & d.MASK32)]
                for layer, kv, v in views]
        align = math.gcd(WORD_ALIGN, *(a // 4 for a in addresses), *(x for r in rows for x in r[:4]))
        bases = torch.tensor(addresses, dtype=torch.int64)
        meta = torch.tensor(rows, dtype=torch.int64)
        if len(_TABLES) >= 64:  # callers without a views cache (tests, tools) make a list per call
            _TABLES.clear()
        entry = _TABLES[id(views)] = (views, bases.to(device), meta.to(device), align)
    return entry[1], entry[2], entry[3]
