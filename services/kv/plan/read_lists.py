"""Descriptor lists prepared once per (owner rank, local rank, source), and a pull's indices into them.

Planning a pull's descriptors from scratch and handing NIXL fresh lists costs a few hundred
microseconds of Python per pull, more than a small GPU copy. But between two engines only the block
ids change from pull to pull: every whole unit (``min(block sizes)`` tokens) of a group is copied by
the same runs (``planner.unit_runs``), shifted by the unit's position on each side. So the lists
enumerate every unit's runs once, on both sides::

    entry (group g, unit u, run k) = base_g + u * K_g + k        (K_g runs per unit)
    remote address = region[run.src_buffer] + run.src_offset + block(u) * block bytes + unit-in-block(u) * unit bytes

NIXL prepares them once (``prep_xfer_dlist``: validity checks and lookups done there, not per READ),
and a pull is ``make_prepped_xfer`` with two index arrays computed from the block tables
(``topology.map_unit_arrays``) in a handful of numpy operations. Ordering the indices as the planner
orders runs (plane by plane for a per-layer source, unit by unit for cross-layer) lets NIXL merge the
runs that continue each other on both sides; where that order is not by source address (shuffled
block ids, a remote block of several units) the indices are sorted by it, as the planner's merge
sorts. :meth:`ListLayout.indices` counts the descriptors NIXL's merge leaves, so the pull's metrics
count what NIXL posts.

A partial last unit is copied whole (the planner's ``pad_partial_blocks``): a pull's last block is its
own and decode overwrites the slots past the prompt. Layouts whose lists would exceed
``MAX_ENTRIES`` (per-layer KV of a big pool, or token-major head slices: a run per token) are not
prepared; the puller plans those pulls with the planner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.kv.plan.planner import UnitRuns, unit_runs
from services.kv.plan.spec_pair import Nesting
from services.kv.spec.layout import KVLayoutSpec
from services.kv.spec.topology import RankRead
from services.kv.spec.wire import MemoryRegion

#: The most entries one side's list may hold (NIXL keeps each as a descriptor: ~10-20 MB at this size).
MAX_ENTRIES = 1 << 18
_BUFFER_SHIFT = 44  # a merge key is buffer index << 44 | offset, so runs never merge across buffers


@dataclass(frozen=True, eq=False)
class _Group:
    runs: UnitRuns
    remote_base: int
    local_base: int
    unit_bytes: int
    # Run indices in the order a pull posts them around its units (``Nesting``): [planes, grid] (units between
    # the two), [grid, planes] (heads-outer: units between) or [runs] (units outside).
    run_order: np.ndarray


@dataclass(frozen=True, eq=False)
class ListLayout:
    """Both sides' entries for one (owner rank, local rank, source), and how a pull indexes them.

    ``remote_rows``/``local_rows``: ``[n, 3]`` uint64 (addr, len, device) for ``prep_xfer_dlist``.
    """

    remote_rows: np.ndarray
    local_rows: np.ndarray
    groups: Mapping[int, _Group]
    _remote_keys: np.ndarray
    _local_keys: np.ndarray
    _remote_lengths: np.ndarray

    def indices(self, units: Mapping[int, tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(local indices, remote indices, bytes, descriptors after NIXL's merge) of a pull whose groups
        read ``units[g]`` = (remote unit ids, local unit ids); the indices are int32, as NIXL takes them."""
        remote, local, num_bytes = [], [], 0
        for gid, (u_r, u_l) in units.items():
            g = self.groups[gid]
            num_bytes += int(u_r.size) * g.unit_bytes
            k = g.run_order
            if k.size == 1:
                remote.append(u_r + g.remote_base)
                local.append(u_l + g.local_base)
            elif k.ndim == 2:  # [planes, units, grid] (per-layer) or [grid, units, planes] (heads-outer)
                remote.append((k[:, None, :] + (u_r * k.size + g.remote_base)[None, :, None]).ravel())
                local.append((k[:, None, :] + (u_l * k.size + g.local_base)[None, :, None]).ravel())
            else:  # [units, runs]
                remote.append((k[None, :] + (u_r * k.size + g.remote_base)[:, None]).ravel())
                local.append((k[None, :] + (u_l * k.size + g.local_base)[:, None]).ravel())
        r = remote[0] if len(remote) == 1 else np.concatenate(remote)
        q = local[0] if len(local) == 1 else np.concatenate(local)
        if r.size < 2:
            return q.astype(np.int32), r.astype(np.int32), num_bytes, int(r.size)
        keys = self._remote_keys[r]
        if (keys[1:] < keys[:-1]).any():  # e.g. shuffled block ids: by source address, as the planner merges
            order = np.argsort(keys, kind="stable")
            r, q, keys = r[order], q[order], keys[order]
        # Descriptors left once runs continuing each other on both sides are merged (NIXL's rule).
        length, local_keys = self._remote_lengths[r], self._local_keys[q]
        joins = (keys[:-1] + length[:-1] == keys[1:]) & (local_keys[:-1] + length[:-1] == local_keys[1:])
        return q.astype(np.int32), r.astype(np.int32), num_bytes, int(r.size - np.count_nonzero(joins))


def list_layout(remote: KVLayoutSpec, remote_regions: Sequence[MemoryRegion], local: KVLayoutSpec,
                local_regions: Sequence[MemoryRegion], group_reads: Mapping[int, RankRead],
                max_entries: int = MAX_ENTRIES) -> ListLayout | None:
    """The lists for reading ``group_reads`` of the owner rank (``remote`` spec and regions) into the local
    rank; None when either side would exceed ``max_entries`` entries. Specs are checked as the planner
    checks them (a pair it refuses raises ValueError here too)."""
    per_group = {}
    sizes = [0, 0]
    for gid, read in group_reads.items():
        runs = unit_runs(remote, local, gid, read)
        if runs is None:
            continue
        k = runs.length.size
        units = [spec.num_blocks * (spec.block_size(gid) // runs.unit) for spec in (remote, local)]
        per_group[gid] = (runs, sizes[0], sizes[1])
        sizes = [sizes[0] + units[0] * k, sizes[1] + units[1] * k]
        if max(sizes) > max_entries:
            return None
    if not per_group:
        return None
    src_table = _region_table(remote_regions)
    dst_table = _region_table(local_regions)
    rows = ([], [])
    keys = ([], [])
    lengths = []
    groups = {}
    for gid, (runs, r_base, l_base) in per_group.items():
        for side, spec, table in ((0, remote, src_table), (1, local, dst_table)):
            buf, off = (runs.src_buffer, runs.src_offset) if side == 0 else (runs.dst_buffer, runs.dst_offset)
            block, unit = (runs.src_block_bytes, runs.src_unit_bytes) if side == 0 else \
                (runs.dst_block_bytes, runs.dst_unit_bytes)
            per_block = spec.block_size(gid) // runs.unit
            u = np.arange(spec.num_blocks * per_block, dtype=np.int64)
            unit_off = (u // per_block) * block + (u % per_block) * unit
            offset = (unit_off[:, None] + off[None, :]).ravel()
            buffers = np.tile(buf, u.size)
            rows[side].append(np.stack([table[buffers, 0] + offset, np.tile(runs.length, u.size),
                                        table[buffers, 1]], axis=1))
            keys[side].append((buffers << _BUFFER_SHIFT) + offset)
            if side == 0:
                lengths.append(np.tile(runs.length, u.size))
        k = runs.length.size
        runs_2d = np.arange(k, dtype=np.int64).reshape(runs.num_planes, k // runs.num_planes)  # [planes, grid]
        order = {Nesting.PLANE_PIECE_GRID: runs_2d, Nesting.GRID_PIECE_PLANE: np.ascontiguousarray(runs_2d.T)
                 }.get(runs.nesting, np.arange(k, dtype=np.int64))
        groups[gid] = _Group(runs, r_base, l_base, int(runs.length.sum()), order)
    remote_rows, local_rows = (np.ascontiguousarray(np.concatenate(r), dtype=np.uint64) for r in rows)
    return ListLayout(remote_rows, local_rows, groups, np.concatenate(keys[0]), np.concatenate(keys[1]),
                      np.concatenate(lengths))


def _region_table(regions: Sequence[MemoryRegion]) -> np.ndarray:
    """``[buffers, 2]`` int64 (base address, device id) by buffer index."""
    ordered = sorted(regions, key=lambda r: r.buffer_index)
    return np.array([(r.address, r.device_id) for r in ordered], dtype=np.int64).reshape(-1, 2)
