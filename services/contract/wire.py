"""SamplingParams to and from the worker proto, and logprob entries to it (where the two shapes meet)."""

from __future__ import annotations

from collections.abc import Sequence

from services.contract.outputs import TopLogprobs
from services.contract.sampling_params import SamplingParams, StructuredSpec
from services.proto_gen.pdserve.v1 import worker_pb2

# Trailing metadata of a worker's UNAVAILABLE for a call of a role it does not serve now (a role switch ended,
# a drain that takes no new work): the call did nothing there, so a router may send it elsewhere at once.
ROLE_REFUSED_KEY = "pdserve-role-refused"


def sampling_from_proto(m: worker_pb2.SamplingParams) -> SamplingParams:
    """Validated SamplingParams; ValueError names the bad field (mapped to INVALID_ARGUMENT)."""
    return SamplingParams(
        max_tokens=m.max_tokens,
        temperature=m.temperature,
        top_p=m.top_p or 1.0,
        top_k=m.top_k or None,
        seed=m.seed if m.HasField("seed") else None,
        stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        min_tokens=m.min_tokens,
        logprobs=m.logprobs,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty or 1.0,  # proto3's 0 is "unset": off
        logit_bias=tuple(sorted(m.logit_bias.items())),
        min_p=m.min_p,
        top_logprobs=m.top_logprobs,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        structured=StructuredSpec(m.structured_output.kind, m.structured_output.schema)
        if m.HasField("structured_output") else None,
    )


def sampling_to_proto(p: SamplingParams) -> worker_pb2.SamplingParams:
    m = worker_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or 0, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, min_tokens=p.min_tokens, logprobs=p.logprobs,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias), min_p=p.min_p,
        top_logprobs=p.top_logprobs,
    )
    if p.seed is not None:
        m.seed = p.seed
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.structured is not None:
        m.structured_output.kind, m.structured_output.schema = p.structured.kind, p.structured.schema
    return m


def top_logprobs_to_proto(entries: Sequence[TopLogprobs | None]) -> list[worker_pb2.TopLogprobs]:
    """Logprob entries as the wire has them; None (the prompt's first token) is an empty entry."""
    return [worker_pb2.TopLogprobs(token_ids=e.token_ids, logprobs=e.logprobs) if e is not None
            else worker_pb2.TopLogprobs() for e in entries]
