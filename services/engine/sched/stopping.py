"""When a request is done: stop tokens and lengths after each step (stop strings: ``services.text``)."""

from __future__ import annotations

from services.engine.request import Request, RequestStatus


def check_token_stop(request: Request, eos_token_ids: frozenset[int], max_model_len: int) -> RequestStatus | None:
    """The finished status a request reached with its newest token, or None to keep going.

    Stop tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) count only once the request
    has ``min_tokens`` outputs, and win over the length limits when both hit on the same token,
    as OpenAI reports "stop" for a final EOS. A stop token id is recorded in ``stop_reason``.
    """
    params = request.sampling_params
    if request.output_token_ids and request.num_output_tokens >= params.min_tokens:
        last_token_id = request.output_token_ids[-1]
        if last_token_id in params.stop_token_ids:
            request.stop_reason = last_token_id
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and last_token_id in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
