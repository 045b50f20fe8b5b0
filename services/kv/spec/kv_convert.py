"""Pairs whose KV dtypes differ only by FP8 quantization: which side converts, with which scales.

A 16/32-bit KV cache and an FP8 (e4m3) one of the same model hash differently (``kv_quant``): their bytes mean
different things. Such a pair can still move KV when one side converts it:

* an unquantized owner and an FP8 reader: the owner quantizes while it gathers a ticket's blocks into its staging
  area (``quantize_on_send``), with the READER's scales, so the reader reads e4m3 bytes that are its own blocks'
  and holds what it would have written itself;
* an FP8 owner and an unquantized reader: the reader reads the e4m3 span into its staging area and dequantizes
  with the OWNER's scales while it scatters into its blocks.

A pair converts when the owner's compat fields, rewritten as if its KV were the reader's dtype (``fields_as``:
the top-level ``dtype``, and each ``kv_groups`` entry's quantization object added with the FP8 side's scales or
dropped), hash exactly as the reader's. Every other field must still be equal, so a difference besides the dtype
is refused as before, by name. Casts between two unquantized dtypes (bfloat16 and float32) are not offered: they
save no bytes, and a decode engine of another compute dtype is better served by its own prefill workers.

The owner learns its reader's identity per ticket only as a hash (``PrefillRequest.reader_compat_hash``): it
quantizes only when that hash equals its own fields rewritten with the scales it holds (``target_hashes``), which
proves the reader's scales are those. This module is torch-free: the router imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.kv.spec import kv_quant
from services.kv.spec.compat import CompatInfo, KVCompatibilityError, check_compatible, compat_hash

#: KV dtypes that hold the values themselves, each of which converts to and from an FP8 KV cache.
UNQUANTIZED_DTYPES = frozenset({"float32", "bfloat16", "float16"})

Scales = dict[int, kv_quant.Scales]


@dataclass(frozen=True)
class KVConversion:
    """How a pair's KV changes dtype between the owner's blocks and the reader's.

    ``scales``: per KV group, ``{layer: (k_scale, v_scale)}`` of the FP8 side (the reader's when the owner
    quantizes, the owner's when the reader dequantizes), the ones both sides' hashes were checked against."""

    owner_dtype: str
    reader_dtype: str
    scales: tuple[Scales, ...] = field(hash=False)

    @property
    def quantize_on_send(self) -> bool:
        """The owner quantizes into its staging area (an FP8 reader); else the reader dequantizes."""
        return kv_quant.is_quantized(self.reader_dtype)

    @property
    def wire_dtype(self) -> str:
        """The dtype of the bytes a READ moves: always the FP8 one."""
        return self.reader_dtype if self.quantize_on_send else self.owner_dtype

    def layer_scales(self) -> Scales:
        """Every layer's scales, of all groups."""
        return {layer: pair for group in self.scales for layer, pair in group.items()}

    def __str__(self) -> str:
        who = "the prefill worker quantizes on send" if self.quantize_on_send else \
            "the decode worker dequantizes on read"
        return f"KV {self.owner_dtype} -> {self.reader_dtype} ({who})"


def converts(a: str, b: str) -> bool:
    """Whether KV of dtype ``a`` and of dtype ``b`` convert into each other (one FP8, the other unquantized)."""
    return {kv_quant.is_quantized(a), kv_quant.is_quantized(b)} == {True, False} and \
        UNQUANTIZED_DTYPES.issuperset({a, b} - kv_quant.QUANTIZED_DTYPES)


def fields_as(fields: Mapping[str, str], dtype: str, scales: Mapping[int, kv_quant.Scales] | None = None
              ) -> dict[str, str]:
    """``fields`` as an engine identical but for its KV ``dtype`` would present them: each group's quantization
    object dropped, and added back with ``scales`` (layer -> (k, v), ``DEFAULT_SCALE`` where absent) when ``dtype``
    is quantized. ValueError for unreadable ``kv_groups``."""
    try:
        entries = json.loads(fields["kv_groups"])
        out = []
        for entry in entries:
            base, _ = kv_quant.split_entry(entry)
            if kv_quant.is_quantized(dtype):
                layers = [int(x) for x in base[2]]
                pairs = {layer: tuple(float(x) for x in (scales or {}).get(layer, (kv_quant.DEFAULT_SCALE,) * 2))
                         for layer in layers}
                base.append(kv_quant.quant_entry(dtype, layers, pairs))
            out.append(base)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"compat fields without readable kv_groups: {e}") from None
    return {**fields, "dtype": dtype, "kv_groups": json.dumps(out)}


def conversion(owner: Mapping[str, str], reader: Mapping[str, str]) -> KVConversion | None:
    """The conversion that lets ``reader`` pull from ``owner`` (compat fields of each), or None when the pair
    differs in anything but a convertible KV dtype (or not at all)."""
    a, b = owner.get("dtype", ""), reader.get("dtype", "")
    if not converts(a, b):
        return None
    fp8_side = reader if kv_quant.is_quantized(b) else owner
    per_group = kv_quant.group_scales(fp8_side)
    if per_group is None or any(g is None for g in per_group):
        return None
    scales = tuple(dict(g) for g in per_group if g is not None)
    merged = {layer: pair for g in scales for layer, pair in g.items()}
    try:
        rewritten = fields_as(owner, b, merged)
    except ValueError:
        return None
    return KVConversion(a, b, scales) if compat_hash(rewritten) == compat_hash(reader) else None


def check_pair(local: CompatInfo, remote_fields: Mapping[str, str], remote_hash: str) -> KVConversion | None:
    """The reader's compatibility check of an owner: None when the hashes are equal, the conversion when the
    pair converts, else ``check_compatible``'s KVCompatibilityError naming every differing field."""
    if compat_hash(remote_fields) == remote_hash and remote_hash != local.hash:
        found = conversion(remote_fields, local.fields)
        if found is not None:
            return found
    check_compatible(local, remote_fields, remote_hash)
    return None


def target_hashes(fields: Mapping[str, str], checkpoint_scales: Mapping[int, kv_quant.Scales] | None
                  ) -> dict[str, str]:
    """The compat hash of each reader this owner converts for -> that reader's KV dtype: an unquantized owner
    quantizes for an FP8 reader whose scales are ``checkpoint_scales`` (the checkpoint's, 1.0 where absent: what
    an FP8 engine of it uses); an FP8 owner serves every unquantized dtype (its readers dequantize)."""
    own = fields.get("dtype", "")
    if kv_quant.is_quantized(own):
        targets = {d: None for d in UNQUANTIZED_DTYPES}
    elif own in UNQUANTIZED_DTYPES:
        targets = {d: dict(checkpoint_scales or {}) for d in kv_quant.QUANTIZED_DTYPES}
    else:
        return {}
    return {compat_hash(fields_as(fields, dtype, scales)): dtype for dtype, scales in targets.items()}


def refuse_unconverted(conv: KVConversion, what: str) -> KVCompatibilityError:
    """The error of a converting pair that cannot convert for ``what`` reason (named with the dtypes)."""
    return KVCompatibilityError(f"KV dtype {conv.owner_dtype} (prefill) vs {conv.reader_dtype} (decode) converts "
                                f"only through the staging areas: {what}", {"dtype": (conv.reader_dtype,
                                                                                       conv.owner_dtype)})
