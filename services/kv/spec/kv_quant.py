"""Quantized KV (FP8) in the compatibility fields: what a KV group's bytes mean when they are not the values.

An FP8 KV cache stores ``fp8(x / scale)`` with one float32 scale for K and one for V per layer (``SCALE_SCHEME``),
so two engines' bytes mean the same only when their KV dtype, their scale scheme and every layer's scales agree.
All three are hashed per KV group: each ``kv_groups`` entry of a quantized engine ends with one object::

    {"dtype": "float8_e4m3fn", "scale": "per_layer_kv", "kv_scales": [[k_scale, v_scale], ...]}

one ``[k, v]`` pair per layer of the group, in the group's layer order, as JSON numbers (Python's float repr, so
a float32 scale travels exactly). The values themselves travel, not only their hash: a reader can check them (a
mismatch is named ``KV group 0 (full): kv_scales local sha:ab12.. vs remote sha:cd34..``) and, between a pair whose
dtypes differ (``kv_convert``), a reader can dequantize with the owner's scales and an owner quantize with the
reader's; the entry says what the bytes a READ returns mean, whoever quantized them. An engine whose KV is not
quantized adds nothing, so it hashes exactly as before FP8 KV existed; against a quantized peer its groups read as
``dtype <its dtype>``, ``scale none``, ``kv_scales none``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence

#: KV dtypes whose bytes are scaled values (torch's names): their groups carry the quantization entry.
QUANTIZED_DTYPES = frozenset({"float8_e4m3fn"})
#: One float32 scale for K and one for V per layer; the value is ``stored * scale``.
SCALE_SCHEME = "per_layer_kv"
#: The scale of a layer the checkpoint gives none (the engine's default).
DEFAULT_SCALE = 1.0
#: A group's entry of an unquantized engine, as a difference names it.
NONE = "none"
QUANT_FIELDS = ("dtype", "scale", "kv_scales")

Scales = tuple[float, float]


def is_quantized(dtype: str) -> bool:
    """Whether KV of this dtype holds scaled values (and so hashes its scales)."""
    return dtype in QUANTIZED_DTYPES


def layer_scales(kv_scales: Mapping[int, Sequence[float]] | None, layer_ids: Sequence[int], num_layers: int
                 ) -> tuple[tuple[int, float, float], ...]:
    """``(layer, k_scale, v_scale)`` for each of ``layer_ids`` (sorted), ``DEFAULT_SCALE`` where none is given.

    Refuses a scale that is not a finite positive number and one for a layer the model does not have: a bad
    scale would make the KV garbage on every side that trusts it."""
    given = {int(layer): pair for layer, pair in (kv_scales or {}).items()}  # "1" (JSON) names layer 1 too
    outside = sorted(layer for layer in given if not 0 <= layer < num_layers)
    if outside:
        raise ValueError(f"KV scales name layers {outside}, the model has {num_layers}")
    out = []
    for layer in sorted(layer_ids):
        pair = given.get(layer, (DEFAULT_SCALE, DEFAULT_SCALE))
        if len(pair) != 2:
            raise ValueError(f"KV scales of layer {layer} must be (k_scale, v_scale), got {pair!r}")
        k, v = (float(x) for x in pair)
        if not all(math.isfinite(x) and x > 0 for x in (k, v)):
            raise ValueError(f"KV scales of layer {layer} must be finite and positive, got ({k}, {v})")
        out.append((int(layer), k, v))
    return tuple(out)


def quant_entry(dtype: str, layer_ids: Sequence[int], scales: Mapping[int, Scales]) -> dict:
    """The object a quantized group's ``kv_groups`` entry ends with (``scales``: layer -> (k, v))."""
    return {"dtype": dtype, "scale": SCALE_SCHEME, "kv_scales": [list(scales[layer]) for layer in layer_ids]}


def split_entry(entry: Sequence) -> tuple[list, dict | None]:
    """A ``kv_groups`` entry without its quantization object, and the object (None when unquantized)."""
    if entry and isinstance(entry[-1], dict):
        return list(entry[:-1]), entry[-1]
    return list(entry), None


def scales_digest(scales: Sequence[Sequence[float]]) -> str:
    """A short name of a group's scales for messages: ``sha:`` and 12 hex digits of their canonical JSON."""
    canonical = json.dumps([[float(x) for x in pair] for pair in scales], separators=(",", ":")).encode()
    return f"sha:{hashlib.sha256(canonical).hexdigest()[:12]}"


def group_quant(quant: dict | None, dtype: str) -> tuple[str, str, str]:
    """(dtype, scale scheme, scales' digest) of a group as a difference names them; an unquantized group's are
    the engine's dtype, ``none`` and ``none``."""
    if quant is None:
        return dtype, NONE, NONE
    return str(quant.get("dtype")), str(quant.get("scale")), scales_digest(quant.get("kv_scales", []))


def group_scales(fields: Mapping[str, str]) -> list[dict[int, Scales] | None] | None:
    """Per KV group, ``{layer: (k_scale, v_scale)}`` as an engine advertises them (None for an unquantized group),
    or None when ``kv_groups`` is unreadable: what a reader dequantizes an owner's KV with."""
    try:
        out: list[dict[int, Scales] | None] = []
        for entry in json.loads(fields["kv_groups"]):
            base, quant = split_entry(entry)
            if quant is None:
                out.append(None)
                continue
            layers, pairs = base[2], quant["kv_scales"]
            if len(layers) != len(pairs):
                return None
            out.append({int(layer): (float(k), float(v)) for layer, (k, v) in zip(layers, pairs, strict=True)})
        return out
    except (KeyError, TypeError, ValueError):
        return None
