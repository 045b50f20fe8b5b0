"""One ``KVExporter.hand_out`` call as data: the ticket it asks for and which of the exporter's steps it takes.

The options are decided once, when the call comes in, so the steps (the digests, staging, the ticket's
expectations, its signed proto) read them instead of re-deriving them from the arguments: a part ticket or a
whole one (``part``), from the host tier or not (``host``), its KV digested or not (``digest``), its state slot
named and digested (``state_digest``), worth trying to stage or not (``stage``: no host-tier tokens, no state, a
reader whose TP size and block size can read a staged span).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.kv.spec import kv_quant
from services.proto_gen.pdserve.v1 import kv_pb2


@dataclass(frozen=True)
class HandOutPlan:
    """A ticket of tokens ``part_start_token .. num_tokens`` of a prompt of ``num_prompt_tokens`` (0: a whole
    prompt's ticket), as ``KVExporter.hand_out`` documents its arguments, and the steps it takes."""

    request_id: str
    block_ids: Sequence[Sequence[int]]
    num_tokens: int
    first_token_id: int
    first_token_logprob: float
    handshake_address: str
    reader_tp_size: int
    reader_block_size: int
    prompt_hash: bytes
    host_block_ids: Sequence[Sequence[int]]
    num_host_tokens: int
    part_start_token: int
    num_prompt_tokens: int
    state_slot: int | None
    # Where the request's part tickets out so far end when the call came in (None: none out); a part goes out
    # only if that is still so once its digests and staging are done.
    opened: int | None
    digest: bool
    state_digest: bool
    stage: bool
    #: The reader's KV dtype when this engine converts for it (``spec.kv_convert``): always staged; "" otherwise.
    convert: str = ""

    @property
    def whole(self) -> int:
        """The prompt's tokens (a part's window of a sliding group ends there)."""
        return self.num_prompt_tokens or self.num_tokens

    @property
    def last(self) -> bool:
        """The whole ticket, or the request's last part (the one that names its state slot)."""
        return self.num_tokens == self.whole

    @property
    def part(self) -> bool:
        """A part before the last: the request stays open for the next."""
        return self.num_tokens < self.whole

    @property
    def host(self) -> bool:
        """Its first tokens come from the host tier, so each reader notifies once per source."""
        return bool(self.num_host_tokens)

    def ticket(self, engine_id: str, epoch: int, nonce: str, deadline: float, digests: list[kv_pb2.GroupDigests],
               state_digests: list[int], staged: dict[int, int]) -> kv_pb2.TransferTicket:
        """The ticket, unsigned: ``deadline`` its lease's end (wall s), ``staged`` the span's offset per owner rank."""
        return kv_pb2.TransferTicket(
            engine_id=engine_id, epoch=epoch, request_id=self.request_id,
            groups=[kv_pb2.GroupBlocks(group_id=g, block_ids=list(ids)) for g, ids in enumerate(self.block_ids)],
            num_tokens=self.num_tokens, first_token_id=self.first_token_id,
            first_token_logprob=self.first_token_logprob, handshake_address=self.handshake_address,
            num_host_tokens=self.num_host_tokens,
            host_groups=[kv_pb2.GroupBlocks(group_id=g, block_ids=list(ids))
                         for g, ids in enumerate(self.host_block_ids)],
            notify_nonce=nonce, digests=digests, part_start_token=self.part_start_token,
            num_prompt_tokens=self.num_prompt_tokens if self.part or self.part_start_token else 0,
            has_state=self.state_slot is not None, state_slot=self.state_slot or 0, state_digests=state_digests,
            staged_offsets=[staged[r] for r in sorted(staged)],
            staged_kv_dtype=self.convert if staged and kv_quant.is_quantized(self.convert) else "",
            lease_deadline_unix_ms=math.floor(deadline * 1000), prompt_hash=self.prompt_hash,
        )
