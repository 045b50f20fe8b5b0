"""The fused K/V write (``ops.write_kv``, ``ops.rope_and_write_kv``): one Triton launch against the
torch reference (two ``index_put`` scatters, after ``apply_rope``).

Every case writes into views of a real KV layout -- per-layer and cross-layer, NHD and HND,
heads-outer (a block's heads outermost, built here by hand), and two layouts no spec makes (heads
above blocks, head_dim not innermost) -- so the kernel must read every stride from the view. The
caches start random, and the kernel's buffers must equal the reference's byte for byte afterwards:
every slot written, nothing else touched. A step ends in padding rows aimed at slot 0 of the
scratch block, as a decode graph's are (same token, same position: identical rows, so whichever
lands last the bytes are the same).

With RoPE the rotated k may differ from torch's by an ulp when compiled (FMA contraction; see
``test_fused_ops.py``), so the cache is compared with the reference scatter of the kernel's own
returned k -- what the cache got is exactly what attention's ``fresh`` keys are -- and the rotation
itself against ``reference.apply_rope`` within the dtype's tolerance.

CPU runs the kernel in Triton's interpreter (``TRITON_INTERPRET`` set before triton is imported, as
in ``test_fused_ops.py``); ``PDSERVE_TEST_DEVICE=cuda`` (or a visible GPU) runs it compiled, plus a
CUDA-graph capture.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

DEVICE = torch.device(os.environ.get("PDSERVE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
ON_CPU = DEVICE.type == "cpu"
if ON_CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see the module docstring)
pytest.importorskip("triton")

from services.engine import ops, triton_support  # noqa: E402
from services.engine.attention import Rope, paged_attention  # noqa: E402
from services.engine.attention.base import step_batch  # noqa: E402
from services.engine.attention.torch_sdpa import TorchSDPABackend  # noqa: E402
from services.engine.kv_cache.buffers import KVCache  # noqa: E402
from services.engine.model_config.hf import RopeSpec  # noqa: E402
from services.engine.models.layers import RopeAngles, RotaryEmbedding  # noqa: E402
from services.engine.ops import reference, triton_ops  # noqa: E402
from services.engine.runner.cuda_graphs import capture_graph  # noqa: E402
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec  # noqa: E402
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind  # noqa: E402
from tests.sm90_compile import compile_script_lines  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # max abs error / max abs value
NUM_LAYERS = 3  # views of the middle layer: offset and strided in cross-layer buffers
LAYER = 1
Views = tuple[torch.Tensor, torch.Tensor]


def _spec_views(kind: LayoutKind, order: BlockOrder) -> Callable[[int, int, int, int, torch.dtype], tuple]:
    def make(num_blocks: int, block_size: int, heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
        group = KVCacheGroupSpec(0, AttentionKind.FULL, tuple(range(NUM_LAYERS)), block_size)
        cache = KVCache(KVLayoutSpec(kind, order, num_blocks, heads, head_dim, DTYPE_NAMES[dtype], (group,)), DEVICE)
        return cache.buffers, lambda buffers: _views_of(cache, buffers)
    return make


def _views_of(cache: KVCache, buffers: list[torch.Tensor]) -> Views:
    """The middle layer's (K, V) views of the layout, onto ``buffers`` (a copy of the cache's)."""
    out = []
    for kv in (0, 1):
        v = cache.spec.view(LAYER, kv)
        out.append(torch.as_strided(buffers[v.buffer_index], v.shape, v.strides, v.offset))
    return out[0], out[1]


def _dims_views(order: str) -> Callable[[int, int, int, int, torch.dtype], tuple]:
    """One contiguous buffer of every layer's K and V whose dims are ``order``, outermost first: B
    blocks, H heads, L layers, K (K or V), S slots, D head_dim. ``BLKSHD`` is the cross-layer NHD
    layout; the ones here are those no spec above makes."""
    def make(num_blocks: int, block_size: int, heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
        sizes = dict(B=num_blocks, H=heads, L=NUM_LAYERS, K=2, S=block_size, D=head_dim)
        strides, step = {}, 1
        for dim in reversed(order):
            strides[dim], step = step, step * sizes[dim]
        buffer = torch.zeros(step, dtype=dtype, device=DEVICE)

        def views(buffers: list[torch.Tensor]) -> Views:
            shape = (num_blocks, block_size, heads, head_dim)
            view_strides = tuple(strides[dim] for dim in "BSHD")
            return tuple(torch.as_strided(buffers[0], shape, view_strides, LAYER * strides["L"] + kv * strides["K"])
                         for kv in (0, 1))
        return [buffer], views
    return make


LAYOUTS = {
    "per_layer-NHD": _spec_views(LayoutKind.PER_LAYER, BlockOrder.NHD),
    "per_layer-HND": _spec_views(LayoutKind.PER_LAYER, BlockOrder.HND),
    "cross_layer-NHD": _spec_views(LayoutKind.CROSS_LAYER, BlockOrder.NHD),
    "cross_layer-HND": _spec_views(LayoutKind.CROSS_LAYER, BlockOrder.HND),
    "heads_outer": _spec_views(LayoutKind.HEADS_OUTER, BlockOrder.HND),  # a head's plane holds every block
    "heads_inside_blocks": _dims_views("BHLKSD"),
    "head_dim_strided": _dims_views("BLKSDH"),
}
# (tokens, padding rows, query heads, KV heads, head_dim, block size): Llama-8B-like decode heads,
# and a small-head chunk spanning several blocks.
SHAPES = {"d128-h32/8-t3+2": (3, 2, 32, 8, 128, 16), "d64-h4/2-t9+3": (9, 3, 4, 2, 64, 4)}
LLAMA3_ROPE = RopeSpec(500000.0, "llama3", 8.0, 1.0, 4.0, 64)


class WriteCase:
    """A step's q/k/v (sliced out of one fused projection, as the models do), the slots of its
    tokens (scattered blocks; padding rows on slot 0 of the scratch block) and a random cache."""

    def __init__(self, layout: str, shape: str, dtype: torch.dtype, index_dtype: torch.dtype = torch.int64,
                 table: bool = True, seed: int = 7) -> None:
        tokens, pad, heads, kv_heads, head_dim, block_size = SHAPES[shape]
        gen = torch.Generator().manual_seed(seed)
        num_blocks = 2 * tokens + 2
        scratch = num_blocks - 1
        qkv = torch.randn(tokens + pad, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2.0
        qkv[tokens:] = qkv[tokens]  # padding rows: the same token (id 0, position 0) each
        qkv = qkv.to(dtype).to(DEVICE)
        self.q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
        self.k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
        self.v = qkv[:, (heads + kv_heads) * head_dim:].view(-1, kv_heads, head_dim)
        blocks = torch.randperm(num_blocks - 1, generator=gen)[:tokens].tolist() + [scratch] * pad
        offsets = torch.randint(0, block_size, (tokens,), generator=gen).tolist() + [0] * pad
        self.write_blocks = torch.tensor(blocks, dtype=index_dtype, device=DEVICE)
        self.write_offsets = torch.tensor(offsets, dtype=index_dtype, device=DEVICE)
        positions = torch.randint(1, 4000, (tokens,), generator=gen).tolist() + [0] * pad
        self.positions = torch.tensor(positions, device=DEVICE)
        if table:
            emb = RotaryEmbedding(head_dim, LLAMA3_ROPE, 4096, DEVICE)
            self.rope = Rope(emb.cos, emb.sin, self.positions)
        else:
            self.rope = Rope(*RopeAngles(head_dim, RopeSpec(10000.0), DEVICE)(self.positions))
        buffers, self.views_onto = LAYOUTS[layout](num_blocks, block_size, kv_heads, head_dim, dtype)
        self.initial = [torch.randn(b.shape, generator=gen).to(dtype).to(DEVICE) for b in buffers]

    def fresh_cache(self) -> tuple[list[torch.Tensor], Views]:
        buffers = [b.clone() for b in self.initial]
        return buffers, self.views_onto(buffers)

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.write_blocks, self.write_offsets


def _rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _assert_same_bytes(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for g, e in zip(got, expected, strict=True):  # as integers: NaN-free, -0.0 != 0.0
        as_int = torch.int16 if g.element_size() == 2 else torch.int32
        assert torch.equal(g.view(as_int), e.view(as_int))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_write_kv_equals_the_two_scatters(layout: str, shape: str, dtype: torch.dtype) -> None:
    case = WriteCase(layout, shape, dtype)
    got_buffers, (k_cache, v_cache) = case.fresh_cache()
    expected_buffers, (k_ref, v_ref) = case.fresh_cache()
    out = triton_ops.rope_and_write_kv(None, case.k, case.v, None, None, None, k_cache, v_cache, *case.slots())
    assert out is not None, "the kernel declined the input"
    reference.rope_and_write_kv(None, case.k, case.v, None, None, None, k_ref, v_ref, *case.slots())
    _assert_same_bytes(got_buffers, expected_buffers)
    assert out[0] is None and out[1] is case.k


@pytest.mark.parametrize("table", [True, False], ids=["table", "angles"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rope_and_write_kv(layout: str, shape: str, dtype: torch.dtype, table: bool) -> None:
    index_dtype = torch.int32 if table else torch.int64  # the engine's slots are int64; int32 works too
    case = WriteCase(layout, shape, dtype, index_dtype, table)
    got_buffers, (k_cache, v_cache) = case.fresh_cache()
    rope = case.rope
    q, k = triton_ops.rope_and_write_kv(case.q, case.k, case.v, rope.cos, rope.sin, rope.positions, k_cache, v_cache,
                                        *case.slots())
    expected_q, expected_k = reference.apply_rope(case.q, case.k, rope.cos, rope.sin, rope.positions)
    assert _rel_error(q, expected_q) < TOLERANCE[dtype] and _rel_error(k, expected_k) < TOLERANCE[dtype]
    if ON_CPU and dtype != torch.bfloat16:  # the interpreter rounds fp16/fp32 as torch (see test_fused_ops)
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    expected_buffers, (k_ref, v_ref) = case.fresh_cache()
    reference.rope_and_write_kv(None, k, case.v, None, None, None, k_ref, v_ref, *case.slots())
    _assert_same_bytes(got_buffers, expected_buffers)  # the cache got exactly the returned k, and v as is


def test_inputs_the_kernel_declines_take_the_scatters() -> None:
    """float64, a cache of another dtype, float slot indices: the kernel says None; ``ops.write_kv``
    still writes (float64) through the reference."""
    case = WriteCase("cross_layer-NHD", "d64-h4/2-t9+3", torch.float32)
    _, (k_cache, v_cache) = case.fresh_cache()
    k64, v64 = case.k.double(), case.v.double()
    assert triton_ops.rope_and_write_kv(None, k64, v64, None, None, None, k_cache, v_cache, *case.slots()) is None
    assert triton_ops.rope_and_write_kv(None, case.k, case.v, None, None, None, k_cache.half(), v_cache,
                                        *case.slots()) is None
    blocks = case.write_blocks.float()
    assert triton_ops.rope_and_write_kv(None, case.k, case.v, None, None, None, k_cache, v_cache, blocks,
                                        case.write_offsets) is None
    k_cache, v_cache = k_cache.double(), v_cache.double()
    with ops.use_backend("triton"):
        ops.write_kv(k64, v64, k_cache, v_cache, *case.slots())
    assert torch.equal(k_cache[case.write_blocks[:9], case.write_offsets[:9]], k64[:9])
    assert torch.equal(v_cache[case.write_blocks[:9], case.write_offsets[:9]], v64[:9])


def test_paged_attention_writes_through_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer with a ``Rope`` rotates and writes in one ``rope_and_write_kv`` call (no separate
    ``apply_rope``), without one in one ``write_kv`` launch; either way the attention output equals
    the torch path's, which also proves the backend got the rotated keys."""
    case = WriteCase("per_layer-HND", "d64-h4/2-t9+3", torch.float32)
    calls = []
    for name in ("rope_and_write_kv", "apply_rope"):
        real = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *args, _name=name, _real=real: calls.append(_name) or _real(*args))
    num_tokens = case.q.shape[0]
    # each token a request whose context ends at its slot, in a one-block table
    batch = step_batch([1] * num_tokens, (case.write_offsets + 1).tolist(), DEVICE)
    tables = case.write_blocks[:, None].to(torch.int64)
    meta = TorchSDPABackend().build_metadata(batch, tables, *case.slots(), None)
    outs = {}
    for backend in ("torch", "triton"):
        _, (k_cache, v_cache) = case.fresh_cache()
        with ops.use_backend(backend):
            outs[backend] = paged_attention(case.q, case.k, case.v, k_cache, v_cache, batch, meta, 0.125,
                                            rope=case.rope)
            outs[backend, "no rope"] = paged_attention(case.q, case.k, case.v, k_cache, v_cache, batch, meta, 0.125)
    assert calls == ["rope_and_write_kv", "rope_and_write_kv"]
    assert _rel_error(outs["triton"], outs["torch"]) < 1e-5
    assert _rel_error(outs["triton", "no rope"], outs["torch", "no rope"]) < 1e-5


def test_unfused_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PDSERVE_FUSED_KV_WRITE=0``: RoPE through its own kernel, then the scatters; same bytes."""
    for value, on in (("1", True), ("0", False)):
        monkeypatch.setenv(ops.KV_WRITE_ENV_VAR, value)
        assert triton_support.switch_from_env(ops.KV_WRITE_ENV_VAR, "") is on
    monkeypatch.setenv(ops.KV_WRITE_ENV_VAR, "yes")
    with pytest.raises(ValueError, match="PDSERVE_FUSED_KV_WRITE"):
        triton_support.switch_from_env(ops.KV_WRITE_ENV_VAR, "")
    case = WriteCase("cross_layer-NHD", "d64-h4/2-t9+3", torch.float16)
    calls = []
    for name in ("rope_and_write_kv", "apply_rope"):
        real = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *args, _name=name, _real=real: calls.append(_name) or _real(*args))
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(ops, "_fused_kv_write", fused)
        buffers, (k_cache, v_cache) = case.fresh_cache()
        with ops.use_backend("triton"):
            q, k = ops.rope_and_write_kv(case.q, case.k, case.v, case.rope.cos, case.rope.sin, case.rope.positions,
                                         k_cache, v_cache, *case.slots())
            ops.write_kv(k, case.v, k_cache, v_cache, *case.slots())
        results[fused] = (q, k, buffers)
    assert calls == ["rope_and_write_kv", "rope_and_write_kv", "apply_rope"]
    (q, k, buffers), (q_unfused, k_unfused, buffers_unfused) = results[True], results[False]
    assert torch.equal(q, q_unfused) and torch.equal(k, k_unfused)  # one rotation, in either kernel
    _assert_same_bytes(buffers, buffers_unfused)


@pytest.mark.skipif(ON_CPU, reason="CUDA graphs need a GPU")
def test_capture_in_a_cuda_graph() -> None:
    """The launch is capturable (no host syncs) and replays on new tokens and slots."""
    case = WriteCase("cross_layer-HND", "d128-h32/8-t3+2", torch.bfloat16)
    buffers, (k_cache, v_cache) = case.fresh_cache()
    rope = case.rope

    def step():
        with ops.use_backend("triton"):
            return ops.rope_and_write_kv(case.q, case.k, case.v, rope.cos, rope.sin, rope.positions, k_cache,
                                         v_cache, *case.slots())

    graph, _, (q, k) = capture_graph(torch.device("cuda"), None, step)  # compiles outside the capture
    other = WriteCase("cross_layer-HND", "d128-h32/8-t3+2", torch.bfloat16, seed=8)
    for t, new in ((case.q, other.q), (case.k, other.k), (case.v, other.v), (case.positions, other.positions + 5),
                   (case.write_offsets, (other.write_offsets + 1) % 16)):
        t.copy_(new)
    for b, initial in zip(buffers, case.initial, strict=True):
        b.copy_(initial)
    graph.replay()
    torch.cuda.synchronize()
    expected_q, expected_k = reference.apply_rope(case.q, case.k, rope.cos, rope.sin, case.positions)
    assert _rel_error(q, expected_q) < TOLERANCE[torch.bfloat16] and _rel_error(k, expected_k) < 2e-2
    expected_buffers, (k_ref, v_ref) = case.fresh_cache()
    reference.rope_and_write_kv(None, k, case.v, None, None, None, k_ref, v_ref, *case.slots())
    _assert_same_bytes(buffers, expected_buffers)


_COMPILE_FOR_SM90 = r"""
import torch
from services.engine.ops import triton_ops as to
from tests.sm90_compile import compile_for_sm90

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
for dtype, head_dim, rope, positions in ((torch.bfloat16, 128, True, True), (torch.bfloat16, 256, True, False),
                                         (torch.float32, 64, False, False)):
    t = TYPES[dtype]
    half, block_half, block_r, warps = to._kv_write_tiles(head_dim)
    print(f"rope_and_write_kv {dtype} {head_dim} rope={rope}", compile_for_sm90(
        to._rope_write_kv_kernel,
        dict(Q=t, K=t, V=t, QOut=t, KOut=t, KCache=t, VCache=t, Cos="*fp32", Sin="*fp32", Positions="*i64",
             WriteBlocks="*i64", WriteOffsets="*i64"),
        dict(HALF=half, BLOCK_HALF=block_half, BLOCK_R=block_r, HAS_POSITIONS=positions, ROPE=rope, PDL=rope),
        num_warps=warps))
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90_without_spills() -> None:
    assert len(compile_script_lines(_COMPILE_FOR_SM90)) == 3
