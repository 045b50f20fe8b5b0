"""A request's state as the scheduler and model runner see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.contract.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Blocks are allocated and being filled from outside (a KV pull); not schedulable yet.
    WAITING_FOR_KV = "waiting_for_kv"
    # Blocks are allocated and being filled from this engine's host KV tier; not schedulable yet.
    LOADING_KV = "loading_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


# OpenAI-style finish reasons.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """One sequence. ``block_ids[g]`` is its block table in KV-cache group ``g``.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the tokens still to run are
    ``all_token_ids[num_computed_tokens:]``. After a preemption it drops back to 0 and the prompt
    plus everything generated so far is recomputed.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Tokens served from the prefix cache (device or host tier) when the request was first scheduled.
    num_cached_tokens: int = 0
    # Of those, the tokens loaded back from the host KV tier.
    num_host_cached_tokens: int = 0
    block_ids: list[list[int]] = field(default_factory=list)
    # Keep the KV blocks after finishing until `release` (prefill worker: held for a pull).
    hold_kv_on_finish: bool = False
    # Prefill worker: the prompt's first tokens a peer reads from the host KV tier instead of the
    # held device blocks, as (host block ids per group from token 0, number of tokens).
    host_prefix: tuple[list[list[int]], int] | None = None
    num_preemptions: int = 0
    # Prefill worker sending KV per chunk: (tokens, align): a prompt chunked over several steps ends with a
    # chunk of at most ``tokens`` (the one before ends on a multiple of ``align``, a part boundary), since that
    # chunk's KV is the part its reader waits for after the first token (``leave_final_chunk``).
    final_chunk_cap: tuple[int, int] | None = None
    # Its row of the state pool (models with state layers), from its first allocation until its blocks go.
    state_slot: int | None = None
    # The FP8 KV dtype its K/V are rounded through in this 16-bit cache ("" none): a prefill for an FP8-KV
    # reader (``attention.kv_rounding``). Its blocks hash apart from other requests' (``kv_salt``).
    kv_rounding: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    stop_reason: int | str | None = None

    def leave_final_chunk(self, num_tokens: int) -> int:
        """``num_tokens`` for this running request's next chunk, cut short when it would end the prompt with more
        than ``final_chunk_cap``'s tokens: it then ends on the last multiple of the cap's alignment that leaves at
        most that many for one more step. Only past the first chunk (a prompt that fit one step keeps it); the
        extra step (one more pass over the weights) is small beside a long prompt's prefill."""
        if self.final_chunk_cap is None:
            return num_tokens
        tokens, align = self.final_chunk_cap
        start, prompt_len = self.num_computed_tokens, self.num_prompt_tokens
        if start == 0 or start + num_tokens != prompt_len or num_tokens <= tokens:
            return num_tokens
        cut = -(-(prompt_len - tokens) // align) * align
        return cut - start if start < cut < prompt_len else num_tokens

    @property
    def kv_salt(self) -> bytes:
        """What its prefix-cache hashes add to the engine's salt: blocks of rounded K/V are not plain ones."""
        return f"kv_rounding={self.kv_rounding};".encode() if self.kv_rounding else b""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
