"""Conversions between the KV value types and their protobuf messages (services/proto_gen); notification keys; a
ticket's signature and the hash that binds it to its prompt."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec, MambaShape, StateGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind
from services.proto_gen.pdserve.v1 import kv_pb2

_KIND_TO_PB = {AttentionKind.FULL: kv_pb2.FULL, AttentionKind.SLIDING_WINDOW: kv_pb2.SLIDING_WINDOW,
               AttentionKind.MLA: kv_pb2.MLA}
_LAYOUT_TO_PB = {LayoutKind.PER_LAYER: kv_pb2.PER_LAYER, LayoutKind.CROSS_LAYER: kv_pb2.CROSS_LAYER,
                 LayoutKind.HEADS_OUTER: kv_pb2.HEADS_OUTER}
_ORDER_TO_PB = {BlockOrder.NHD: kv_pb2.NHD, BlockOrder.HND: kv_pb2.HND}
_MEM_TO_PB = {"DRAM": kv_pb2.DRAM, "VRAM": kv_pb2.VRAM}


def _inverse(table: dict) -> dict:
    return {v: k for k, v in table.items()}


_KIND_FROM_PB, _LAYOUT_FROM_PB = _inverse(_KIND_TO_PB), _inverse(_LAYOUT_TO_PB)
_ORDER_FROM_PB, _MEM_FROM_PB = _inverse(_ORDER_TO_PB), _inverse(_MEM_TO_PB)


def _lookup(table: dict, value: int, what: str):
    try:
        return table[value]
    except KeyError:
        raise ValueError(f"unknown {what} {value} on the wire") from None


# A reading rank's notification is the request id and the ticket's nonce after a READ of the owner's
# device blocks, and the same plus this suffix after a READ of its host KV tier (one of each for a
# ticket with a host-tier part), so the owner counts both sources of every reader. The nonce is only
# in the ticket: a notification naming a request without it matches nothing and is refused (counted).
HOST_TIER_NOTIFY_SUFFIX = b"/host"
NONCE_SEPARATOR = b"#"


def notification_key(request_id: str, host_tier: bool, nonce: str = "") -> bytes:
    key = request_id.encode() + (NONCE_SEPARATOR + nonce.encode() if nonce else b"")
    return key + (HOST_TIER_NOTIFY_SUFFIX if host_tier else b"")


def notification_request(key: bytes) -> tuple[str, bool]:
    """(request id, host tier) of a notification key.

    The nonce is hex and comes last, so the request id is everything before the LAST separator: a
    client's ``X-Request-Id`` may itself contain one (``cmpl-a#b``), and cutting at the first would
    name another request, leaving this one's blocks pinned.
    """
    host = key.endswith(HOST_TIER_NOTIFY_SUFFIX)
    key = key.removesuffix(HOST_TIER_NOTIFY_SUFFIX) if host else key
    request_id = key.rpartition(NONCE_SEPARATOR)[0] if NONCE_SEPARATOR in key else key
    return request_id.decode(), host


def notification_parts(key: bytes) -> tuple[str, bool, str]:
    """(request id, host tier, nonce) of a notification key (the nonce "" when it has none)."""
    request_id, host = notification_request(key)
    rest = key.removesuffix(HOST_TIER_NOTIFY_SUFFIX) if host else key
    nonce = rest[len(request_id.encode()) + len(NONCE_SEPARATOR):] if NONCE_SEPARATOR in rest else b""
    return request_id, host, nonce.decode()


def ticket_signature(ticket: kv_pb2.TransferTicket, key: bytes) -> bytes:
    """HMAC-SHA256 of the ticket without its signature, serialized deterministically. The signature is cleared
    for the serialization and put back (a copy of a long prompt's ticket, its block ids and digests copied one
    element at a time, took three times as long as serializing it)."""
    signature = ticket.signature
    ticket.ClearField("signature")
    try:
        data = ticket.SerializeToString(deterministic=True)
    finally:
        ticket.signature = signature
    return hmac.new(key, data, hashlib.sha256).digest()


def ticket_is_signed_by(ticket: kv_pb2.TransferTicket, key: bytes) -> bool:
    return bool(key) and hmac.compare_digest(ticket.signature, ticket_signature(ticket, key))


def prompt_hash(token_ids: Sequence[int]) -> bytes:
    """SHA-256 of a prompt's token ids packed as little-endian uint32: what a ticket names its prompt by
    (``TransferTicket.prompt_hash``), computed once per request by the owner and by the reader. A token id
    outside uint32 is a ValueError, checked here before the cast to uint32, which would wrap it silently."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > 0xFFFF_FFFF):
        raise ValueError("a prompt's token ids must fit in uint32")
    return hashlib.sha256(ids.astype("<u4").tobytes()).digest()


@dataclass(frozen=True)
class MemoryRegion:
    """A registered KV buffer as a peer sees it: where it is and what kind of memory."""

    buffer_index: int
    address: int
    length: int
    device_id: int
    kind: str  # "DRAM" | "VRAM"


def group_to_proto(g: KVCacheGroupSpec) -> kv_pb2.KVGroup:
    """Heads and head dim travel as given (rank-local); None (the layout's) is 0 on the wire."""
    return kv_pb2.KVGroup(
        group_id=g.group_id, kind=_KIND_TO_PB[g.kind], layer_ids=list(g.layer_ids), block_size=g.block_size,
        sliding_window=g.sliding_window or 0, num_kv_heads=g.num_kv_heads or 0, head_dim=g.head_dim or 0,
    )


def group_from_proto(m: kv_pb2.KVGroup) -> KVCacheGroupSpec:
    kind = _lookup(_KIND_FROM_PB, m.kind, "attention kind")
    window = m.sliding_window if kind is AttentionKind.SLIDING_WINDOW else None
    return KVCacheGroupSpec(m.group_id, kind, tuple(m.layer_ids), m.block_size, window,
                            m.num_kv_heads or None, m.head_dim or None)


def layout_to_proto(spec: KVLayoutSpec) -> kv_pb2.KVLayout:
    return kv_pb2.KVLayout(
        kind=_LAYOUT_TO_PB[spec.kind], order=_ORDER_TO_PB[spec.order], num_blocks=spec.num_blocks,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=spec.dtype,
        groups=[group_to_proto(g) for g in spec.groups],
    )


def layout_from_proto(m: kv_pb2.KVLayout) -> KVLayoutSpec:
    """Decode and validate (KVLayoutSpec's own checks run): a malformed layout is a ValueError."""
    return KVLayoutSpec(
        kind=_lookup(_LAYOUT_FROM_PB, m.kind, "layout kind"),
        order=_lookup(_ORDER_FROM_PB, m.order, "block order"),
        num_blocks=m.num_blocks,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        dtype=m.dtype,
        groups=tuple(group_from_proto(g) for g in m.groups),
    )


def region_to_proto(r: MemoryRegion) -> kv_pb2.MemoryRegion:
    return kv_pb2.MemoryRegion(
        buffer_index=r.buffer_index, address=r.address, length=r.length, device_id=r.device_id,
        kind=_MEM_TO_PB[r.kind],
    )


def region_from_proto(m: kv_pb2.MemoryRegion) -> MemoryRegion:
    return MemoryRegion(m.buffer_index, m.address, m.length, m.device_id, _lookup(_MEM_FROM_PB, m.kind, "memory kind"))


def state_to_proto(spec: StateGroupSpec, num_slots: int) -> kv_pb2.StateGroup:
    m = spec.mamba
    return kv_pb2.StateGroup(
        kind=spec.kind, layer_ids=list(spec.layer_ids), sent_after=spec.sent_after, num_slots=num_slots,
        tp_size=spec.tp_size, mamba=kv_pb2.MambaShape(num_heads=m.num_heads, head_dim=m.head_dim, n_groups=m.n_groups,
                                                      d_state=m.d_state, d_conv=m.d_conv, conv_dtype=m.conv_dtype),
    )


def state_from_proto(m: kv_pb2.StateGroup) -> tuple[StateGroupSpec, int]:
    """(the state group, the owner's slot count); ValueError for a malformed one."""
    s = m.mamba
    shape = MambaShape(s.num_heads, s.head_dim, s.n_groups, s.d_state, s.d_conv, s.conv_dtype)
    return StateGroupSpec(tuple(m.layer_ids), shape, m.kind, m.sent_after, m.tp_size or 1), m.num_slots
