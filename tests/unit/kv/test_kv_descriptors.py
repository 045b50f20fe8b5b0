"""Descriptor arrays and READ pairing checks, before anything reaches NIXL (pure logic, no agent)."""

from __future__ import annotations

import numpy as np
import pytest

from services.kv.nixl.descriptors import (
    RegisteredRegion,
    as_descriptor_array,
    check_pairing,
    peer_name_from_metadata,
    region_of,
)


def test_descriptor_lists_convert_without_copying_rows() -> None:
    rows = [(4096 * i + 1, 16, 0) for i in range(40_000)]
    arr = as_descriptor_array(rows, "local")
    assert arr.dtype == np.uint64 and arr.flags.c_contiguous and arr.shape == (40_000, 3)
    already = np.ascontiguousarray(arr)
    assert as_descriptor_array(already, "local") is already  # no copy for the fast path
    with pytest.raises(ValueError, match="length 0"):
        as_descriptor_array([(1, 0, 0)], "remote")


def test_bad_descriptor_arrays_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="negative"):
        as_descriptor_array(np.array([[1, -5, 0]]), "local")
    with pytest.raises(ValueError, match=r"\[n, 3\]"):
        as_descriptor_array(np.zeros((2, 2), np.int64), "local")
    with pytest.raises(ValueError, match="integers"):
        as_descriptor_array(np.zeros((1, 3), np.float64), "remote")


def test_pairing_needs_equal_counts_and_lengths_row_by_row() -> None:
    loc, rem = (4096, 64, 0), (8192, 64, 0)
    check_pairing(as_descriptor_array([loc], "local"), as_descriptor_array([rem], "remote"))
    with pytest.raises(ValueError, match="2 local descriptors but 1 remote"):
        check_pairing(as_descriptor_array([loc, loc], "local"), as_descriptor_array([rem], "remote"))
    with pytest.raises(ValueError, match="descriptor 1 length mismatch: local 64 bytes, remote 32 bytes"):
        check_pairing(as_descriptor_array([loc, loc], "local"), as_descriptor_array([rem, (8192, 32, 0)], "remote"))


def test_peer_name_is_read_from_the_metadata_header() -> None:
    name = "owner-tp0"
    metadata = b"nixlSerDes|Agent" + len(name).to_bytes(8, "little") + name.encode() + b"rest"
    assert peer_name_from_metadata(metadata) == name
    assert peer_name_from_metadata(b"something else") is None
    assert peer_name_from_metadata(metadata[:20]) is None  # truncated name


def test_raw_regions_are_validated() -> None:
    region, keep = region_of((4096, 64, 0, "DRAM"))
    assert region == RegisteredRegion(4096, 64, 0, "DRAM") and keep is None
    with pytest.raises(ValueError, match="memory kind"):
        region_of((4096, 64, 0, "SSD"))
    with pytest.raises(ValueError, match="invalid region"):
        region_of((0, 64, 0, "DRAM"))
    with pytest.raises(ValueError, match="cannot register"):
        region_of("a string")
