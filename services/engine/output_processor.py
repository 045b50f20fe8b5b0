"""What a request shows its caller after each step: ``RequestOutput``, built by ``OutputProcessor``.

The processor keeps each live request's engine-side companions (RNG, text stream, grammar matcher,
logits and logprob entries), checks stops after every new token (stop tokens and lengths, stop
strings through the text stream, a finished or broken grammar) and turns a request's progress into
the delta the daemons stream. The step loop (``llm_engine``) never builds an output itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.contract.outputs import TopLogprobs
from services.contract.structured import StructuredOutputError
from services.engine.request import Request, RequestStatus
from services.engine.runner.sampler import make_generator, top_logprobs_of
from services.engine.sched.scheduler_output import ScheduledChunk
from services.engine.sched.stopping import check_token_stop
from services.engine.structured.backend import GrammarMatcher
from services.text.stream import TextStream
from services.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What a request produced in one step (``new_*``) and so far."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    # (first position, logits [n, vocab]) for every chunk computed so far, in order; positions
    # may repeat after a preemption (only with SamplingParams.return_logits).
    logits: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # With SamplingParams.top_logprobs: one entry per output token (empty for a first token that came
    # with pulled KV: the prefill worker reported its alternatives).
    top_logprobs: list[TopLogprobs] | None = None
    # With SamplingParams.prompt_logprobs, once the prompt is computed: one entry per prompt token, the
    # first None; each entry's first pair is the prompt token itself, then the alternatives.
    prompt_logprobs: list[TopLogprobs | None] | None = None


@dataclass
class RequestState:
    """Engine-side companions of a Request: RNG, text stream (detokenizer and stop strings), text."""

    request: Request
    generator: torch.Generator | None
    text_stream: TextStream | None  # None without a tokenizer: no text, stop strings ignored
    text: str = ""
    emitted_tokens: int = 0
    logits: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    grammar: GrammarMatcher | None = None  # with SamplingParams.structured: where the output is in its grammar
    grammar_failed: bool = False
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # Prompt position -> its entry (see RequestOutput.prompt_logprobs); kept across a preemption.
    prompt_logprobs: dict[int, TopLogprobs] = field(default_factory=dict)


def prompt_logprobs_of(chunk: ScheduledChunk, logits: torch.Tensor) -> dict[int, TopLogprobs]:
    """Position -> entry for the prompt tokens this chunk's logits predict (position ``p``'s logits
    predict token ``p + 1``): the token's own logprob first, then ``prompt_logprobs`` alternatives."""
    request, k = chunk.request, chunk.request.sampling_params.prompt_logprobs or 0
    num_prompt = request.num_prompt_tokens
    n = min(chunk.num_tokens, num_prompt - 1 - chunk.start)  # positions whose next token is in the prompt
    if n <= 0:
        return {}
    rows = logits[:n].float()
    targets = torch.as_tensor(request.prompt_token_ids[chunk.start + 1: chunk.start + 1 + n], device=rows.device)
    log_normalizer = torch.logsumexp(rows, dim=-1, keepdim=True)
    own = (rows.gather(1, targets.unsqueeze(1)) - log_normalizer).squeeze(1).tolist()
    top_ids, top_values = top_logprobs_of(rows, k, log_normalizer) if k else (None, None)
    top_ids = top_ids.tolist() if k else [[]] * n
    top_values = top_values.tolist() if k else [[]] * n
    token_ids = targets.tolist()
    return {chunk.start + 1 + i: TopLogprobs((token_ids[i], *top_ids[i]), (own[i], *top_values[i])) for i in range(n)}


def _prompt_logprobs_list(state: RequestState, request: Request) -> list[TopLogprobs | None] | None:
    """The prompt's entries in order once every prompt position is computed, else None."""
    entries = state.prompt_logprobs
    num_prompt = request.num_prompt_tokens
    if len(entries) < num_prompt - 1:
        return None
    return [None] + [entries[p] for p in range(1, num_prompt)]


class OutputProcessor:
    """The live requests' states, and the outputs built from them.

    ``finish_request(request_id, status)`` retires a request that met a stop (the scheduler's
    ``finish_request``: it frees or holds the blocks and sets the finished status the output reports).
    """

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], max_model_len: int,
                 device: torch.device, finish_request: Callable[[str, RequestStatus], None]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.device = device
        self.finish_request = finish_request
        self._states: dict[str, RequestState] = {}

    # ---- the states ----------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def state(self, request_id: str) -> RequestState:
        return self._states[request_id]

    def add(self, request: Request, grammar: GrammarMatcher | None = None) -> RequestState:
        """A new request's state: its RNG (seeded sampling), text stream and grammar."""
        p = request.sampling_params
        generator = make_generator(p.seed, self.device) if p.seed is not None and not p.greedy else None
        stream = TextStream(self.tokenizer, request.prompt_token_ids, p.stop) if self.tokenizer else None
        state = self._states[request.request_id] = RequestState(request, generator, stream, grammar=grammar)
        return state

    def discard(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    # ---- what a step adds ------------------------------------------------------------------------
    def record_logits(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """A chunk's all-position logits: kept if asked for, and its prompt tokens' logprob entries."""
        state = self._states[chunk.request.request_id]
        params = chunk.request.sampling_params
        if params.return_logits:
            state.logits.append((chunk.start, logits.cpu()))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs.update(prompt_logprobs_of(chunk, logits))

    def record_top_logprobs(self, request_id: str, entry: TopLogprobs) -> None:
        """The alternatives of a request's newest token (an empty entry: reported elsewhere)."""
        self._states[request_id].top_logprobs.append(entry)

    def accept_grammar_tokens(self, requests: list[Request]) -> None:
        """Advance each grammar past its request's new token; a token it refuses (a bug) aborts the request."""
        for request in requests:
            grammar = self._states[request.request_id].grammar
            if grammar is None:
                continue
            try:
                grammar.accept(request.output_token_ids[-1])
            except StructuredOutputError:
                log.exception("request %s: sampled a token its grammar refuses; aborting it", request.request_id)
                self._states[request.request_id].grammar_failed = True

    # ---- outputs ---------------------------------------------------------------------------------
    def output(self, request: Request) -> RequestOutput:
        """The request's delta since its last output; a request that met a stop is finished here."""
        state = self._states[request.request_id]
        new_tokens = request.output_token_ids[state.emitted_tokens:]
        state.emitted_tokens = request.num_output_tokens
        status = check_token_stop(request, self.eos_token_ids, self.max_model_len)
        if state.grammar_failed:
            status = RequestStatus.FINISHED_ABORTED
        elif status is None and state.grammar is not None and state.grammar.is_finished():
            status = RequestStatus.FINISHED_STOPPED  # the document is complete
        new_text = ""
        if state.text_stream is not None:
            new_text = state.text_stream.feed(new_tokens, final=status is not None)
            if state.text_stream.stopped:  # a stop string, possibly one that waited for the text's end
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, state.text_stream.matched
        state.text += new_text
        if status is not None:
            self.finish_request(request.request_id, status)
            del self._states[request.request_id]
        p = request.sampling_params
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            new_token_ids=new_tokens,
            text=state.text,
            new_text=new_text,
            logprobs=list(request.output_logprobs) if p.logprobs else None,
            finished=request.finished,
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            logits=state.logits if p.return_logits else [],
            top_logprobs=list(state.top_logprobs) if p.top_logprobs else None,
            prompt_logprobs=_prompt_logprobs_list(state, request) if p.prompt_logprobs is not None else None,
        )
