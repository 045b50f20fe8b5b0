"""Mamba2's chunked SSD scan for prefill in Triton: ``chunked_scan_triton``'s five launches with Mamba2's parts.

What is Mamba2's here, and nothing else: one decay rate per head (``A = -exp(A_log)``) times the time step
(``dt = clamp(softplus(dt + dt_bias))``, computed in the cumsum launch from the raw projection), the time step
as the input's weight, B and C read per group of heads (no copy per head), and the D skip and the ``silu(z)``
gate fused into the output, which is then the gated norm's input. Every request of a prefill step runs in the
same launches (``scan_chunks``), each from its state slot (zero when it starts at token 0), its final state
written back in place.

``ssd_scan`` is the same over one sequence with the torch reference's contract (``models/mamba2.ssd_scan``):
what the tests and the benchmark compare.
"""

from __future__ import annotations

import torch

from services.engine.ops import chunked_scan_triton as scan
from services.engine.ops.scan_chunks import ScanChunks, scan_chunks


def ssd_chunks(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               ssm_states: torch.Tensor, table: ScanChunks, a_is_log: bool = True, dt_bias: torch.Tensor | None = None,
               dt_limit: tuple[float, float] = (0.0, float("inf")), d_skip: torch.Tensor | None = None,
               z: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The scan of every sequence of ``table``. ``x`` [tokens, heads, head_dim]; ``dt`` [tokens, heads], raw:
    softplus of ``dt + dt_bias`` clamped to ``dt_limit`` when ``dt_bias`` is given, else taken as it is; ``a``
    [heads]: ``A_log`` (the decay rate is ``-exp(a)``), or the rate itself when not ``a_is_log``; ``b``/``c``
    [tokens, groups, d_state] (views of the conv output are fine: last dims contiguous); ``ssm_states`` [slots,
    heads, head_dim, d_state] fp32, read and written in the table's slots. Returns y [tokens, heads * head_dim]
    in ``out_dtype``, ``+ D x`` and ``* silu(z)`` when given."""
    w, cum = scan.chunk_cumsum(dt, a, table, dt_bias, softplus=dt_bias is not None, dt_limit=dt_limit,
                               a_is_log=a_is_log)
    qk = scan.chunk_qk(c, b, table)
    states = scan.chunk_states(x, b, w, cum, table)
    scan.pass_states(states, cum, table, ssm_states)
    return scan.chunk_output(x, c, qk, w, cum, states, table, d_skip, z, out_dtype)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``models/mamba2.ssd_scan`` in the kernels: x [L, heads, head_dim], dt [L, heads] (already softplus'ed),
    ``a`` [heads] (negative), b/c [L, groups, d_state] (groups dividing heads), ``state`` [heads, head_dim,
    d_state] (not changed). Returns y [L, heads, head_dim] and the final state, fp32."""
    length, heads, head_dim = x.shape
    table = scan_chunks([length], [0], [False], chunk_size, x.device)
    slots = state.detach().float().clone().unsqueeze(0)
    y = ssd_chunks(x, dt, a, b, c, slots, table, a_is_log=False)
    return y.view(length, heads, head_dim), slots[0]
