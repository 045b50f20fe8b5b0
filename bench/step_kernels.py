"""GPU time per engine step by kind of kernel, from a torch.profiler run (``bench/profile_step.py``).

Kernel names are matched by substring, first kind first; a kernel no kind claims is listed under
``other`` by name, so a new kernel shows up instead of hiding in a total.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.autograd import DeviceType

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("projections (GEMV / cuBLAS)", ("gemv", "nvjet", "gemm", "xmma", "cutlass", "splitk")),
    ("attention (+ split reduce)", ("_attention_kernel", "_reduce_kernel", "_mla_kernel", "flash", "fmha")),
    ("RoPE and K/V write", ("rope", "index_put", "scatter")),
    ("norms and activation", ("rms_norm", "act_and_mul", "norm", "silu", "gelu")),
    ("sampling and copies", ("argmax", "copy", "memcpy", "memset", "fill", "index", "cat")),
)


def kind_of(kernel: str) -> str | None:
    name = kernel.lower()
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    return None


def kernel_kinds_table(events: Iterable, steps: int) -> str:
    """ms of GPU time per step by kind (kernels only), the unclaimed ones by name."""
    per_kind: dict[str, float] = {}
    other: dict[str, float] = {}
    for e in events:
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        us = getattr(e, "self_cuda_time_total", 0.0) if us is None else us
        kind = kind_of(e.key)
        if kind is None:
            other[e.key] = other.get(e.key, 0.0) + us
        else:
            per_kind[kind] = per_kind.get(kind, 0.0) + us
    total = sum(per_kind.values()) + sum(other.values())
    lines = [f"GPU time per step by kind ({steps} steps), ms:"]
    for kind, _ in KINDS:
        lines.append(f"  {kind:<32} {per_kind.get(kind, 0.0) / steps / 1e3:8.3f}")
    for name, us in sorted(other.items(), key=lambda kv: -kv[1]):
        lines.append(f"  other: {name[:60]:<60} {us / steps / 1e3:8.3f}")
    lines.append(f"  {'all kernels':<32} {total / steps / 1e3:8.3f}")
    return "\n".join(lines)
