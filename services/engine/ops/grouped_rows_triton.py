"""Which rows of a grouped expert GEMM a program owns, shared by the Triton grouped GEMMs (``moe_gemm_triton``,
``fp8_moe_triton``, ``mxfp4_moe_triton``).

Their rows are (token, expert) pairs sorted by expert, ``ends`` [E] each expert's end row. The rows are cut into
``BLOCK_M``-row tiles expert by expert (a tile never holds two experts' rows), and program ``tile`` of the grid's
first axis finds its tile's expert and rows from ``ends`` itself: no host sync (a decode step with it is captured
in a CUDA graph) and no tile map built by small launches first. ``row_tiles`` sizes that axis for the worst case.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_tile(Ends, num_experts, tile, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Row tile ``tile``: (its expert, or ``num_experts`` past the last tile; its first row; the expert's end
    row). ``BLOCK_E`` is a power of two >= ``num_experts``."""
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(Ends + e, mask=e < num_experts, other=0)
    starts = tl.load(Ends + e - 1, mask=(e > 0) & (e < num_experts), other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    expert = tl.sum((tile_ends <= tile).to(tl.int32), 0)
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0), 0)
    first = tl.sum(tl.where(mine, starts, 0), 0) + (tile - first_tile) * BLOCK_M
    return expert, first, tl.sum(tl.where(mine, ends, 0), 0)


def row_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """How many row tiles ``num_rows`` rows over ``num_experts`` can make at most: every expert's whole tiles
    (``num_rows // block_m`` in all) plus one partial tile per expert with rows, and never more tiles than rows
    (at decode, 6 rows over 64 experts: 6 programs per column tile, not 64)."""
    return min(num_rows, num_rows // block_m + min(num_experts, num_rows))
