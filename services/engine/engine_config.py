"""Engine-level settings: where the model runs, how big the KV cache is, how batches are formed.

The fields that are command-line flags carry them (``services.common.config_flags``): this class is the
one place the engine's flags are written. Torch-free, so a parser can be built without torch.

The speed switches (``prefill_graph_tokens``, ``fused_ops``, ``decode_gemv``, ``fused_kv_write``, ``pdl``,
``dense_min_query``) each have a ``PDSERVE_*`` variable that, when set, wins over the field: the A/B switch of
a benchmark run (``bench/gpu_speed_run.sh``), for engines built in code as well as from flags. Each rank applies
them to its process when it builds its runtime; ``services/engine/README.md`` has them in one table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.config_flags import flag, non_negative_int, positive_int
from services.engine.parallel import ParallelConfig
from services.kv.spec.layout import BlockOrder, LayoutKind

if TYPE_CHECKING:
    import torch

# services.engine.attention.BACKEND_CHOICES, spelled out so the config (and the CLI) need not import it.
ATTENTION_BACKENDS = ("auto", "torch_sdpa", "triton_paged")
# services.engine.ops.BACKENDS, likewise.
FUSED_OPS_BACKENDS = ("auto", "torch", "triton")

DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}

#: How a quantized checkpoint runs: ``auto`` keeps its FP8 weights and computes FP8 GEMMs on CUDA devices of
#: compute capability 8.9+, dequantized at load elsewhere; ``none`` dequantizes to ``--dtype`` at load everywhere
#: (A/B runs); ``fp8`` computes in FP8 on every device (on CPU through the exact torch reference: for tests).
QUANTIZATION_CHOICES = ("auto", "none", "fp8", "mxfp4")
#: ``--kv-cache-dtype`` spellings -> the KV layout's dtype (torch's name); ``auto`` is the model dtype.
KV_CACHE_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                   "fp8_e4m3": "float8_e4m3fn"}


def _gib_to_bytes(gib: float) -> int | None:
    return int(gib * 2**30) if gib else None


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = flag(None, "HF model directory, .gguf file or dummy:<preset> (default: bundled "
                                   "SmolLM2-135M-Instruct)")
    # auto: float32 on CPU, the checkpoint's 16-bit type (else bfloat16) on CUDA
    dtype: str = flag("auto", "auto, float32, float16 or bfloat16")
    quantization: str = flag("auto", "how an FP8 or MXFP4 checkpoint runs: auto (FP8 weights and GEMMs on CUDA "
                                     "devices of compute capability 8.9+, MXFP4 experts on CUDA, else dequantized "
                                     "at load), none (dequantized to --dtype at load), fp8 (FP8 GEMMs on every "
                                     "device; on CPU the slow exact reference) or mxfp4 (MXFP4 experts on every "
                                     "device; on CPU the torch reference)", choices=QUANTIZATION_CHOICES)
    # auto: the model dtype; fp8_e4m3 stores K/V as float8 e4m3 with per-layer scales (half the bytes of bf16)
    kv_cache_dtype: str = flag("auto", "dtype of the KV cache: auto (the model dtype), float32, bfloat16, float16 or "
                                       "fp8_e4m3 (per-layer scales: the checkpoint's k_scale/v_scale, else 1.0)",
                               choices=("auto", *KV_CACHE_DTYPES))
    device: str = flag("auto", "auto, cpu, cuda[:N] (rank r on cuda:N+r) or a comma list with one entry per TP rank")
    seed: int = flag(0, "seed for dummy weights", parse=int)
    block_size: int = flag(16, "KV block size in tokens", parse=int)
    parallel: ParallelConfig = flag(help="tensor-parallel size: ranks, one process each", name="--tp",
                                    default_factory=ParallelConfig, parse=positive_int, cli_default=1,
                                    to_field=lambda tp: ParallelConfig(tp, 0))
    # None: auto (kv_layout_choice() resolves both from peer_tp_size)
    kv_layout: LayoutKind | None = flag(
        None, "KV cache placement (services/kv/spec/layout.py): per_layer, cross_layer (a block of every layer is one "
        "run), heads_outer (heads outermost over the whole pool: a head's slice of consecutive blocks is one run, "
        "for pulls between different TP sizes; HND blocks) or auto (default): heads_outer when --peer-tp-size "
        "differs from --tp, else cross_layer", cli_default="auto",
        to_field=lambda kind: None if kind == "auto" else LayoutKind(kind),
        choices=("auto", *(k.value for k in LayoutKind)))
    kv_block_order: BlockOrder | None = flag(
        None, "token-major (NHD) or head-major (HND) KV blocks; HND keeps a head's slice of a block contiguous, "
        "which pairs of different TP sizes read far faster. Default: HND when --peer-tp-size differs from --tp or "
        "the layout is heads_outer, else NHD", cli_default=None,
        to_field=lambda order: BlockOrder(order) if order else None, choices=tuple(o.value for o in BlockOrder))
    # The TP size of the engines on the other side of KV transfers (decode's for a prefill worker, prefill's
    # for a decode worker); only the automatic KV layout reads it. pdserve up fills it in.
    peer_tp_size: int | None = flag(None, "TP size of the workers this one exchanges KV with (the decode workers' "
                                          "for a prefill worker, the prefill workers' for a decode worker; pdserve "
                                          "up sets it): a different size than --tp makes --kv-layout auto pick "
                                          "heads_outer and HND blocks", parse=positive_int)
    # explicit pool size; else sized from the memory budget below
    num_kv_blocks: int | None = flag(None, "KV pool size in blocks (default: from memory)", parse=int)
    kv_cache_memory_bytes: int | None = None  # default: 1 GiB on CPU, a share of free memory on CUDA
    gpu_memory_utilization: float = 0.85
    # default: the model's max positions, capped by the KV pool
    max_model_len: int | None = flag(None, "", parse=int)
    max_num_seqs: int = flag(64, "", parse=int)
    max_num_batched_tokens: int = flag(2048, "", parse=int)
    enable_prefix_caching: bool = flag(True, "", name="--no-prefix-caching", negated=True)
    enable_chunked_prefill: bool = True
    # True: no CUDA graphs for decode steps (every step runs eagerly)
    enforce_eager: bool = flag(False, "run decode steps eagerly (no CUDA graphs)")
    # Prefill steps of up to this many tokens (a few chunks, no dense-attention chunk) replay CUDA
    # graphs captured per token bucket (runner/prefill_graphs.py); 0 runs them eagerly.
    prefill_graph_tokens: int = flag(1024, "largest prefill step (tokens) run from CUDA graphs; 0: every prefill "
                                           "step eager; $PDSERVE_PREFILL_GRAPH_TOKENS overrides it", parse=int)
    # Pipeline decode-graph steps: launch the next before this one's tokens reach the host (LLMEngine.step).
    async_scheduling: bool = flag(True, "wait for each decode step's tokens before launching the next (default: "
                                        "pipelined)", name="--no-async-scheduling", negated=True)
    # Models with KV-shared layers (Gemma-4) run those layers only for the tokens whose output is
    # read (see TailBatch); False runs every token through every layer (same results, slower).
    kv_shared_prefill_skip: bool = flag(True, "run every prompt token through KV-shared layers (Gemma-4) instead of "
                                              "only the sampled ones", name="--no-kv-shared-prefill-skip",
                                        negated=True)
    # Fused elementwise ops (services/engine/ops/): None leaves the process-wide setting
    # (PDSERVE_FUSED_OPS, else auto); the variable, when set, overrides this field.
    fused_ops: str | None = flag(None, "fused elementwise kernels: auto (Triton on CUDA when it imports), torch "
                                       "(the unfused reference, for A/B runs) or triton; $PDSERVE_FUSED_OPS "
                                       "overrides it", choices=FUSED_OPS_BACKENDS)
    # Projections of 1 to 32 rows (decode batches) on CUDA through the Triton GEMVs (ops/gemv_triton.py);
    # False gives every projection to cuBLAS.
    decode_gemv: bool = flag(True, "give the projections of decode batches up to 32 rows to cuBLAS instead of the "
                                   "Triton GEMVs; $PDSERVE_DECODE_GEMV (1 or 0) overrides it",
                             name="--no-decode-gemv", negated=True)
    # An attention layer's RoPE of q/k and both K/V cache writes in one launch (ops.rope_and_write_kv);
    # False: RoPE, then two index_put scatters.
    fused_kv_write: bool = flag(True, "rotate q/k and write K/V into the cache as three steps (RoPE, two scatters) "
                                      "instead of one launch; $PDSERVE_FUSED_KV_WRITE (1 or 0) overrides it",
                                name="--no-fused-kv-write", negated=True)
    # Programmatic dependent launch of the Triton kernels on Hopper and later (triton_support.pdl_enabled).
    pdl: bool = flag(True, "launch the Triton kernels without programmatic dependent launch (on by default on "
                           "Hopper and later); $PDSERVE_PDL (1 or 0) overrides it", name="--no-pdl", negated=True)
    # Attention backend (services/engine/attention/): "torch_sdpa", "triton_paged", or "auto" =
    # triton_paged on CUDA when Triton imports, else torch_sdpa (registry.py says why).
    attention_backend: str = flag("auto", "attention kernels: triton_paged reads the paged KV cache in place (CUDA), "
                                          "torch_sdpa gathers it and runs masked SDPA (any device); auto: "
                                          "triton_paged on CUDA when Triton imports, else torch_sdpa",
                                  choices=ATTENTION_BACKENDS)
    # A prefill chunk of at least this many fresh tokens attends to itself through the dense kernel on CUDA
    # (triton_paged's dense plan; 0: never). triton_paged.DENSE_MIN_QUERY, spelled out (the config is torch-free).
    dense_min_query: int = flag(1024, "on CUDA with triton_paged, a prefill chunk of at least this many tokens "
                                      "attends to itself through the dense (cuDNN) kernel, its prefix paged; 0: "
                                      "never; $PDSERVE_DENSE_MIN_QUERY overrides it", parse=non_negative_int)
    # Host KV tier (services/engine/offload/): bytes of host memory (None or 0: off), and how many
    # device blocks one host span holds (the unit stored, looked up and evicted).
    kv_offload_bytes: int | None = flag(
        None, "host (CPU) KV tier size in GiB, pinned on CUDA: full blocks are copied there as they are computed, "
        "and a later prompt with the same prefix loads them back instead of recomputing (default 0: off)",
        name="--kv-offload-gib", parse=float, cli_default=0.0, to_field=_gib_to_bytes)
    kv_offload_block_factor: int = flag(1, "device blocks per host-tier span, the unit the tier stores, looks up "
                                           "and evicts", parse=positive_int)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected auto, float32, float16 or bfloat16")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"unknown quantization {self.quantization!r}; expected {', '.join(QUANTIZATION_CHOICES)}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; expected auto, "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens}")
        if self.dense_min_query < 0:
            raise ValueError(f"dense_min_query must be >= 0, got {self.dense_min_query}")
        if self.kv_offload_bytes is not None and self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {self.kv_offload_bytes}")
        if self.peer_tp_size is not None and self.peer_tp_size < 1:
            raise ValueError(f"peer_tp_size must be >= 1, got {self.peer_tp_size}")
        kind, order = self.kv_layout_choice()
        if order not in kind.orders:
            raise ValueError(f"--kv-layout {kind.value} holds {'/'.join(o.value for o in kind.orders)} blocks: "
                             f"--kv-block-order {order.value} cannot go with it")
        if self.kv_offload_block_factor < 1:
            raise ValueError(f"kv_offload_block_factor must be >= 1, got {self.kv_offload_block_factor}")
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise ValueError("the host KV tier needs prefix caching: it finds blocks by their hashes")
        if self.kv_offload_bytes and self.parallel.tp_size > 1:
            raise ValueError("the host KV tier runs at TP 1 only for now (each rank would need its own tier)")
        if self.fused_ops is not None and self.fused_ops not in FUSED_OPS_BACKENDS:
            raise ValueError(f"unknown fused_ops {self.fused_ops!r}; expected one of {', '.join(FUSED_OPS_BACKENDS)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}; "
                             f"expected one of {', '.join(ATTENTION_BACKENDS)}")

    def kv_layout_choice(self) -> tuple[LayoutKind, BlockOrder]:
        """The KV layout kind and block order, with auto resolved: engines of different TP sizes read head
        slices of each other's blocks, which a heads-outer layout keeps one run per block (``services/kv/
        layout.py``); equal sizes read whole blocks, which cross-layer NHD does as well. An explicit order
        that heads-outer cannot hold (NHD) makes auto pick cross-layer."""
        mixed_tp = self.peer_tp_size is not None and self.peer_tp_size != self.parallel.tp_size
        kind = self.kv_layout
        if kind is None:
            heads_outer = mixed_tp and self.kv_block_order in (None, *LayoutKind.HEADS_OUTER.orders)
            kind = LayoutKind.HEADS_OUTER if heads_outer else LayoutKind.CROSS_LAYER
        order = self.kv_block_order
        if order is None:
            order = BlockOrder.HND if mixed_tp or BlockOrder.NHD not in kind.orders else BlockOrder.NHD
        return kind, order

    def resolve_device(self) -> torch.device:
        """The device, with an index for CUDA (``cuda`` is the current one), so it can be made current."""
        import torch

        name = self.device if self.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(name)
        if device.type != "cuda":
            return device
        if not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but no CUDA device is available")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r}: only {torch.cuda.device_count()} CUDA devices are visible")
        return torch.device("cuda", index)

    def resolve_dtype(self, device: torch.device, checkpoint_dtype: str | None) -> str:
        if self.dtype != "auto":
            return DTYPE_ALIASES[self.dtype]
        if device.type == "cpu":
            return "float32"
        if checkpoint_dtype in ("float16", "bfloat16"):
            return checkpoint_dtype
        return "bfloat16"

    def resolve_kv_cache_dtype(self, model_dtype: str) -> str:
        """The KV layout's dtype (torch's name): ``--kv-cache-dtype``, or the model dtype for auto."""
        return model_dtype if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[self.kv_cache_dtype]
