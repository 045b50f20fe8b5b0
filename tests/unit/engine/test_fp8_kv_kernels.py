"""FP8 KV cache in the Triton paths: the fused RoPE + K/V write, ``triton_paged`` (paged, split-K, the dense
prefill plan) and ``triton_mla``, each against the torch path on the same e4m3 cache.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET`` set before triton is
imported, as ``test_attention_backends.py`` does; float32 only, small shapes). With a GPU the same tests run the
compiled kernels, in bfloat16 too, and the engine-level tests at the end (CUDA only): ``triton_paged`` +
``triton_mla`` engines with an FP8 cache give ``torch_sdpa``'s greedy tokens, and decode CUDA graphs (the
scales baked into the captured launches) give eager's.

The write is exact: the kernel's e4m3 bytes equal ``ops.fp8_format.quantize``'s. Attention compares within the
tolerance of two float32 (or bf16) orders of summation over the same dequantized values.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from services.contract.sampling_params import SamplingParams  # noqa: E402
from services.engine import ops  # noqa: E402
from services.engine.attention import step_batch  # noqa: E402
from services.engine.attention.mla import TorchMLABackend  # noqa: E402
from services.engine.attention.torch_sdpa import TorchSDPABackend  # noqa: E402
from services.engine.attention.triton_mla import TritonMLABackend  # noqa: E402
from services.engine.attention.triton_paged import TritonPagedBackend  # noqa: E402
from services.engine.engine_config import EngineConfig  # noqa: E402
from services.engine.kv_cache.buffers import KVCache  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402
from services.engine.loading.source import resolve_model  # noqa: E402
from services.engine.ops import fp8_format, reference  # noqa: E402
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec  # noqa: E402
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = pytest.mark.skipif(DEVICE.type != "cuda", reason="engine-level FP8 kernels need a CUDA device")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
SCALES = (0.37, 1.7)
MIXED = ((1, 37), (7, 37), (1, 5), (9, 9), (1, 70))


def _fp8_cache(kind: LayoutKind, order: BlockOrder, num_blocks: int, heads: int, head_dim: int, block_size: int,
               window: int | None = None) -> KVCache:
    attention = AttentionKind.FULL if window is None else AttentionKind.SLIDING_WINDOW
    group = KVCacheGroupSpec(0, attention, (0, 1, 2), block_size, window, heads, head_dim)
    return KVCache(KVLayoutSpec(kind, order, num_blocks, heads, head_dim, "float8_e4m3fn", (group,)), DEVICE)


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_write_stores_the_reference_bytes(rope: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, head_dim = 11, 4, 2, 16
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = (torch.randn(tokens, kv_heads, head_dim, generator=gen) * 80).to(dtype).to(DEVICE)  # some past 448 * 0.37
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    angles = torch.randn(tokens, head_dim // 2, generator=gen).repeat(1, 2).to(DEVICE)
    cos, sin = (angles.cos(), angles.sin()) if rope else (None, None)
    blocks = torch.randperm(6, generator=gen)[:tokens // 4 + 1].repeat_interleave(4)[:tokens].to(DEVICE)
    offsets = (torch.arange(tokens) % 4).to(DEVICE)
    cache = _fp8_cache(LayoutKind.CROSS_LAYER, BlockOrder.HND, 6, kv_heads, head_dim, 4)
    k_view, v_view = cache.views[1]
    with ops.use_backend("triton"):
        if rope:
            _, k_rotated = ops.rope_and_write_kv(q, k, v, cos, sin, None, k_view, v_view, blocks, offsets, SCALES)
        else:
            ops.write_kv(k, v, k_view, v_view, blocks, offsets, SCALES)
    if rope:  # the rotation as torch rounds it (float32: up to an FMA's ulp on CUDA), returned unquantized
        k_torch = reference.apply_rope(q, k, cos, sin)[1]
        # bf16: the kernel rounds once, torch after each op (max error over max value, as test_fused_kv_write)
        assert _rel_error(k_rotated, k_torch) < (1e-6 if dtype == torch.float32 else 2e-2)
    expected_cache = _fp8_cache(LayoutKind.CROSS_LAYER, BlockOrder.HND, 6, kv_heads, head_dim, 4)
    ref_k, ref_v = expected_cache.views[1]
    # The bytes the cache must hold: the kernel's own rotated k (what it returns), quantized by ops.kv_fp8.
    reference.rope_and_write_kv(None, k_rotated if rope else k, v, None, None, None, ref_k, ref_v, blocks, offsets,
                                SCALES)
    torch_buf, triton_buf = expected_cache.buffers[0], cache.buffers[0]
    same = torch_buf.view(torch.uint8) == triton_buf.view(torch.uint8)
    if DEVICE.type == "cpu":
        # Triton 3.7's interpreter rounds float32 -> e4m3 wrongly where the rounding carries into the next
        # power of two (124.6 -> 64, not 128); the compiled cvt does not. Those elements only are let through.
        expected = torch_buf.float()
        carried = (expected.abs() == 2 ** expected.abs().log2().round()) & (triton_buf.float() == expected / 2)
        same |= carried
    assert bool(same.all()), "the kernel's e4m3 bytes differ from ops.fp8_format.quantize's"
    assert not triton_buf.float().isnan().any() and triton_buf.float().abs().max() == 448  # saturated, not NaN


class Fp8Problem:
    """A mixed batch over an FP8 cache written through the engine's write: one layout view, random scales."""

    def __init__(self, requests, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 window: int | None = None, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        q_lens, ctx_lens = [q for q, _ in requests], [c for _, c in requests]
        per_req = [-(-c // block_size) for c in ctx_lens]
        num_blocks = sum(per_req) + 1
        self.cache = _fp8_cache(LayoutKind.CROSS_LAYER, BlockOrder.NHD, num_blocks, kv_heads, head_dim, block_size,
                                window)
        ids = torch.randperm(num_blocks, generator=gen).tolist()
        width = max(per_req) + 1
        tables = []
        for n in per_req:
            table, ids = ids[:n], ids[n:]
            tables.append(table + [0] * (width - n))
        self.tables = torch.tensor(tables, device=DEVICE)
        k_view, v_view = self.cache.views[1]
        self.k = torch.randn(*k_view.shape, generator=gen).to(dtype).to(DEVICE) * 3
        self.v = torch.randn(*v_view.shape, generator=gen).to(dtype).to(DEVICE)
        k_view.copy_(fp8_format.quantize(self.k, SCALES[0]))
        v_view.copy_(fp8_format.quantize(self.v, SCALES[1]))
        self.step = step_batch(q_lens, ctx_lens, DEVICE)
        self.q = torch.randn(self.step.num_tokens, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        self.window = window

    def fresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's chunk K/V as the layer computed it (before quantization)."""
        bs = self.k.shape[1]
        lens = enumerate(zip(*self.step.host_lens, strict=True))
        rows = [(self.tables[i][p // bs], p % bs) for i, (q_len, ctx) in lens for p in range(ctx - q_len, ctx)]
        blocks = torch.tensor([int(b) for b, _ in rows], device=DEVICE)
        slots = torch.tensor([s for _, s in rows], device=DEVICE)
        return self.k[blocks, slots], self.v[blocks, slots]

    def run(self, backend, softcap: float | None = None, fresh=None, kv_scale=SCALES) -> torch.Tensor:
        none = torch.empty(0, dtype=torch.long, device=DEVICE)
        meta = backend.build_metadata(self.step, self.tables, none, none, self.window)
        k_cache, v_cache = self.cache.views[1]
        return backend.forward(self.q, k_cache, v_cache, self.step.with_groups((meta,)), meta,
                               self.q.shape[-1] ** -0.5, softcap, fresh, kv_scale=kv_scale)


def _rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert not got.isnan().any()
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("splits", "softcap", "window"), [(1, None, None), (3, None, None), (2, 3.0, None),
                                                           (1, None, 12)], ids=["paged", "split3", "softcap",
                                                                                "window"])
def test_triton_paged_reads_fp8_like_torch_sdpa(dtype: torch.dtype, splits: int, softcap: float | None,
                                                window: int | None) -> None:
    problem = Fp8Problem(MIXED, 4, 2, 16, 16, dtype, window)
    expected = problem.run(TorchSDPABackend(), softcap)
    got = problem.run(TritonPagedBackend(num_splits=splits), softcap)
    assert _rel_error(got, expected) < TOLERANCE[dtype]
    unscaled = problem.run(TritonPagedBackend(num_splits=splits), softcap, kv_scale=(1.0, 1.0))
    assert _rel_error(unscaled, expected) > 0.1, "the kernel must apply the scales"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_plan_attends_to_the_fresh_tokens_as_the_cache_holds_them(dtype: torch.dtype) -> None:
    """A long chunk's fresh K/V go through the dense kernel: rounded through e4m3 first, so the answer is the
    paged one (a prefix from a transfer and a colocated prefill read the same values)."""
    problem = Fp8Problem(((24, 40), (20, 20), (1, 30)), 4, 2, 16, 16, dtype)
    expected = problem.run(TorchSDPABackend())
    dense = TritonPagedBackend(num_splits=1, dense_min_query=16)
    assert dense.build_metadata(problem.step, problem.tables, problem.tables[0], problem.tables[0], None).dense
    got = problem.run(dense, fresh=problem.fresh())
    assert _rel_error(got, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_mla_absorbed_reads_fp8_rows_like_torch_mla(dtype: torch.dtype, splits: int) -> None:
    gen = torch.Generator().manual_seed(1)
    latent, rope, heads, block_size = 32, 8, 4, 16
    requests = ((1, 37), (1, 5), (4, 20))
    q_lens, ctx_lens = [q for q, _ in requests], [c for _, c in requests]
    per_req = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(per_req)
    group = KVCacheGroupSpec(0, AttentionKind.MLA, (0, 1, 2), block_size, None, 1, latent + rope)
    cache = KVCache(KVLayoutSpec(LayoutKind.CROSS_LAYER, BlockOrder.NHD, num_blocks, 1, latent + rope,
                                 "float8_e4m3fn", (group,)), DEVICE)
    (rows,) = cache.views[1]
    rows.copy_(fp8_format.quantize(torch.randn(*rows.shape, generator=gen).to(DEVICE) * 2, SCALES[0]))
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [ids[sum(per_req[:i]):sum(per_req[:i + 1])] + [0] * (max(per_req) - n) for i, n in enumerate(per_req)]
    tables = torch.tensor(tables, device=DEVICE)
    step = step_batch(q_lens, ctx_lens, DEVICE)
    q = torch.randn(step.num_tokens, heads, latent + rope, generator=gen).to(dtype).to(DEVICE)
    none = torch.empty(0, dtype=torch.long, device=DEVICE)
    outs = []
    for backend in (TorchMLABackend(), TritonMLABackend(num_splits=splits)):
        meta = backend.build_metadata(step, tables, none, none, None)
        outs.append(backend.forward_absorbed(q, rows, latent, step.with_groups((meta,)), meta, 0.1, SCALES[0]))
    assert _rel_error(outs[1], outs[0]) < TOLERANCE[dtype]


def test_writing_fp8_through_the_reference_matches_ops_fp8() -> None:
    cache = torch.zeros(1, 2, 1, 4, dtype=torch.float8_e4m3fn)
    k = torch.tensor([[[0.1, 7.0, -1000.0, 3.3]]])
    reference.rope_and_write_kv(None, k, k, None, None, None, cache, cache, torch.tensor([0]), torch.tensor([1]),
                                (0.3, 0.3))
    assert torch.equal(cache[0, 1].view(torch.uint8), fp8_format.quantize(k[0], 0.3).view(torch.uint8))


# ---- engine level, CUDA only ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    if DEVICE.type != "cuda":
        pytest.skip("engine-level FP8 kernels need a CUDA device")
    return {arch: str(make_checkpoint(arch, tmp_path_factory.mktemp(arch))[0]) for arch in ("llama", "deepseek_v3")}


def _greedy(checkpoint: str, scales: dict[int, tuple[float, float]], **kw) -> list[list[int]]:
    source = dataclasses.replace(resolve_model(checkpoint), kv_scales=scales)
    config = EngineConfig(model=checkpoint, device="cuda", dtype="float32", kv_cache_dtype="fp8_e4m3",
                          block_size=16, num_kv_blocks=256, **kw)
    prompts = [[(7 * i + 3) % 300 + 10 for i in range(n)] for n in (5, 40, 300)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in LLMEngine(config, source).generate(prompts, params)]


@CUDA
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_cuda_triton_fp8_engine_matches_torch_sdpa(checkpoints: dict[str, str], arch: str) -> None:
    scales = {0: (0.37, 1.7), 1: (1.3, 0.23), 2: (0.61, 1.0)} if arch == "deepseek_v3" else {0: (0.37, 1.7),
                                                                                               1: (1.3, 0.23)}
    expected = _greedy(checkpoints[arch], scales, attention_backend="torch_sdpa", enforce_eager=True,
                       fused_ops="torch")
    assert _greedy(checkpoints[arch], scales, attention_backend="triton_paged", enforce_eager=True,
                   dense_min_query=16) == expected
    assert _greedy(checkpoints[arch], scales, attention_backend="triton_paged") == expected  # decode graphs


@CUDA
def test_cuda_fp8_pool_is_fp8(checkpoints: dict[str, str]) -> None:
    config = EngineConfig(model=checkpoints["llama"], device="cuda", kv_cache_dtype="fp8_e4m3", num_kv_blocks=64)
    engine = LLMEngine(config)
    assert engine.kv_cache.buffers[0].dtype == torch.float8_e4m3fn
    assert engine.runner.decode_graphs is not None


def test_fp8_caches_take_the_torch_paths_below_sm89(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton has no e4m3 before Ada: an FP8 cache on an A100 is declined by the paged backend (so ``auto`` picks
    torch_sdpa; the fused write declines it by the same test) instead of failing to compile at the first launch."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "8.9" in TritonPagedBackend().unsupported_reason(64, fp8_format.FP8_DTYPE, gpu)
    assert TritonPagedBackend().unsupported_reason(64, torch.bfloat16, gpu) is None
    assert not fp8_format.fp8_kernels_run_on(gpu) and fp8_format.fp8_kernels_run_on(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert TritonPagedBackend().unsupported_reason(64, fp8_format.FP8_DTYPE, gpu) is None
