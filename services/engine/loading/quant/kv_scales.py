"""Per-layer FP8 KV-cache scales a checkpoint stores beside its weights (scalars, read at resolve time).

vLLM/ModelOpt and compressed-tensors store ``model.layers.N.self_attn.k_scale`` / ``v_scale``; older
compressed-tensors checkpoints ``self_attn.k_proj.output_scale`` / ``v_proj.output_scale``. They are not
weights: the model never sees them, the KV cache does.
"""

from __future__ import annotations

import re
from pathlib import Path

from safetensors import SafetensorError, safe_open

_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|k_proj\.output_scale|"
                       r"v_proj\.output_scale)$")


def kv_scale_of(name: str) -> tuple[int, str] | None:
    """(layer id, "k" or "v") when ``name`` is a KV-cache scale, else None."""
    m = _KV_SCALE.match(name)
    return None if m is None else (int(m.group(1)), m.group(2)[0])


def read_kv_scales(files: list[Path]) -> dict[int, tuple[float, float]]:
    """layer id -> (k_scale, v_scale) of every layer storing them; ValueError naming a non-scalar or
    non-positive scale, or a layer with one of the two only."""
    found: dict[int, dict[str, float]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    kind = kv_scale_of(name)
                    if kind is not None:
                        found.setdefault(kind[0], {})[kind[1]] = _scalar(name, f.get_tensor(name))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: corrupt or unreadable safetensors file ({e})") from None
    scales = {}
    for layer, pair in sorted(found.items()):
        missing = {"k", "v"} - pair.keys()
        if missing:
            raise ValueError(f"layer {layer} stores a KV-cache scale for {'k' if 'v' in missing else 'v'} "
                             f"but none for {missing.pop()}")
        scales[layer] = (pair["k"], pair["v"])
    return scales


def _scalar(name: str, tensor) -> float:
    if tensor.numel() != 1:
        raise ValueError(f"KV-cache scale {name!r} has shape {list(tensor.shape)}, expected a scalar")
    value = float(tensor.float().item())
    if not value > 0:
        raise ValueError(f"KV-cache scale {name!r} is {value}, expected a positive number")
    return value
