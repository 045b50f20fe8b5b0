"""Engine-level settings: where the model runs, how big the KV cache is, how batches are formed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.engine.tp.parallel import ParallelConfig
from services.kv.layout import BlockOrder, LayoutKind

# services.engine.attention.BACKEND_CHOICES, spelled out so the config (and the CLI) need not import it.
ATTENTION_BACKENDS = ("auto", "torch_sdpa", "triton_paged")

DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF dir, .gguf file, dummy:<preset>; None = bundled SmolLM2
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's 16-bit type (else bfloat16) on CUDA
    device: str = "auto"  # auto: cuda when available
    seed: int = 0
    block_size: int = 16
    kv_layout: LayoutKind = LayoutKind.CROSS_LAYER
    kv_block_order: BlockOrder = BlockOrder.NHD
    num_kv_blocks: int | None = None  # explicit pool size; else sized from the memory budget below
    kv_cache_memory_bytes: int | None = None  # default: 1 GiB on CPU, a share of free memory on CUDA
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = None  # default: the model's max positions, capped by the KV pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (every step runs eagerly)
    # Pipeline decode-graph steps: launch the next before this one's tokens reach the host (LLMEngine.step).
    async_scheduling: bool = True
    # Models with KV-shared layers (Gemma-4) run those layers only for the tokens whose output is
    # read (see TailBatch); False runs every token through every layer (same results, slower).
    kv_shared_prefill_skip: bool = True
    # Attention backend (services/engine/attention/): "torch_sdpa", "triton_paged", or "auto" =
    # triton_paged on CUDA when Triton imports, else torch_sdpa (registry.py says why).
    attention_backend: str = "auto"
    # Host KV tier (services/engine/offload/): bytes of host memory (None or 0: off), and how many
    # device blocks one host span holds (the unit stored, looked up and evicted).
    kv_offload_bytes: int | None = None
    kv_offload_block_factor: int = 1
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected auto, float32, float16 or bfloat16")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.kv_offload_bytes is not None and self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {self.kv_offload_bytes}")
        if self.kv_offload_block_factor < 1:
            raise ValueError(f"kv_offload_block_factor must be >= 1, got {self.kv_offload_block_factor}")
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise ValueError("the host KV tier needs prefix caching: it finds blocks by their hashes")
        if self.kv_offload_bytes and self.parallel.tp_size > 1:
            raise ValueError("the host KV tier runs at TP 1 only for now (each rank would need its own tier)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}; "
                             f"expected one of {', '.join(ATTENTION_BACKENDS)}")

    def resolve_device(self) -> torch.device:
        """The device, with an index for CUDA (``cuda`` is the current one), so it can be made current."""
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
