"""Reading and writing per-request recurrent states in place through slot indices, inside Triton kernels.

A state model's decode step updates, for each batch row, the state in row ``slots[row]`` of a pool
(``kv_cache/state_pool.py``): a conv window ``[slots, channels, width]`` or a matrix state
``[slots, heads, rows, cols]`` (Mamba2's ``[heads, head_dim, d_state]``; a Gated DeltaNet's
``[heads, d_k, d_v]`` has the same shape). Gathering the rows into a batch and scattering them back costs
two copies of every state per layer; a kernel that addresses the slot directly costs none. These are the
pieces such kernels share:

* ``load_slot``: a row's slot and whether the row is real. A row whose slot is negative is padding: every
  load and store of it is masked off, so its memory (whatever slot number it would name) is never touched.
  The engine's CUDA graphs pad with the pool's scratch slot instead (``StatePool.scratch_slot``): such rows
  are ordinary rows to the kernels, and write only that slot.
* ``state_tile_offsets``: the element offsets of a ``[rows, cols]`` tile of one head's state in one slot.
* ``state_strides`` / ``check_slots`` (host): the strides a kernel is given, and the checks that make them
  valid (the pool's views are strided across slots, contiguous inside).

Nothing here syncs with the device: shapes and strides are host integers, slots stay on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_slot(Slots, row):
    """(slot, valid) of batch row ``row``: the slot as int64, clamped to 0 for a padding row (slot < 0) so its
    offsets stay in bounds; ``valid`` is False for such a row, and every access of it must be masked with it."""
    slot = tl.load(Slots + row).to(tl.int64)
    valid = slot >= 0
    return tl.where(valid, slot, 0), valid


@triton.jit
def state_tile_offsets(slot, head, rows, cols, stride_slot, stride_head, stride_row):
    """Offsets of the ``[len(rows), len(cols)]`` tile ``state[slot, head, rows, cols]`` (last dim contiguous)."""
    base = slot * stride_slot + head.to(tl.int64) * stride_head
    return base + rows[:, None].to(tl.int64) * stride_row + cols[None, :]


def state_strides(state: torch.Tensor, ndim: int, name: str) -> tuple[int, ...]:
    """The strides of a pool view ``state`` of ``ndim`` dims (slots first); ValueError unless its last dim is
    contiguous (what ``state_tile_offsets`` assumes)."""
    if state.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims (slots first), got shape {tuple(state.shape)}")
    if state.stride(-1) != 1:
        raise ValueError(f"{name}'s last dim must be contiguous, got strides {state.stride()}")
    return tuple(state.stride())


def check_slots(slots: torch.Tensor, num_rows: int, state: torch.Tensor) -> None:
    """ValueError unless ``slots`` holds one integer slot per batch row on ``state``'s device. (Whether each is
    below the pool's size is not checked: that would need a host sync; the engine's slots always are.)"""
    if slots.ndim != 1 or slots.shape[0] != num_rows:
        raise ValueError(f"slots must be [{num_rows}], got {tuple(slots.shape)}")
    if slots.dtype not in (torch.int32, torch.int64) or slots.device != state.device:
        raise ValueError(f"slots must be int32/int64 on {state.device}, got {slots.dtype} on {slots.device}")
    if slots.stride(0) != 1:
        raise ValueError("slots must be contiguous")
