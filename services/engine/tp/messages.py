"""What rank 0 and a follower rank say to each other over their pipe (msgspec msgpack, tagged).

The follower itself handles: rank 0 -> follower ``Allocate`` (the agreed block count), ``Step``
(run this batch), ``InstallService`` (the rank service for the messages below), ``Shutdown``;
follower -> rank 0 ``Hello`` (loaded; this many blocks fit) and ``Fatal`` (the follower is going
down, with why).

The rank service the worker layer installs (``rank_service``) handles the KV-transfer messages
(``ToService``): ``OpenAgent`` (create the NIXL agent and register the KV shard), ``Read`` (pull
KV into this rank), ``Digest`` (checksum KV of this rank), ``RemovePeer``; its answers
(``FromService``: ``AgentOpened``, ``ReadDone``, ``DigestDone``, ``Notifications``, NIXL
notifications pushed as they arrive) go to the handler rank 0's worker layer registers with
``TPGroup.on_message``. These are plain values: no transfer code here.
"""

from __future__ import annotations

import msgspec


class StepChunk(msgspec.Struct, array_like=True, frozen=True):
    """One chunk of a step as a follower runs it (``runner.step.Chunk``): the tokens, where they
    start, and the block tables up to the last block the chunk touches."""

    token_ids: list[int]
    start: int
    num_tokens: int
    samples: bool
    return_logits: bool
    block_ids: list[list[int]]
    state_slot: int | None = None  # the request's state row (models with state layers)
    kv_rounding: str = ""  # the FP8 dtype its K/V are rounded through (``attention.kv_rounding``)


class Step(msgspec.Struct, tag=True):
    chunks: list[StepChunk]


class Hello(msgspec.Struct, tag=True):
    rank: int
    num_blocks: int


class Allocate(msgspec.Struct, tag=True):
    num_blocks: int


class OpenAgent(msgspec.Struct, tag=True):
    name: str


class Region(msgspec.Struct, array_like=True):
    address: int
    length: int
    device_id: int
    kind: str


class AgentOpened(msgspec.Struct, tag=True):
    name: str
    metadata: bytes
    regions: list[Region]
    state_region: Region | None = None  # the rank's state slots (models with state layers)


class Read(msgspec.Struct, tag=True):
    """READ ``remote_rows`` of the peer into ``local_rows`` (uint64 [n, 3] arrays as bytes)."""

    id: int
    peer_metadata: bytes
    local_rows: bytes
    remote_rows: bytes
    notify: bytes
    remote_mem_kind: str
    timeout_s: float


class ReadDone(msgspec.Struct, tag=True):
    """``error`` empty on success; ``timed_out``/``aborted`` mirror ``TransferTimeout``."""

    id: int
    num_bytes: int = 0
    num_descriptors: int = 0
    error: str = ""
    timed_out: bool = False
    aborted: bool = True


class Digest(msgspec.Struct, tag=True):
    """KV digests of this rank's shard: ``jobs`` is a msgpack list of ``services.kv.digest.scheme.DigestJob``."""

    id: int
    jobs: bytes


class StateDigest(msgspec.Struct, tag=True):
    """The digest of runs ``(offset, length, key)`` of state slot ``slot`` of this rank (models with state layers);
    answered by a ``DigestDone`` of one unit."""

    id: int
    slot: int
    runs: list[tuple[int, int, int]]


class DigestDone(msgspec.Struct, tag=True):
    """Each job's unit digests (uint64 arrays as bytes), or ``error``."""

    id: int
    units: list[bytes] = []
    error: str = ""


class RemovePeer(msgspec.Struct, tag=True):
    name: str


class Notifications(msgspec.Struct, tag=True):
    by_peer: dict[str, list[bytes]]


class Fatal(msgspec.Struct, tag=True):
    rank: int
    error: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class InstallService(msgspec.Struct, tag=True):
    """``factory``: a pickled ``rank_service.RankServiceFactory`` (a module-level callable, which
    pickles by name: the follower imports its module)."""

    factory: bytes


ToService = OpenAgent | Read | Digest | StateDigest | RemovePeer
FromService = AgentOpened | ReadDone | DigestDone | Notifications
ToFollower = Step | Allocate | InstallService | Shutdown | ToService
ToLeader = Hello | Fatal | FromService

_encoder = msgspec.msgpack.Encoder()
to_follower = msgspec.msgpack.Decoder(ToFollower)
to_leader = msgspec.msgpack.Decoder(ToLeader)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)
