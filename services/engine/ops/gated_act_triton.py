"""The gated activation every Triton path of a gated MLP shares: the fused kernel and the GEMV's prologue."""

from __future__ import annotations

import triton
import triton.language as tl

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def gated_act(g, u, GELU: tl.constexpr):
    """``act(g) * u`` in g's dtype: the activation computed in fp32 and rounded before the product, as
    unfused torch rounds it."""
    dtype = g.dtype
    g = g.to(tl.float32)
    if GELU:  # 0.5 * g * (1 + tanh(z)) == g * sigmoid(2 z), without tanh's cancellation near -1
        z = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * z))
    else:
        a = g / (1.0 + tl.exp(-g))
    return (a.to(dtype).to(tl.float32) * u.to(tl.float32)).to(dtype)
