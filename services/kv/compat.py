"""KV compatibility: the fields that must be equal for two engines' KV bytes to mean the same.

The hash travels WITH the fields it was computed from, so a mismatch names every differing
field and both values instead of failing as an opaque hash inequality.

Hashed: protocol version, architecture, layer count, total KV heads, head dim, dtype, the
within-block layout (``kv_layout``: NHD or HND, which fixes what a page's bytes mean), the KV-cache
groups (kind, window, layers) and KV sharing between layers.

Not hashed, because they are reconciled rather than required equal: block size (one must divide
the other; see topology.py), TP size (head slices are mapped), and block placement (per-layer or
cross-layer buffers: the planner addresses either through the layout spec).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.kv.groups import KVCacheGroupSpec
from services.kv.layout import KVLayoutSpec

PROTOCOL_VERSION = 1


class KVCompatibilityError(ValueError):
    """Two engines cannot exchange KV. ``differences`` maps field -> (local, remote)."""

    def __init__(self, message: str, differences: Mapping[str, tuple[str | None, str | None]] | None = None):
        super().__init__(message)
        self.differences = dict(differences or {})


@dataclass(frozen=True)
class CompatInfo:
    """The canonical compatibility fields (all strings, for the wire) and their hash."""

    fields: Mapping[str, str]
    hash: str

    @classmethod
    def of(cls, fields: Mapping[str, str]) -> CompatInfo:
        return cls(dict(fields), compat_hash(fields))


def compat_fields(
    *,
    architecture: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    layout: KVLayoutSpec,
    kv_sharing: Mapping[int, int] | None = None,
    protocol_version: int = PROTOCOL_VERSION,
) -> dict[str, str]:
    """Canonical string form of everything that must match. ``num_kv_heads`` is the model total."""
    return {
        "protocol_version": str(protocol_version),
        "architecture": architecture,
        "num_layers": str(num_layers),
        "num_kv_heads": str(num_kv_heads),
        "head_dim": str(head_dim),
        "dtype": layout.dtype,
        "kv_layout": layout.order.value,
        "kv_groups": _groups_field(layout.groups),
        "kv_sharing": json.dumps(sorted((kv_sharing or {}).items())),
    }


def _groups_field(groups: Sequence[KVCacheGroupSpec]) -> str:
    # Block size is deliberately left out: it is reconciled by the block-size ratio.
    return json.dumps([[g.kind.value, g.sliding_window, list(g.layer_ids)] for g in groups])


def compat_hash(fields: Mapping[str, str]) -> str:
    canonical = json.dumps(sorted(fields.items()), separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


def check_compatible(local: CompatInfo, remote_fields: Mapping[str, str], remote_hash: str) -> None:
    """Raise KVCompatibilityError naming each differing field with both values.

    The remote hash is first checked against its own fields, so a peer whose fields and hash
    disagree (a bug, or a forged answer) is refused too.
    """
    if compat_hash(remote_fields) != remote_hash:
        raise KVCompatibilityError(
            f"peer's compatibility hash {remote_hash[:12]} does not match the fields it sent "
            f"({compat_hash(remote_fields)[:12]})"
        )
    if remote_hash == local.hash:
        return
    keys = sorted(set(local.fields) | set(remote_fields))
    pairs = {k: (local.fields.get(k), remote_fields.get(k)) for k in keys}
    diffs = {k: (a, b) for k, (a, b) in pairs.items() if a != b}
    detail = "; ".join(f"{k}: local {a!r} vs remote {b!r}" for k, (a, b) in diffs.items())
    raise KVCompatibilityError(f"KV caches are incompatible: {detail}", diffs)
