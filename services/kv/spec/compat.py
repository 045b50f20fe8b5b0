"""KV compatibility: the fields that must be equal for two engines' KV bytes to mean the same.

The hash travels WITH the fields it was computed from, so a mismatch names every differing
field and both values instead of failing as an opaque hash inequality; a difference inside the
KV-cache groups names the group and its field (``KV group 1 (full): head_dim local 32 vs remote 16``).

Hashed: protocol version, architecture, layer count, total KV heads, head dim, dtype, the
within-block layout (``kv_layout``: NHD or HND, which fixes what a page's bytes mean), the KV-cache
groups, KV sharing between layers, and the KV digest both sides compute (``kv_digest``: its scheme, or
``off`` with ``--no-kv-digest``; not the bytes' meaning, but a pair that disagrees could not check a
transfer, so it is refused like one that would misread it).

``kv_groups`` holds, per group, ``[kind, window, layers]``, followed by ``[total KV heads, head dim]``
when those differ from the model's (``num_kv_heads``/``head_dim``): so a model whose groups all have
the model's shape hashes exactly as before per-group shapes existed, and a hybrid (Gemma-4: full
layers with wider heads) covers every group's head dim and heads. Heads are the MODEL's total for
the group, never a rank's: pass ``group_kv_heads`` (the engine knows them from its per-layer config);
without it they are derived from the layout, which is exact when the layout is not TP-sharded
(``layout.num_kv_heads == num_kv_heads``) or the group has the layout's own heads, and refused
otherwise rather than guessed.

An MLA group (DeepSeek's latent rows) always spells its shape out, with how TP places it:
``["mla", null, layers, 1, row width, "replicated"]``. Its one "head" is the latent row
(``kv_lora_rank + qk_rope_head_dim`` wide), identical on every TP rank, so the hash covers the row
width (a different ``kv_lora_rank`` is named as the group's ``row_width``) and that every rank holds
the whole row; a full-attention group on the other side differs in ``kind``.

A model with state layers (Mamba2) adds ``state``: the state group's kind, layers, the model's Mamba2 shape
(heads, head dim, groups, d_state, d_conv, the conv state's dtype; the SSM state is float32) and the convention
of when the owner sends it (after every prompt token, ``groups.STATE_SENT_AFTER``); a difference names the state
group and its field. The TP size is not hashed: ``state_runs`` maps heads between any two. Absent for other
models.

A quantized KV cache (FP8, ``kv_quant``) ends each ``kv_groups`` entry with its dtype, scale scheme and every
layer's scales (the values, so a reader can check them and dequantize with them); a difference names the group and
``dtype``, ``scale`` or ``kv_scales`` (the latter as ``sha:`` digests). Unquantized engines add nothing and hash as
before FP8 KV existed.

An engine's values are gathered once into a :class:`KVIdentity` (``KVIdentity.of``, from the
model's shape and the engine's layout) that the hash, the exporter and the puller all take.

Not hashed, because they are reconciled rather than required equal: block size (per group, one
must divide the other; see topology.py and the puller's handshake check), TP size (head slices are
mapped), and block placement (per-layer, cross-layer or heads-outer buffers: the planner addresses any
of them through the layout spec, so two engines of different kinds still pull; each rank announces
its kind in the handshake). A heads-outer layout holds HND blocks only, so what it means for the bytes
is hashed as ``kv_layout``: against an NHD peer the mismatch names ``kv_layout``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.kv.spec import kv_quant
from services.kv.spec.groups import AttentionKind, StateGroupSpec
from services.kv.spec.layout import BlockOrder, KVLayoutSpec

PROTOCOL_VERSION = 1
#: The KV digest both sides compute (``services.kv.digest.scheme``), or ``DIGEST_OFF`` (``--no-kv-digest``): hashed,
#: so a pair that disagrees is refused at the handshake (and never paired by the router).
DIGEST_SCHEME = "kvsum32-mix32w-v2"
DIGEST_OFF = "off"


@dataclass(frozen=True)
class GroupDifference:
    """One field of one KV-cache group that differs between the two engines."""

    group_id: int
    kind: str  # the local group's attention kind ("full", "sliding_window", "mla"); "" for a group count
    # "kind", "sliding_window", "layers", "num_kv_heads", "head_dim" ("row_width" in an MLA group), "tp" (how
    # TP places the group: "sharded" heads or a "replicated" row), "dtype", "scale" or "kv_scales" (a quantized
    # group's, ``kv_quant``) or "groups" (the count)
    field: str
    local: object
    remote: object

    def __str__(self) -> str:
        if self.field == "groups":
            return f"KV groups: local {self.local} vs remote {self.remote}"
        return f"KV group {self.group_id} ({self.kind}): {self.field} local {self.local} vs remote {self.remote}"


class KVCompatibilityError(ValueError):
    """Two engines cannot exchange KV. ``differences`` maps field -> (local, remote);
    ``group_differences`` spells out a ``kv_groups`` difference per group and field."""

    def __init__(self, message: str, differences: Mapping[str, tuple[str | None, str | None]] | None = None,
                 group_differences: Sequence[GroupDifference] = ()):
        super().__init__(message)
        self.differences = dict(differences or {})
        self.group_differences = list(group_differences)


@dataclass(frozen=True)
class CompatInfo:
    """The canonical compatibility fields (all strings, for the wire) and their hash."""

    fields: Mapping[str, str]
    hash: str

    @classmethod
    def of(cls, fields: Mapping[str, str]) -> CompatInfo:
        return cls(dict(fields), compat_hash(fields))

    @classmethod
    def of_identity(cls, identity: KVIdentity) -> CompatInfo:
        """The fields and hash an engine of this identity presents."""
        return cls.of(compat_fields(identity))


@dataclass(frozen=True)
class GroupIdentity:
    """One KV-cache group as the hash covers it: how its layers attend and the MODEL's KV shape
    (total heads, never a rank's), so every TP rank of an engine has the same identity."""

    kind: AttentionKind
    sliding_window: int | None
    layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVIdentity:
    """What makes two engines' KV bytes mean the same, built once per engine (:meth:`of`) and
    handed to the compatibility hash (:func:`compat_fields`), the exporter and the puller.

    ``num_kv_heads``/``head_dim`` are the model's (total heads, before TP); ``kv_sharing`` holds
    (layer, the layer whose KV it reads) pairs, sorted.
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_order: BlockOrder
    groups: tuple[GroupIdentity, ...]
    kv_sharing: tuple[tuple[int, int], ...] = ()
    protocol_version: int = PROTOCOL_VERSION
    kv_digest: str = DIGEST_SCHEME
    #: The per-request state of the model's state layers (Mamba2), or None: hashed as ``state``.
    state: StateGroupSpec | None = None
    #: A quantized KV dtype's scales, ``(layer, k_scale, v_scale)`` for every layer of every group, sorted; empty
    #: for unquantized KV (``kv_quant``).
    kv_scales: tuple[tuple[int, float, float], ...] = ()

    @property
    def digest_on(self) -> bool:
        return self.kv_digest != DIGEST_OFF

    @classmethod
    def of(
        cls,
        *,
        architecture: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        layout: KVLayoutSpec,
        kv_sharing: Mapping[int, int] | None = None,
        protocol_version: int = PROTOCOL_VERSION,
        group_kv_heads: Mapping[int, int] | None = None,
        kv_digest: str = DIGEST_SCHEME,
        state: StateGroupSpec | None = None,
        kv_scales: Mapping[int, Sequence[float]] | None = None,
    ) -> KVIdentity:
        """The identity of an engine with this model shape and (rank-local) layout.

        ``group_kv_heads`` maps group id -> the model's total KV heads of that group's layers (see
        the module docstring for what happens without it); ``kv_sharing`` maps a layer to the layer
        whose KV it reads. Block size, pool size, placement and TP are not part of it. ``kv_scales`` (layer ->
        (k_scale, v_scale)) are kept only when the layout's dtype is quantized (``kv_quant.DEFAULT_SCALE`` for a
        layer without); they mean nothing for bytes that hold the values themselves.
        """
        groups = tuple(
            GroupIdentity(g.kind, g.sliding_window, tuple(g.layer_ids),
                          group_total_heads(layout, g.group_id, num_kv_heads, group_kv_heads),
                          layout.group_head_dim(g.group_id))
            for g in layout.groups
        )
        scales = kv_quant.layer_scales(kv_scales, [x for g in layout.groups for x in g.layer_ids], num_layers) \
            if kv_quant.is_quantized(layout.dtype) else ()
        return cls(architecture, num_layers, num_kv_heads, head_dim, layout.dtype, layout.order, groups,
                   tuple(sorted((kv_sharing or {}).items())), protocol_version, kv_digest, state, scales)

    @property
    def sharing(self) -> dict[int, int]:
        """``kv_sharing`` as layer -> source layer."""
        return dict(self.kv_sharing)

    def check_layout(self, layout: KVLayoutSpec) -> None:
        """Refuse a layout this identity was not built from (dtype, block order, groups' attention,
        layers and head dim): the hash would describe other bytes than the ones registered."""
        local = [(g.kind, g.sliding_window, tuple(g.layer_ids), layout.group_head_dim(g.group_id))
                 for g in layout.groups]
        own = [(g.kind, g.sliding_window, g.layer_ids, g.head_dim) for g in self.groups]
        if (layout.dtype, layout.order, local) != (self.dtype, self.block_order, own):
            raise ValueError(
                f"KV layout ({layout.dtype}, {layout.order.value}, {len(layout.groups)} groups) does not match the "
                f"KV identity ({self.dtype}, {self.block_order.value}, {len(self.groups)} groups)"
            )


def compat_fields(identity: KVIdentity) -> dict[str, str]:
    """Canonical string form of everything that must match (what the hash covers, and the wire carries)."""
    return {
        "protocol_version": str(identity.protocol_version),
        "architecture": identity.architecture,
        "num_layers": str(identity.num_layers),
        "num_kv_heads": str(identity.num_kv_heads),
        "head_dim": str(identity.head_dim),
        "dtype": identity.dtype,
        "kv_layout": identity.block_order.value,
        "kv_groups": _groups_field(identity),
        "kv_sharing": json.dumps([list(pair) for pair in identity.kv_sharing]),
        "kv_digest": identity.kv_digest,
    } | ({"state": state_field(identity.state)} if identity.state is not None else {})


def state_field(state: StateGroupSpec) -> str:
    """The ``state`` field: the model's state (``{"kind", "layers", "sent_after"}`` and the Mamba2 shape: heads,
    head dim, groups, d_state, d_conv, conv dtype); not the TP size, which is reconciled (``state_runs``). Absent
    for a model without state layers, so theirs hash as before state groups existed."""
    return json.dumps({"kind": state.kind, "layers": list(state.layer_ids), "sent_after": state.sent_after,
                       **dataclasses.asdict(state.mamba)}, sort_keys=True)


def state_differences(local: Mapping[str, str], remote: Mapping[str, str]) -> list[str]:
    """Each field of the state group that differs (``state group (mamba2): d_state local 16 vs remote 32``); a
    side without state layers is named as such."""
    a, b = (json.loads(f["state"]) if "state" in f else None for f in (local, remote))
    if a is None or b is None:
        kinds = ("none" if x is None else x["kind"] for x in (a, b))
        return ["state group: local {} vs remote {}".format(*kinds)]
    return [f"state group ({a['kind']}): {k} local {a.get(k)} vs remote {b.get(k)}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def group_total_heads(layout: KVLayoutSpec, group_id: int, num_kv_heads: int,
                      group_kv_heads: Mapping[int, int] | None = None) -> int:
    """The model's total KV heads of a group: given, or derived from the (rank-local) layout.

    Derived only where it is exact: a group with the layout's own heads has the model's
    ``num_kv_heads``; on a layout that is not TP-sharded (it holds all ``num_kv_heads``) the
    group's heads are its total. A group with its own heads on a sharded layout is refused:
    ``max(1, heads // tp)`` cannot be inverted once heads are replicated.
    """
    if layout.groups[group_id].kind is AttentionKind.MLA:
        return 1  # the latent row: one per token, the whole of it on every rank
    if group_kv_heads is not None and group_id in group_kv_heads:
        return int(group_kv_heads[group_id])
    local = layout.kv_heads(group_id)
    if local == layout.num_kv_heads:
        return num_kv_heads
    if layout.num_kv_heads == num_kv_heads:
        return local
    raise ValueError(
        f"{layout.groups[group_id].label} holds {local} KV heads per rank on a TP-sharded layout "
        f"({layout.num_kv_heads} of {num_kv_heads} model heads per rank): pass group_kv_heads, the model's "
        "total KV heads per group"
    )


#: How TP places a group's KV: heads split over ranks (or replicated by ``kv_head_range``'s rule), or one
#: row per token that every rank holds whole (MLA).
TP_SHARDED, TP_REPLICATED = "sharded", "replicated"


def _groups_field(identity: KVIdentity) -> str:
    # Block size is deliberately left out: it is reconciled by the block-size ratio, per group.
    quantized = kv_quant.is_quantized(identity.dtype)
    scales = {layer: (k, v) for layer, k, v in identity.kv_scales}
    out = []
    for g in identity.groups:
        entry: list = [g.kind.value, g.sliding_window, list(g.layer_ids)]
        shape = (g.num_kv_heads, g.head_dim)
        if g.kind is AttentionKind.MLA:  # always explicit: the row width and its replication are hashed
            entry += [*shape, TP_REPLICATED]
        elif shape != (identity.num_kv_heads, identity.head_dim):
            entry += list(shape)
        if quantized:  # only then: every other engine hashes as before quantized KV
            entry.append(kv_quant.quant_entry(identity.dtype, g.layer_ids, scales))
        out.append(entry)
    return json.dumps(out)


_GROUP_FIELDS = ("kind", "sliding_window", "layers", "num_kv_heads", "head_dim", "tp")


def parse_groups(fields: Mapping[str, str]) -> list[tuple] | None:
    """``kv_groups`` as one (kind, window, layers, total heads, head dim, tp placement) tuple per group, or
    None when unreadable; the placement is ``TP_REPLICATED`` only where the entry says so (MLA)."""
    try:
        heads, head_dim = int(fields["num_kv_heads"]), int(fields["head_dim"])
        out = []
        for entry in json.loads(fields["kv_groups"]):
            kind, window, layers, *shape = kv_quant.split_entry(entry)[0]
            total, dim, *tp = shape if shape else (heads, head_dim)
            if tp not in ([], [TP_REPLICATED]):
                return None
            out.append((str(kind), window, list(layers), int(total), int(dim), tp[0] if tp else TP_SHARDED))
        return out
    except (KeyError, TypeError, ValueError):
        return None


def _field_name(name: str, kinds: tuple[str, str]) -> str:
    """An MLA group's head dim is its latent row's width (``kv_lora_rank + qk_rope_head_dim``): named so."""
    return "row_width" if name == "head_dim" and AttentionKind.MLA.value in kinds else name


def _group_quants(fields: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """Per group, its (dtype, scale scheme, scales' digest) as ``kv_quant.group_quant`` names them."""
    return [kv_quant.group_quant(kv_quant.split_entry(entry)[1], fields.get("dtype", ""))
            for entry in json.loads(fields["kv_groups"])]


def group_differences(local: Mapping[str, str], remote: Mapping[str, str]) -> list[GroupDifference]:
    """Each (group, field) whose value differs between two sets of compat fields."""
    a, b = parse_groups(local), parse_groups(remote)
    if a is None or b is None:
        return []
    try:
        a = [(*g, *q) for g, q in zip(a, _group_quants(local), strict=True)]
        b = [(*g, *q) for g, q in zip(b, _group_quants(remote), strict=True)]
    except (AttributeError, TypeError, ValueError):  # a quantization object that is not one: the raw field
        return []
    out = []
    if len(a) != len(b):
        out.append(GroupDifference(-1, "", "groups", len(a), len(b)))
    for gid, (la, rb) in enumerate(zip(a, b, strict=False)):
        for name, x, y in zip(_GROUP_FIELDS + kv_quant.QUANT_FIELDS, la, rb, strict=True):
            if x != y:
                out.append(GroupDifference(gid, la[0], _field_name(name, (la[0], rb[0])), x, y))
    return out


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
    groups = group_differences(local.fields, remote_fields) if "kv_groups" in diffs else []
    states = state_differences(local.fields, remote_fields) if "state" in diffs else []
    # A kv_groups or state difference explained field by field is not repeated as two JSON blobs.
    # So is the dtype, when the groups name it (a quantized side's).
    named = {g.field for g in groups}
    shown = {k: v for k, v in diffs.items()
             if not (k == "kv_groups" and groups) and k != "state" and not (k == "dtype" and "dtype" in named)}
    detail = "; ".join([str(g) for g in groups] + states +
                       [f"{k}: local {a!r} vs remote {b!r}" for k, (a, b) in shown.items()])
    if "kv_digest" in diffs:
        detail += " (both workers must run with the KV digest, or both with --no-kv-digest)"
    raise KVCompatibilityError(f"KV caches are incompatible: {detail}", diffs, groups)
