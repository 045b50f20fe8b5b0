"""Joining a TP group: one process per rank on one host, gloo on CPU and NCCL on CUDA."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from services.engine.runner.rank_runtime import use_device

# How long ranks wait for each other: joining the group, and any one collective afterwards.
GROUP_TIMEOUT = timedelta(minutes=10)


def free_init_method() -> str:
    """A rendezvous address on a free local port (every rank runs on this host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def join_group(device: torch.device, rank: int, world_size: int, init_method: str) -> None:
    """Make ``device`` current, then join the group (NCCL binds each rank to its current device)."""
    use_device(device)
    if device.type == "cpu":
        # The ranks talk over loopback; gloo would otherwise pick the interface the hostname names.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # Ranks share the host's cores instead of each starting one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=GROUP_TIMEOUT)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
