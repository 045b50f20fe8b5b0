"""Registered regions and the descriptor arrays a READ takes, checked before NIXL sees them.

A descriptor is an (address, length, device id) row. NIXL 1.5.1 wants a C-contiguous uint64/int64
array and takes a slower element-wise path for int64 (~15x when building the list), so arrays are
converted to contiguous uint64 once (:func:`as_descriptor_array`). A READ copies remote row i into
local row i (:func:`check_pairing`). NIXL refuses a known peer name with new metadata (a restarted
peer), so the name is read from the metadata header (:func:`peer_name_from_metadata`) to replace it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

MemKind = Literal["DRAM", "VRAM"]
DescriptorsLike = Sequence[tuple[int, int, int]] | np.ndarray
RegionLike = Any  # a torch.Tensor, a RegisteredRegion, or an (addr, length, device_id, kind) tuple

MEM_KINDS: tuple[MemKind, ...] = ("DRAM", "VRAM")
_MD_HEADER = b"nixlSerDes|Agent"  # nixl's metadata starts: header, u64-le name length, name


@dataclass(frozen=True)
class RegisteredRegion:
    """A registered buffer as a peer needs to see it (goes on the wire in the handshake)."""

    addr: int
    length: int
    device_id: int
    mem_kind: MemKind


def as_descriptor_array(descs: DescriptorsLike, side: str) -> np.ndarray:
    """(addr, len, dev) rows as the C-contiguous uint64 [n, 3] array NIXL copies without a Python loop."""
    try:
        arr = descs if isinstance(descs, np.ndarray) else np.asarray(descs, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{side} descriptors must be (addr, len, dev) integer triples: {exc}") from None
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] == 0:
        raise ValueError(f"{side} descriptors must be a non-empty [n, 3] (addr, len, dev) list, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{side} descriptors must be integers, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.signedinteger) and arr.min() < 0:
        row = int(np.argmin(arr.min(axis=1)))
        raise ValueError(f"{side} descriptor {row} has a negative field: {arr[row].tolist()}")
    if (arr[:, 1] == 0).any():
        raise ValueError(f"{side} descriptor {int(np.argmin(arr[:, 1]))} has length 0")
    return np.ascontiguousarray(arr, dtype=np.uint64)


def check_pairing(local: np.ndarray, remote: np.ndarray) -> None:
    """A READ copies remote row i into local row i, so counts and lengths must match row by row."""
    if local.shape[0] != remote.shape[0]:
        raise ValueError(f"{local.shape[0]} local descriptors but {remote.shape[0]} remote descriptors")
    bad = np.flatnonzero(local[:, 1] != remote[:, 1])
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"descriptor {i} length mismatch: local {int(local[i, 1])} bytes, remote {int(remote[i, 1])} bytes "
            f"({bad.size} mismatched rows)"
        )


def peer_name_from_metadata(metadata: bytes) -> str | None:
    """The agent name at the head of nixl's serialized metadata, or None if the format is unexpected."""
    start = len(_MD_HEADER)
    if not metadata.startswith(_MD_HEADER) or len(metadata) < start + 8:
        return None
    size = int.from_bytes(metadata[start : start + 8], "little")
    raw = metadata[start + 8 : start + 8 + size]
    if len(raw) != size:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def region_of(item: RegionLike) -> tuple[RegisteredRegion, Any]:
    """(region, object to keep alive) for a tensor, a RegisteredRegion or a raw 4-tuple; ValueError if unfit."""
    if isinstance(item, RegisteredRegion):
        region, keep = item, None
    elif hasattr(item, "data_ptr") and hasattr(item, "is_contiguous"):
        region, keep = tensor_region(item), item
    elif isinstance(item, tuple) and len(item) == 4:
        region, keep = RegisteredRegion(int(item[0]), int(item[1]), int(item[2]), item[3]), None
    else:
        raise ValueError(f"cannot register {type(item).__name__}: expected a tensor or (addr, length, device_id, kind)")
    if region.mem_kind not in MEM_KINDS:
        raise ValueError(f"memory kind must be one of {MEM_KINDS}, got {region.mem_kind!r}")
    if region.addr <= 0 or region.length <= 0 or region.device_id < 0:
        raise ValueError(f"invalid region {region}: address and length must be > 0, device_id >= 0")
    return region, keep


def tensor_region(tensor: Any) -> RegisteredRegion:
    """The one address range a contiguous cpu (DRAM) or cuda (VRAM) tensor occupies."""
    if not tensor.is_contiguous():
        raise ValueError(
            f"cannot register a non-contiguous tensor (shape {tuple(tensor.shape)}, stride {tensor.stride()}): "
            "NIXL registers one address range"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot register a tensor on {tensor.device}: only cpu (DRAM) and cuda (VRAM)")
    if tensor.numel() == 0:
        raise ValueError("cannot register an empty tensor")
    if tensor.device.type == "cuda":
        kind: MemKind = "VRAM"
        device_id = tensor.device.index if tensor.device.index is not None else 0
    else:
        kind, device_id = "DRAM", 0
    return RegisteredRegion(tensor.data_ptr(), tensor.numel() * tensor.element_size(), device_id, kind)


def checked_mem_kinds(mem_kind: str, remote_mem_kind: str | None) -> str:
    """The remote side's memory kind (``mem_kind`` when not given), after checking both are NIXL's."""
    remote_kind = remote_mem_kind or mem_kind
    for kind in (mem_kind, remote_kind):
        if kind not in MEM_KINDS:
            raise ValueError(f"memory kind must be one of {MEM_KINDS}, got {kind!r}")
    return remote_kind
