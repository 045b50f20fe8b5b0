"""A worker's gRPC receive limit: the largest message it can legitimately be sent, from its own config.

grpc core refuses a bigger message (RESOURCE_EXHAUSTED) before Python sees it, so the limit is all a caller
without the cluster token, or a broken one, can make a worker read; a fixed 64 MiB let a stranger make it read
60 MiB per call. Everything a request carries is bounded by the worker's context length, its KV groups and TP
size, and the router's body limit, so the limit follows from those.
"""

from __future__ import annotations

UINT32_VARINT_BYTES = 5  # one uint32 of a packed repeated field (token ids, block ids), at most
FIXED64_BYTES = 8  # one KV digest
# Everything else a message holds, whatever the prompt's length: request and engine ids, the handshake address,
# the ticket's nonce and signature, per-rank staged offsets and state digests, field tags and lengths, and the
# at most MAX_LOGIT_BIAS logit_bias entries, whose proto encoding can outgrow their JSON. Kilobytes, in practice.
ENVELOPE_BYTES = 64 * 1024


def max_receive_bytes(max_model_len: int, num_kv_groups: int, tp_size: int, max_request_bytes: int) -> int:
    """The largest ``Prefill``, ``Generate``, ``GenerateParts`` input or ``SwitchRole`` message a worker can
    legitimately get, given its context length, KV groups, TP size and the router's ``--max-request-bytes``.

    - The prompt's token ids: at most ``max_model_len`` (a migrated request's output so far included).
    - A ticket (``Generate``'s, each of ``GenerateParts``' parts): per KV group, a block id per owner block of
      the device tier and another per owner block of the host tier (both counted from token 0), and per reading
      rank (this worker's TP ranks) a digest per unit of tokens. The owner's block size and the digest unit are
      unknown here but at least one token, so each is at most one entry per token.
    - The sampling params (stop strings and ids, a structured-output schema): copied from an HTTP body the
      router takes only up to ``max_request_bytes``.
    - ``ENVELOPE_BYTES`` for the fixed-size rest. ``SwitchRole``, ``Release``, ``Info`` and the others are far
      smaller.
    """
    if min(max_model_len, num_kv_groups, tp_size, max_request_bytes) < 1:
        raise ValueError(f"every bound must be >= 1, got max_model_len={max_model_len}, "
                         f"num_kv_groups={num_kv_groups}, tp_size={tp_size}, max_request_bytes={max_request_bytes}")
    per_token = UINT32_VARINT_BYTES + num_kv_groups * (2 * UINT32_VARINT_BYTES + tp_size * FIXED64_BYTES)
    return max_model_len * per_token + max_request_bytes + ENVELOPE_BYTES
