"""A follower rank's extension point: the service that handles what rank 0 sends besides steps.

A follower runs steps itself. The KV-transfer messages (``messages.ToService``: open a NIXL agent
on the rank's KV shard, pull into it, forget a peer) go to a rank service the worker layer
installs (``TPGroup.install_rank_service``), so the engine imports no transfer code: it knows
this interface and the plain message values only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec
import torch

from services.engine.kv_cache.buffers import KVCache
from services.engine.tp import messages as m
from services.kv.spec.layout import KVLayoutSpec


@dataclass(frozen=True)
class RankContext:
    """What a rank service may use of its follower: the rank's KV shard (and state slots), and the pipe to rank 0
    (``send`` is thread-safe and ignores a pipe rank 0 already closed)."""

    rank: int
    device: torch.device
    kv_layout: KVLayoutSpec
    kv_cache: KVCache
    send: Callable[[msgspec.Struct], None]
    state_buffer: torch.Tensor | None = None  # the rank's state slots (models with state layers)


class RankService(Protocol):
    def handle(self, message: m.ToService) -> None:
        """Called on the follower's main thread, between steps: must not block on a transfer."""
        ...

    def close(self) -> None:
        """The follower is stopping: release what the service holds (its agent, its threads)."""
        ...


# Builds the service in the follower process; must pickle (a module-level function or class).
RankServiceFactory = Callable[[RankContext], RankService]
