"""Whether a decode engine can pull KV from a prefill engine, decided from what each side advertises.

One pure rule shared by the router (which pairs only supported workers, and says on ``/health`` why
a worker has no partner) and the puller's handshake check, so the two never disagree. It reads only
what a worker's ``Info`` carries (compatibility hash and fields, TP size, block size), never a
layout, so the router can run it without a handshake.

A pair is supported when, in this order:

* the compatibility hashes are equal (a difference is explained field by field, and per KV group,
  as ``services.kv.spec.compat`` spells it, but with "prefill"/"decode" instead of "remote"/"local"), or the
  pair differs only in a KV dtype one side converts (``kv_convert``: 16/32-bit and FP8), and then has what the
  conversion needs: equal TP sizes and equal block sizes (it goes through the staging areas, which hold a
  ticket's blocks as the owner's layout has them);
* the block sizes divide one another (per group where the caller knows them per group);
* each side's TP size can shard every group's KV heads (the model's total heads of that group, from
  ``kv_groups``): one must divide the other. Groups with differing head counts are fine:
  ``topology.group_rank_reads`` shards each group by its own heads.

Anything a side does not report (no fields, no block size) is not held against it: the handshake
checks it again with the full layouts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.kv.spec.compat import CompatInfo, KVCompatibilityError, check_compatible, compat_hash, parse_groups
from services.kv.spec.kv_convert import KVConversion, conversion
from services.kv.spec.topology import block_unit


@dataclass(frozen=True)
class PairSide:
    """What one engine advertises about its KV: enough to decide a pairing without a handshake.

    ``block_size`` is the engine's (every group's, unless ``group_block_sizes`` names a group's own);
    None or 0 means not reported.
    """

    compat_hash: str
    compat_fields: Mapping[str, str] = field(default_factory=dict, hash=False)
    tp_size: int = 1
    block_size: int | None = None
    group_block_sizes: Mapping[int, int] = field(default_factory=dict, hash=False)


def group_heads_from_fields(fields: Mapping[str, str]) -> dict[int, int]:
    """``{group id: the model's total KV heads of that group}`` from compat fields; {} if unreadable.

    ``kv_groups`` omits a group's heads when they are the model's ``num_kv_heads``; this fills them
    in. Without ``kv_groups`` but with ``num_kv_heads`` the model is one group.
    """
    groups = parse_groups(fields) if "kv_groups" in fields else None
    if groups is not None:
        return {gid: group[3] for gid, group in enumerate(groups)}  # (kind, window, layers, total heads, ...)
    try:
        return {0: int(fields["num_kv_heads"])}
    except (KeyError, ValueError):
        return {}


def pair_refusal(prefill: PairSide, decode: PairSide) -> str | None:
    """None when ``decode`` can pull KV from ``prefill``, else one short reason naming both values."""
    return _compat_refusal(prefill, decode) or _block_refusal(prefill, decode) or _tp_refusal(prefill, decode) \
        or _conversion_refusal(prefill, decode)


def pair_conversion(prefill: PairSide, decode: PairSide) -> KVConversion | None:
    """The KV dtype conversion a pair of different hashes would use (None: equal hashes, or none applies)."""
    if prefill.compat_hash == decode.compat_hash or not (prefill.compat_fields and decode.compat_fields):
        return None
    return conversion(prefill.compat_fields, decode.compat_fields)


# ---- compatibility hash ------------------------------------------------------------------------


def _compat_refusal(prefill: PairSide, decode: PairSide) -> str | None:
    """Equal, non-empty hashes that match their own fields; a difference named field by field."""
    for name, side in (("prefill", prefill), ("decode", decode)):
        if not side.compat_hash:
            return f"{name} reports no KV compatibility hash"
        if side.compat_fields and compat_hash(side.compat_fields) != side.compat_hash:
            return (f"{name} compatibility hash {side.compat_hash[:12]} does not match its fields "
                    f"({compat_hash(side.compat_fields)[:12]})")
    if prefill.compat_hash == decode.compat_hash:
        return None
    if not (prefill.compat_fields and decode.compat_fields):
        return f"compat hash: prefill {prefill.compat_hash[:12]} vs decode {decode.compat_hash[:12]}"
    if pair_conversion(prefill, decode) is not None:
        return None  # the structure it needs: _conversion_refusal
    try:
        check_compatible(CompatInfo(decode.compat_fields, decode.compat_hash), prefill.compat_fields,
                         prefill.compat_hash)
    except KVCompatibilityError as exc:
        return _explain(exc) or str(exc)
    return None  # unreachable: the hashes differ and match their fields, so the fields differ


def _explain(exc: KVCompatibilityError) -> str:
    """The error's differences with "prefill"/"decode" (check_compatible ran with decode as local)."""
    parts = []
    for g in exc.group_differences:
        if g.field == "groups":
            parts.append(f"KV groups: prefill {g.remote} vs decode {g.local}")
        else:
            parts.append(f"KV group {g.group_id} ({g.kind}): {g.field} prefill {g.remote} vs decode {g.local}")
    for key, (local, remote) in sorted(exc.differences.items()):
        if key != "kv_groups" or not exc.group_differences:
            parts.append(f"compat field {key}: prefill {remote} vs decode {local}")
    return "; ".join(parts)


# ---- block sizes -------------------------------------------------------------------------------


def _block_refusal(prefill: PairSide, decode: PairSide) -> str | None:
    """Every group's block sizes divide one another (a size a side does not report is skipped)."""
    groups = sorted(set(prefill.group_block_sizes) | set(decode.group_block_sizes)) or [None]
    for gid in groups:
        p, d = _block_size(prefill, gid), _block_size(decode, gid)
        if not (p and d):
            continue
        try:
            block_unit(p, d)
        except ValueError:
            where = "" if gid is None else f"KV group {gid}: "
            return f"{where}block sizes {p} (prefill) and {d} (decode) do not divide each other"
    return None


def _block_size(side: PairSide, group_id: int | None) -> int | None:
    if group_id is not None and group_id in side.group_block_sizes:
        return side.group_block_sizes[group_id]
    return side.block_size


# ---- TP ----------------------------------------------------------------------------------------


def _tp_refusal(prefill: PairSide, decode: PairSide) -> str | None:
    """Each side's TP size shards every group's heads; a group is named when its heads are its own."""
    fields = decode.compat_fields or prefill.compat_fields  # equal hashes: either side's will do
    heads_by_group = group_heads_from_fields(fields)
    try:
        model_heads: int | None = int(fields["num_kv_heads"])
    except (KeyError, ValueError):
        model_heads = None
    reasons: list[str] = []
    for name, side in (("prefill", prefill), ("decode", decode)):
        if side.tp_size < 1:
            reasons.append(f"{name} tp {side.tp_size} is not a TP size")
            continue
        for gid, heads in sorted(heads_by_group.items()):
            if heads % side.tp_size and side.tp_size % heads:
                where = "" if heads == model_heads else f"KV group {gid}: "
                reasons.append(f"{where}{name} tp {side.tp_size} cannot shard {heads} KV heads "
                               "(neither divides the other)")
    return "; ".join(dict.fromkeys(reasons)) or None


# ---- KV dtype conversion -----------------------------------------------------------------------


def _conversion_refusal(prefill: PairSide, decode: PairSide) -> str | None:
    """A converting pair needs equal TP sizes and block sizes (a block size a side does not report is skipped):
    the conversion runs over the staging areas, which hold the owner's blocks as its layout does."""
    conv = pair_conversion(prefill, decode)
    if conv is None:
        return None
    what = f"dtype prefill {conv.owner_dtype} vs decode {conv.reader_dtype} converts only through staging, which needs"
    if prefill.tp_size != decode.tp_size:
        return f"KV {what} equal TP sizes: tp prefill {prefill.tp_size} vs decode {decode.tp_size}"
    for gid in sorted(set(prefill.group_block_sizes) | set(decode.group_block_sizes)) or [None]:
        p, d = _block_size(prefill, gid), _block_size(decode, gid)
        if p and d and p != d:
            where = "KV" if gid is None else f"KV group {gid}:"
            return f"{where} {what} equal block sizes: block_size prefill {p} vs decode {d}"
    return None
