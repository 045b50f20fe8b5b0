"""The host (CPU) KV tier: offloading full device blocks to host memory and loading them back on a hit."""

from services.engine.offload.host_tier import HostKVTier, HostTierStats, LoadResult, num_spans_for

__all__ = ["HostKVTier", "HostTierStats", "LoadResult", "num_spans_for"]
