"""Fused elementwise ops of the model layers, each one function dispatching on the device.

Unfused, a layer's elementwise work is many small kernels: RMSNorm is float/pow/mean/add/rsqrt/
mul/cast/mul, rotate-half RoPE is a gather, two casts, negation, cat, multiplies and an add per
tensor, the gated MLP is activation then multiply, and each residual add is its own kernel. Here
each op is one launch:

* ``rms_norm(x, weight, eps, offset, residual)``: RMSNorm, optionally after adding a residual
  (returning the sum too: the residual stream for the next sublayer);
* ``apply_rope(q, k, cos, sin, positions)``: rotate-half RoPE of q and k together;
* ``write_kv(k, v, k_cache, v_cache, write_blocks, write_offsets)``: a step's K and V rows into
  their paged-cache slots (two ``index_put`` scatters unfused), and ``rope_and_write_kv``, the
  same launch rotating q and k first (what an attention layer does before attending);
* ``silu_and_mul`` / ``gelu_tanh_and_mul`` on a fused gate/up projection output, and
  ``act_and_mul`` on separate gate and up tensors;
* ``linear(x, weight, bias)``, ``act_and_linear`` (a down projection of ``act(gate) * up``) and
  ``gated_mlp`` (both projections and the activation between): cuBLAS, except 1 to 32 rows (a small decode
  batch) on CUDA, which take the GEMVs of ``gemv_triton`` (programmatic dependent launch; the activation
  as the down projection's prologue for one row, as the gate/up projection's epilogue for several:
  ``bench/gemv.py``).

Two implementations sit behind each: ``reference.py`` (torch, today's layer math op for op: the
CPU path and the tests' reference) and ``triton_ops.py`` (one Triton kernel per op, computing in
fp32 and rounding where the reference rounds). Which runs is chosen per call from the tensor's
device and the process-wide backend: ``PDSERVE_FUSED_OPS`` read at import, replaced by the engine's
``fused_ops`` setting (``--fused-ops``) when it starts (``configure``) unless the variable is set:

* unset / ``auto`` / ``1``: Triton on CUDA tensors when Triton imports, torch otherwise;
* ``0`` / ``torch``: torch everywhere (the A/B switch: the unfused path);
* ``triton``: Triton everywhere; on CPU that is Triton's interpreter (``TRITON_INTERPRET=1``
  before triton is imported), which is for tests only.

Two more process-wide switches, on by default, set the same way (the engine's setting, unless the
variable is set): ``fused_kv_write`` (``--no-fused-kv-write``, ``PDSERVE_FUSED_KV_WRITE=0``) keeps the
other fused ops but writes K/V unfused (``apply_rope``, then two ``index_put`` scatters): the A/B switch
of the K/V write alone (``bench/gpu_speed_run.sh``, part ``decode_fused``); ``decode_gemv``
(``--no-decode-gemv``, ``PDSERVE_DECODE_GEMV=0``) keeps the other fused ops but gives every projection
to cuBLAS: the A/B switch of the GEMV.

An input a kernel does not handle (another dtype, a norm wider than ``MAX_NORM_COLS``) takes the
torch path. ``triton_ops`` is imported on first use, so a process that never takes a Triton path
never imports triton (the tests rely on that: see ``tests/unit/engine/test_attention_backends.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from services.engine.ops import reference
from services.engine.triton_support import overridden_by_env, switch_from_env, triton_import_error

ENV_VAR = "PDSERVE_FUSED_OPS"
BACKENDS = ("auto", "torch", "triton")
_ALIASES = {"": "auto", "1": "auto", "on": "auto", "true": "auto", "auto": "auto",
            "0": "torch", "off": "torch", "false": "torch", "torch": "torch", "triton": "triton"}
ACTIVATIONS = tuple(reference.ACTIVATIONS)
KV_WRITE_ENV_VAR = "PDSERVE_FUSED_KV_WRITE"
GEMV_ENV_VAR = "PDSERVE_DECODE_GEMV"


def _backend_from_env() -> str:
    value = os.environ.get(ENV_VAR, "auto")
    if value.strip().lower() not in _ALIASES:
        raise ValueError(f"{ENV_VAR}={value!r}: expected auto (or 1), torch (or 0) or triton")
    return _ALIASES[value.strip().lower()]


_backend = _backend_from_env()
_fused_kv_write = switch_from_env(KV_WRITE_ENV_VAR, "1: one launch, 0: rope, then two scatters")
_decode_gemv = switch_from_env(GEMV_ENV_VAR, "1: small-batch projections through the Triton GEMVs, 0: all cuBLAS")
_triton_ops: ModuleType | None = None


def get_backend() -> str:
    """The process-wide backend: ``auto``, ``torch`` or ``triton``."""
    return _backend


def set_backend(name: str) -> str:
    """Set the process-wide backend; returns the previous one."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown fused-ops backend {name!r}; expected one of {', '.join(BACKENDS)}")
    previous, _backend = _backend, name
    return previous


def configure(backend: str | None, *, fused_kv_write: bool, decode_gemv: bool) -> None:
    """The engine's settings of these ops (``EngineConfig.fused_ops``, ``fused_kv_write``, ``decode_gemv``) for
    this process: a ``backend`` of None changes nothing, and each one's variable (``PDSERVE_FUSED_OPS``,
    ``PDSERVE_FUSED_KV_WRITE``, ``PDSERVE_DECODE_GEMV``), when set, wins over it (the A/B switch of a
    benchmark run or a running deployment)."""
    global _fused_kv_write, _decode_gemv
    if backend is not None and not overridden_by_env(ENV_VAR):
        set_backend(backend)
    if not overridden_by_env(KV_WRITE_ENV_VAR):
        _fused_kv_write = fused_kv_write
    if not overridden_by_env(GEMV_ENV_VAR):
        _decode_gemv = decode_gemv


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """``set_backend(name)`` for the duration of a ``with`` block."""
    previous = set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def triton_serves(device: torch.device) -> bool:
    """Whether the fused ops take their Triton path on ``device`` under the process-wide backend (``auto``: CUDA
    when Triton imports; ``triton``: every device; ``torch``: none): what a layer that picks its path once, when it
    is built (``RoutedExperts``' ``fused``), asks."""
    if _backend == "torch" or triton_import_error() is not None:
        return False
    return _backend == "triton" or device.type == "cuda"


def _kernels(x: torch.Tensor) -> ModuleType | None:
    """``triton_ops`` when ``x`` should take the Triton path, else None."""
    global _triton_ops
    if _backend == "torch" or (_backend == "auto" and not (x.is_cuda and triton_import_error() is None)):
        return None
    if _triton_ops is None:
        error = triton_import_error()
        if error is not None:
            raise RuntimeError(f"{ENV_VAR}=triton: {error}")
        from services.engine.ops import triton_ops

        _triton_ops = triton_ops
    return _triton_ops



def _dispatch(name: str, like: torch.Tensor, *args):
    """``name`` from the Triton kernels when they serve ``like``'s device and accept the input (a kernel
    answers None for an input it does not handle), else from the torch reference."""
    kernels = _kernels(like)
    out = getattr(kernels, name)(*args) if kernels is not None else None
    return out if out is not None else getattr(reference, name)(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float | None = None,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, fp32 inside, output in x's dtype; with ``residual``, of
    ``residual + x`` (rounded to x's dtype), returning ``(normed, residual + x)``.

    ``offset`` picks the convention:

    * None -- Llama's ``RMSNorm``: the normalised x is cast to x's dtype, then multiplied by
      ``weight`` in that dtype;
    * a float -- Gemma's ``OffsetRMSNorm``: multiplied by ``offset + weight`` in fp32 (1.0 for
      Gemma-2/3, which store ``weight - 1``; 0.0 for Gemma-4), then cast once. ``weight`` may be
      None (Gemma-4's value norm): normalisation only.

    ``x`` is [..., cols]; a [tokens, heads, cols] view with strided tokens (q or k sliced out of a
    fused projection) is read in place. Outputs are new contiguous tensors.
    """
    return _dispatch("rms_norm", x, x, weight, eps, offset, residual)


def apply_rope(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate-half (NeoX) RoPE of ``q`` [tokens, heads, head_dim] and ``k`` [tokens, kv_heads,
    head_dim] (None: a layer without keys) in one launch; returns new (q, k).

    ``cos``/``sin`` [rows, head_dim] (fp32 tables whose two halves repeat the angles; any
    halves work): a token's row is ``positions[token]`` when ``positions`` is given (a table over
    positions), else the token's index (angles already computed for the step's tokens). They are
    cast to q's dtype before use, and ``x * cos + rotate_half(x) * sin`` is rounded as in torch.
    Partial rotary (Gemma-4's proportional rope) is the same call: its unrotated pairs have
    cos 1 and sin 0.
    """
    return _dispatch("apply_rope", q, q, k, cos, sin, positions)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             write_blocks: torch.Tensor, write_offsets: torch.Tensor, scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Store K and V rows ([tokens, kv_heads, head_dim]) in their cache slots: token ``t`` goes to
    ``cache[write_blocks[t], write_offsets[t]]`` of the [num_blocks, block_size, kv_heads, head_dim]
    views, whatever their strides (per-layer or cross-layer, NHD or HND, ...). Bytes are copied as
    they are into a cache of their dtype; an FP8 cache gets them quantized with ``scales`` (k, v)
    (``ops.fp8_format.quantize``). A slot written twice in one call (padding rows aimed at the scratch
    block) holds one of the rows."""
    if not _fused_kv_write:
        reference.rope_and_write_kv(None, k, v, None, None, None, k_cache, v_cache, write_blocks, write_offsets,
                                    scales)
        return
    _dispatch("rope_and_write_kv", k, None, k, v, None, None, None, k_cache, v_cache, write_blocks, write_offsets,
              scales)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      write_blocks: torch.Tensor, write_offsets: torch.Tensor,
                      scales: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope(q, k, cos, sin, positions)`` then ``write_kv`` of the rotated k and of v, in one
    launch: returns the rotated (q, k), k being exactly the bytes the cache got (before quantization,
    for an FP8 cache). An attention layer's step between its projection (and q/k norms) and its attention."""
    if not _fused_kv_write:
        q, k = apply_rope(q, k, cos, sin, positions)
        write_kv(k, v, k_cache, v_cache, write_blocks, write_offsets, scales)
        return q, k
    return _dispatch("rope_and_write_kv", q, q, k, v, cos, sin, positions, k_cache, v_cache, write_blocks,
                     write_offsets, scales)


def act_and_mul(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` (``activation``: ``silu`` or ``gelu_pytorch_tanh``), the activation rounded
    to the inputs' dtype before the product, as unfused."""
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}")
    return _dispatch("act_and_mul", gate, activation, gate, up)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``nn.functional.linear``); 1 to 32 rows on CUDA through the Triton GEMVs."""
    if not _decode_gemv:
        return reference.linear(x, weight, bias)
    return _dispatch("linear", x, x, weight, bias)


def act_and_linear(activation: str, gate_up: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(act(gate) * up, weight, bias)`` of a fused [..., 2 * inter] gate/up projection output: an MLP's
    down projection. One row on CUDA is one launch (the activation is the GEMV's prologue)."""
    kernels = _kernels(gate_up) if _decode_gemv else None
    out = kernels.act_and_linear(activation, gate_up, weight, bias) if kernels is not None else None
    return out if out is not None else linear(act_and_mul(activation, *gate_up.chunk(2, dim=-1)), weight, bias)


def gated_mlp(activation: str, x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
              down_weight: torch.Tensor, down_bias: torch.Tensor | None) -> torch.Tensor:
    """``down(act(gate) * up)`` of ``gate_up(x)`` (a fused [2 * inter, hidden] gate/up weight): a gated MLP.
    On CUDA one row is two launches (the activation as the down projection's prologue), 2 to
    ``gemv_triton.MAX_ROWS`` rows too (the activation as the gate/up projection's epilogue); more rows, or
    ``decode_gemv`` off, take cuBLAS with the activation's kernel between."""
    kernels = _kernels(x) if _decode_gemv else None
    hidden = kernels.linear_and_act(activation, x, gate_up_weight, gate_up_bias) if kernels is not None else None
    if hidden is not None:
        return linear(hidden, down_weight, down_bias)
    return act_and_linear(activation, linear(x, gate_up_weight, gate_up_bias), down_weight, down_bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused [..., 2 * inter] gate/up projection output -> [..., inter]."""
    return act_and_mul("silu", *gate_up.chunk(2, dim=-1))


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma's ``gelu_pytorch_tanh``) of a fused gate/up output -> [..., inter]."""
    return act_and_mul("gelu_pytorch_tanh", *gate_up.chunk(2, dim=-1))


__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "ENV_VAR",
    "GEMV_ENV_VAR",
    "KV_WRITE_ENV_VAR",
    "act_and_linear",
    "act_and_mul",
    "apply_rope",
    "gated_mlp",
    "gelu_tanh_and_mul",
    "configure",
    "get_backend",
    "linear",
    "rms_norm",
    "rope_and_write_kv",
    "set_backend",
    "silu_and_mul",
    "triton_serves",
    "use_backend",
    "write_kv",
]
