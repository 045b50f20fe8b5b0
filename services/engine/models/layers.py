"""Building blocks every architecture shares: linear layers with loader-filled storage, RMSNorm,
rotary embeddings, and the weight-copy helpers.

The elementwise math (norms, RoPE, the gated activation) runs through ``services.engine.ops``:
one fused Triton kernel each on CUDA, today's torch expressions on CPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from services.engine import ops
from services.engine.attention import Rope
from services.engine.model_config.hf import RopeSpec
from services.engine.models.fp8_linear import Fp8Linear, Fp8Part, Fp8Target, row_range
from services.engine.parallel import ParallelConfig


def param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with uninitialised storage: weights always come from a loader."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype, device=device)
        self.bias = param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


def gated_mlp(activation: str, x: torch.Tensor, gate_up_proj: Linear | Fp8Linear,
              down_proj: Linear | Fp8Linear) -> torch.Tensor:
    """``down_proj(act(gate) * up)`` of a fused ``gate_up_proj(x)``: two launches at small decode batches on
    CUDA, the activation fused into one of them (``ops.gated_mlp``); an FP8 projection runs its own GEMM."""
    if isinstance(gate_up_proj, Fp8Linear) or isinstance(down_proj, Fp8Linear):
        return down_proj(ops.act_and_mul(activation, *gate_up_proj(x).chunk(2, dim=-1)))
    return ops.gated_mlp(activation, x, gate_up_proj.weight, gate_up_proj.bias, down_proj.weight, down_proj.bias)


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalised in fp32, cast to x's dtype, then scaled by ``weight``.

    With ``residual``: the norm of ``residual + x``, returned with that sum (``(normed, sum)``),
    in one kernel -- the residual add before a sublayer fused into its input norm.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, self.weight, self.eps, None, residual)


def rope_inv_freq(head_dim: int, rope: RopeSpec) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] for rotate-half RoPE, with the spec's scaling applied.

    ``proportional``: the first ``partial_rotary_factor`` of the pairs get the usual frequencies
    (spaced over the whole head dim), the rest get 0 and so are not rotated.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "proportional":
        num_rotated = int(rope.partial_rotary_factor * head_dim // 2)
        inv_freq[num_rotated:] = 0.0
        return inv_freq / rope.factor
    if rope.rope_type == "yarn":
        return yarn_inv_freq(head_dim, rope)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    blend = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - blend) * scaled / rope.factor + blend * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def yarn_inv_freq(head_dim: int, rope: RopeSpec) -> torch.Tensor:
    """YaRN: pairs that turn more than ``beta_fast`` times over the original context keep their frequency,
    pairs that turn fewer than ``beta_slow`` times are slowed by ``factor``, and the pairs between blend
    linearly (the pair index at which a frequency makes n turns is solved for in closed form)."""
    original = rope.original_max_position_embeddings

    def pair_index(turns: float) -> float:  # where a pair makes `turns` rotations over `original` positions
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = pair_index(rope.beta_fast), pair_index(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp, without dividing by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    powers = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return 1.0 / (rope.factor * powers) * (1 - keep) + 1.0 / powers * keep


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed fp32 cos/sin table indexed by position; applied by
    ``paged_attention`` in the launch that writes the layer's K/V. YaRN's ``cos_sin_scale`` is in the
    table (every other rope type has none)."""

    def __init__(self, head_dim: int, rope: RopeSpec, max_positions: int, device: torch.device) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if rope.cos_sin_scale != 1.0:
            cos, sin = cos * rope.cos_sin_scale, sin * rope.cos_sin_scale
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> Rope:
        """The rope of a step's tokens at ``positions``: the table and the rows to read."""
        return Rope(self.cos, self.sin, positions)


def row_parallel_bias(bias: torch.Tensor, tp: ParallelConfig) -> torch.Tensor:
    """Row-parallel outputs are all-reduced, so only rank 0 adds the bias."""
    return bias if tp.tp_rank == 0 else torch.zeros_like(bias)


def copy_weight(name: str, dest: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(src)


# ---- Gemma-family building blocks ------------------------------------------------------------------
class OffsetRMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast once at the end: ``x_normed * (offset + weight)``.

    Gemma-2/3 store ``weight - 1`` (offset 1); Gemma-4 stores the scale itself (offset 0), and its
    value norm has no weight at all (``with_weight=False``). ``residual`` as in ``RMSNorm``.
    """

    def __init__(self, dim: int, eps: float, offset: float, dtype: torch.dtype, device: torch.device,
                 with_weight: bool = True) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype, device=device) if with_weight else None
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, self.weight, self.eps, self.offset, residual)


def check_activation(name: str) -> str:
    """``name`` if it is an MLP gate activation the fused ops implement (``ModelConfig.hidden_activation``)."""
    if name not in ops.ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}")
    return name


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``: x squashed smoothly into (-cap, cap); identity when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


class RopeAngles(nn.Module):
    """cos/sin of rotate-half RoPE for the given positions, computed on the fly in fp32.

    No position table: a table for Gemma-4's 512-wide full layers over 128K positions would be
    half a GiB. The product ``position * inv_freq`` is the same fp32 value a table would hold.
    """

    def __init__(self, head_dim: int, rope: RopeSpec, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope).to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([n, head_dim], [n, head_dim]) fp32."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def projection_shape(proj: str, kind: str, hidden: int, q_size: int, kv_size: int, intermediate: int
                     ) -> tuple[int, ...]:
    """Full, unsharded HF shape of an attention or MLP projection's weight or bias."""
    rows, cols = {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden), "v_proj": (kv_size, hidden),
                  "o_proj": (hidden, q_size), "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
                  "down_proj": (hidden, intermediate)}[proj]
    return (rows, cols) if kind == "weight" else (rows,)


def load_attention_projection(name: str, attn: nn.Module, proj: str, kind: str, tensor: torch.Tensor,
                              tp: ParallelConfig, num_kv_heads: int, head_dim: int) -> None:
    """Copy an HF q/k/v/o projection into the fused ``qkv_proj`` / ``o_proj``, taking this rank's shard.

    ``attn`` has ``qkv_proj`` (rows: q, then k, then v), ``o_proj``, ``q_size`` and ``kv_size``;
    K/V rows are taken by KV head, so heads replicated over ranks (tp > KV heads) stay whole.
    """
    if proj == "o_proj":
        if kind == "bias":
            return copy_weight(name, attn.o_proj.bias, row_parallel_bias(tensor, tp))
        return copy_weight(name, attn.o_proj.weight, tp.shard(tensor, 1))
    dest = getattr(attn.qkv_proj, kind)
    if proj == "q_proj":
        return copy_weight(name, dest[: attn.q_size], tp.shard(tensor, 0))
    start, end = tp.kv_head_range(num_kv_heads)
    rows = tensor[start * head_dim: end * head_dim]
    offset = attn.q_size + (0 if proj == "k_proj" else attn.kv_size)
    return copy_weight(name, dest[offset: offset + attn.kv_size], rows)


def load_mlp_projection(name: str, mlp: nn.Module, proj: str, kind: str, tensor: torch.Tensor,
                        tp: ParallelConfig) -> None:
    """Copy an HF gate/up/down projection into the fused ``gate_up_proj`` / ``down_proj`` shard."""
    if proj == "down_proj":
        if kind == "bias":
            return copy_weight(name, mlp.down_proj.bias, row_parallel_bias(tensor, tp))
        return copy_weight(name, mlp.down_proj.weight, tp.shard(tensor, 1))
    dest = getattr(mlp.gate_up_proj, kind)
    half = dest.shape[0] // 2
    dest = dest[:half] if proj == "gate_proj" else dest[half:]
    return copy_weight(name, dest, tp.shard(tensor, 0))


def attention_fp8_targets(path: str, hf: str, attn: nn.Module, tp: ParallelConfig, num_kv_heads: int,
                          head_dim: int) -> list[Fp8Target]:
    """Where ``load_attention_projection`` puts the rows of HF's q/k/v/o (``hf``: ``model.layers.N.self_attn``)
    in ``attn``'s ``qkv_proj`` and ``o_proj`` (module paths under ``path``), for an FP8 ``qkv_proj``/``o_proj``."""
    rank, q = tp.tp_rank, attn.q_size
    start, end = tp.kv_head_range(num_kv_heads)
    kv_rows = row_range(start * head_dim, end * head_dim)
    parts = (Fp8Part(f"{hf}.q_proj", row_range(rank * q, (rank + 1) * q)), Fp8Part(f"{hf}.k_proj", kv_rows),
             Fp8Part(f"{hf}.v_proj", kv_rows))
    o_rows = attn.o_proj.weight.shape[0]
    return [Fp8Target(f"{path}.qkv_proj", parts),
            Fp8Target(f"{path}.o_proj", (Fp8Part(f"{hf}.o_proj", row_range(0, o_rows)),), True,
                      (rank, tp.tp_size))]


def mlp_fp8_targets(path: str, hf: str, mlp: nn.Module, tp: ParallelConfig) -> list[Fp8Target]:
    """Where ``load_mlp_projection`` puts HF's gate/up/down rows in ``mlp``'s ``gate_up_proj``/``down_proj``."""
    rank, local = tp.tp_rank, mlp.gate_up_proj.weight.shape[0] // 2
    shard = row_range(rank * local, (rank + 1) * local)
    hidden = mlp.down_proj.weight.shape[0]
    return [Fp8Target(f"{path}.gate_up_proj", (Fp8Part(f"{hf}.gate_proj", shard), Fp8Part(f"{hf}.up_proj", shard))),
            Fp8Target(f"{path}.down_proj", (Fp8Part(f"{hf}.down_proj", row_range(0, hidden)),), True,
                      (rank, tp.tp_size))]
