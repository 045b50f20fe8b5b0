"""Prefill CUDA graphs: buckets, which steps fit, padding into the scratch block, parity with eager.

On CPU the graph runner's static-buffer forward runs without capture (``torch_sdpa``), so the
bucketing and padding are checked there against the eager path step by step: every step the
prefill graphs take runs eagerly first and then through the padded static buffers, over the same
KV; the sampled logits must agree (fp32, 1e-5 relative) and the KV cache must be the same after
both, outside the scratch block (a padding token writing anywhere else shows up there). The runs
cover several chunks per step, later chunks of a chunked prefill, prefix-cache hits, decode rows
beside a chunk, chunks that sample nothing, sliding windows (Mistral) and two KV groups with soft
caps (Gemma-2); once more (Llama) with ``triton_paged`` under Triton's interpreter, whose kernel
must skip the empty rows. With ``PDSERVE_TEST_DEVICE=cuda`` the same runs replay captured graphs over
``triton_paged`` (fp32 and bf16), and the engine's own runner is checked (built unless switched off).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (see triton_kernels.py)

from services.contract.sampling_params import SamplingParams  # noqa: E402
from services.engine.attention.triton_paged import TritonPagedBackend, triton_import_error  # noqa: E402
from services.engine.engine_config import EngineConfig  # noqa: E402
from services.engine.llm_engine import LLMEngine  # noqa: E402
from services.engine.runner import prefill_graphs  # noqa: E402
from services.engine.runner.prefill_graphs import (  # noqa: E402
    PrefillGraphRunner,
    dense_query_limit,
    token_buckets,
)
from services.engine.runner.step import StepLogits  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402

DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
ON_CUDA = pytest.mark.skipif(DEVICE != "cuda", reason="captured graphs need PDSERVE_TEST_DEVICE=cuda")
BLOCK_SIZE = 4
MAX_TOKENS = 40  # token buckets 8, 12, 16, 24, 32, 40
MAX_REQUESTS = 4  # request buckets 1, 2, 4; a step of 5 or 6 requests runs eagerly
PROMPT_LENS = (3, 9, 17, 60)  # the 60-token prompt is chunked (40-token steps)
SHARED = 16  # later prompts share this many tokens with the third: prefix-cache hits


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma2"])  # windows; Gemma-2: 2 groups, caps
def checkpoint(request, tmp_path_factory) -> str:
    directory, _ = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return str(directory)


def _engine(checkpoint: str, device: str = "cpu", dtype: str = "float32", **kwargs) -> LLMEngine:
    config = dict(model=checkpoint, device=device, dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=128,
                  max_num_seqs=6, max_num_batched_tokens=MAX_TOKENS)
    return LLMEngine(EngineConfig(**{**config, **kwargs}))


def _use_graphs(engine: LLMEngine, capture: bool, **kwargs) -> PrefillGraphRunner:
    options = dict(max_requests=MAX_REQUESTS, capture=capture, min_token_bucket=8, min_context_bucket=8,
                   attention_backend=engine.config.attention_backend)
    graphs = PrefillGraphRunner(engine.model, engine.kv_cache, MAX_TOKENS, engine.max_model_len,
                                **{**options, **kwargs})
    engine.runner.prefill_graphs = graphs
    return graphs


@dataclass
class _Chunk:
    token_ids: list[int]
    start: int
    block_ids: list[list[int]]
    samples: bool = True
    return_logits: bool = False
    kv_rounding: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _chunk(num_tokens: int, start: int = 0, **kwargs) -> _Chunk:
    blocks = list(range(-(-(start + num_tokens) // BLOCK_SIZE)))
    return _Chunk([5] * num_tokens, start, [blocks, blocks], **kwargs)  # one table per group: two at most here


def _kv(engine: LLMEngine) -> torch.Tensor:
    """Every layer's K and V outside the scratch block (the last one), as one tensor."""
    scratch = engine.kv_cache.scratch_block
    return torch.stack([torch.cat([k[:scratch].flatten(), v[:scratch].flatten()])
                        for k, v in engine.kv_cache.views.values()]).float()


class StepComparer:
    """Runs each step the prefill graphs take twice, eagerly then through the graphs, and compares."""

    def __init__(self, engine: LLMEngine, rel_tol: float) -> None:
        engine.async_scheduling = False  # every step's tokens on the host, so the eager run can take them
        self.engine = engine
        self.runner = engine.runner
        self.graphs = engine.runner.prefill_graphs
        self.execute = engine.runner.execute
        self.rel_tol = rel_tol
        self.graph_steps = 0
        self.seen = dict(several_chunks=0, later_chunk=0, decode_beside_chunk=0, silent_chunk=0, padded=0)
        engine.runner.execute = self

    def __call__(self, chunks, *device_tokens) -> StepLogits:
        if device_tokens or not self.runner.runs_as_prefill_graph(chunks):
            return self.execute(chunks, *device_tokens)
        self.runner.prefill_graphs = None
        try:
            eager = self.execute(chunks)
        finally:
            self.runner.prefill_graphs = self.graphs
        kv_eager = _kv(self.engine)
        runs = self.graphs.num_runs
        out = self.execute(chunks)
        assert self.graphs.num_runs == runs + 1
        kv_graph = _kv(self.engine)
        assert ((kv_graph - kv_eager).abs().max() <= self.rel_tol * kv_eager.abs().max()).item(), \
            "the padded step wrote KV outside its slots or wrote different values"
        assert out.sample_rows == eager.sample_rows and not out.all_logits
        if out.sample_rows:
            expected = eager.sample_logits.float()
            rel = ((out.sample_logits.float() - expected).abs().max() / expected.abs().max()).item()
            assert rel < self.rel_tol, f"step of {[c.num_tokens for c in chunks]} tokens: relative error {rel:.2e}"
        self._count(chunks, out)
        return out

    def _count(self, chunks, out: StepLogits) -> None:
        self.graph_steps += 1
        lens = [c.num_tokens for c in chunks]
        seen = self.seen
        seen["several_chunks"] += sum(n > 1 for n in lens) > 1
        seen["later_chunk"] += any(c.num_tokens > 1 and c.start > 0 for c in chunks)
        seen["decode_beside_chunk"] += 1 in lens and max(lens) > 1
        seen["silent_chunk"] += len(out.sample_rows) < len(chunks)
        seen["padded"] += sum(lens) not in self.graphs.token_sizes


def _phases(vocab: int) -> list[list[list[int]]]:
    """Prompts added together: the first at once, the second at step 3 (beside running requests),
    each later one when the engine is idle. Most after the first share ``SHARED`` tokens with the
    third first prompt (prefix-cache hits); the 50-token one runs alone as a 40-token chunk and 10 more."""
    rng = random.Random(5)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    first = [tokens(n) for n in PROMPT_LENS]
    shared = first[2][:SHARED]
    return [first, [shared + tokens(7), shared + tokens(21)], [shared + tokens(11)], [tokens(50)],
            [shared + tokens(30), tokens(5)]]


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    """Every request's tokens (see ``_phases``)."""
    phases = _phases(engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    steps = phase = 0
    while phase < len(phases) or engine.has_unfinished_requests():
        if phase < len(phases) and (phase == 0 or steps == 3 or (phase > 1 and not engine.has_unfinished_requests())):
            for i, prompt in enumerate(phases[phase]):
                engine.add_request(f"p{phase}.{i}", prompt, params)
            phase += 1
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
                shares = out.request_id not in ("p0.0", "p0.1", "p0.2", "p0.3", "p3.0", "p4.1")
                assert not shares or out.num_cached_tokens >= SHARED - BLOCK_SIZE, out.request_id
        steps += 1
    return tokens


def _check_parity(checkpoint: str, device: str, dtype: str, rel_tol: float, capture: bool,
                  backend: str = "torch_sdpa") -> PrefillGraphRunner:
    engine = _engine(checkpoint, device=device, dtype=dtype, attention_backend=backend)
    graphs = _use_graphs(engine, capture=capture)
    comparer = StepComparer(engine, rel_tol)
    tokens = _run(engine)
    assert comparer.graph_steps >= 5 and all(comparer.seen.values()), comparer.seen
    assert len({t for t, _, _ in graphs.captured}) >= 3 and {r for _, r, _ in graphs.captured} >= {1, 2, 4}, \
        graphs.captured
    if dtype == "float32":  # a run through the graphs gives the same greedy tokens as one that never uses them
        reference = _engine(checkpoint, device=device, dtype=dtype, attention_backend=backend)
        reference.runner.prefill_graphs = None
        assert tokens == _run(reference)
    return graphs


# ---- buckets and fit ---------------------------------------------------------------------------


def test_token_buckets() -> None:
    assert token_buckets(1024) == (64, 96, 128, 192, 256, 384, 512, 768, 1024)
    assert token_buckets(2000) == (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2000)
    assert token_buckets(MAX_TOKENS, 8) == (8, 12, 16, 24, 32, 40)
    assert token_buckets(40) == (40,)  # a step budget below the smallest bucket


def test_dense_query_limit() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert dense_query_limit([TritonPagedBackend()], cuda) == prefill_graphs.triton_paged.DENSE_MIN_QUERY
    assert dense_query_limit([TritonPagedBackend()], cpu) is None  # the dense path is off on CPU
    assert dense_query_limit([TritonPagedBackend(dense_min_query=0)], cuda) is None
    assert dense_query_limit([TritonPagedBackend(dense_min_query=300), TritonPagedBackend(dense_min_query=200)],
                             cuda) == 200


def test_which_steps_fit(checkpoint: str) -> None:
    engine = _engine(checkpoint)
    graphs = _use_graphs(engine, capture=False, max_graphs=2)
    assert graphs.can_run([_chunk(30), _chunk(10)])
    assert not graphs.can_run([_chunk(30), _chunk(11)])  # 41 tokens
    assert not graphs.can_run([_chunk(2)] * 5)  # 5 requests
    assert not graphs.can_run([_chunk(1, start=4)] * 2)  # decode only: the decode graphs' step
    assert not graphs.can_run([_chunk(3, return_logits=True)])  # every position's logits: eager
    assert not graphs.can_run([_chunk(3, start=engine.max_model_len)])  # beyond the largest context bucket
    with pytest.MonkeyPatch.context() as mp:  # the limit is read from the backends at each step
        mp.setattr(prefill_graphs, "dense_query_limit", lambda *_: 16)
        assert not graphs.can_run([_chunk(16)]) and graphs.can_run([_chunk(15)])  # a dense chunk stays eager
    graphs.run([_chunk(5), _chunk(1, start=9)])
    graphs.run([_chunk(30, start=30)])
    assert graphs.captured == [(8, 2, 12), (32, 1, 64)]  # (tokens, requests, context): context >= tokens
    assert graphs.can_run([_chunk(5), _chunk(2, start=8)])  # an existing bucket
    assert not graphs.can_run([_chunk(20)])  # a new one beyond max_graphs
    with pytest.raises(ValueError):
        graphs.run([_chunk(41)])


def test_off_the_cuda_path_no_runner_is_built(checkpoint: str) -> None:
    engine = _engine(checkpoint)
    assert engine.runner.prefill_graphs is None  # CPU
    with pytest.raises(ValueError, match="CUDA device"):
        PrefillGraphRunner(engine.model, engine.kv_cache, 64, 64, capture=True)
    with pytest.raises(ValueError):
        EngineConfig(prefill_graph_tokens=-1)


# ---- parity ------------------------------------------------------------------------------------


def test_static_buffers_match_eager_on_cpu(checkpoint: str) -> None:
    graphs = _check_parity(checkpoint, "cpu", "float32", rel_tol=1e-5, capture=False)
    assert all(b.graph is None for b in graphs._buckets.values())


def _interpreted_triton() -> bool:
    """Whether Triton imports here and runs interpreted (it does on CPU: see the top of this file)."""
    if triton_import_error() is not None:
        return False
    from services.engine.attention.triton_kernels import interpreting

    return interpreting()


@pytest.mark.skipif(DEVICE == "cuda" or not _interpreted_triton(),
                    reason="Triton's interpreter on CPU (CUDA runs the captured tests)")
def test_triton_paged_static_buffers_match_eager_on_cpu(checkpoint: str) -> None:
    """The kernel skips the empty rows and keeps the padding row in the scratch block (interpreted)."""
    if not checkpoint.endswith("llama0"):
        pytest.skip("one architecture is enough under the interpreter")
    _check_parity(checkpoint, "cpu", "float32", rel_tol=1e-5, capture=False, backend="triton_paged")


def test_tail_skipping_model_runs_eagerly(tmp_path) -> None:
    """Gemma-4 picks its tail rows on the host: eager unless the skip is off, then padded and equal."""
    directory, _ = make_checkpoint("gemma4", tmp_path)
    engine = _engine(str(directory))
    graphs = _use_graphs(engine, capture=False)
    assert not engine.runner.runs_as_prefill_graph([_chunk(5)])
    engine.runner.kv_shared_prefill_skip = False
    comparer = StepComparer(engine, rel_tol=1e-5)
    _run(engine)
    assert comparer.graph_steps >= 5 and graphs.num_runs == comparer.graph_steps


@ON_CUDA
def test_cuda_graphs_match_eager_fp32(checkpoint: str) -> None:
    graphs = _check_parity(checkpoint, "cuda", "float32", rel_tol=1e-5, capture=True, backend="triton_paged")
    assert all(b.graph is not None for b in graphs._buckets.values())


@ON_CUDA
def test_cuda_graphs_match_eager_bf16(checkpoint: str) -> None:
    # Padding changes the matmuls' M and so bf16 rounding: equal-ish only, as for decode graphs.
    _check_parity(checkpoint, "cuda", "bfloat16", rel_tol=5e-2, capture=True, backend="triton_paged")


@ON_CUDA
def test_cuda_engine_builds_prefill_graphs_unless_off(checkpoint: str, monkeypatch) -> None:
    engine = _engine(checkpoint, device="cuda", dtype="bfloat16", max_num_batched_tokens=2048)
    graphs = engine.runner.prefill_graphs
    assert graphs is not None and graphs.token_sizes[-1] == 1024
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate([[5] * 100, [7] * 300], params)  # one step of 400 tokens, two requests
    engine.generate([[9] * 20], SamplingParams(max_tokens=2, ignore_eos=True, return_logits=True))  # eager
    assert graphs.num_runs == 1 and graphs.captured == [(512, 2, 512)], graphs.captured
    assert _engine(checkpoint, device="cuda", prefill_graph_tokens=0).runner.prefill_graphs is None
    assert _engine(checkpoint, device="cuda", enforce_eager=True).runner.prefill_graphs is None
    assert _engine(checkpoint, device="cuda", attention_backend="torch_sdpa").runner.prefill_graphs is None
    monkeypatch.setenv(prefill_graphs.PREFILL_GRAPH_TOKENS_ENV, "0")
    assert _engine(checkpoint, device="cuda").runner.prefill_graphs is None
