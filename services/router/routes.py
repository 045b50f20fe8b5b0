"""How a request was served, the one word the ``x-pdserve-route`` header, the log line and the metrics say.

- ``disaggregated``: the decode worker generated from the prefill worker's KV (or the prefill worker's
  first token was already the last).
- ``direct``: sent straight to a decode worker by policy (the cost-based rule: its own cache left few
  tokens to compute, or the prefill queue would cost more; or a prompt under an explicit
  ``--direct-decode-threshold``; or no prefill worker that can pair), which prefilled it.
- ``fallback``: meant to be disaggregated, but the prompt was recomputed on the decode worker: the
  prefill worker failed, or the decode worker's pull did (``TokenChunk.recomputed_locally``).

A response with several choices (``n``, ``best_of``, a batch of prompts) has one route: the worst of
its choices', fallback over direct over disaggregated, so a client is never told "disaggregated" about
an answer part of which was recomputed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class Route(enum.StrEnum):
    DISAGGREGATED = "disaggregated"
    DIRECT = "direct"
    FALLBACK = "fallback"


# The HTTP response header that carries a response's route (lower case, as HTTP/2 writes it).
ROUTE_HEADER = "x-pdserve-route"
# The top-level field of a stream's last chunk that carries the final route (OpenAI clients keep unknown
# fields as extras and ignore them).
ROUTE_FIELD = "pdserve_route"

_RANK = {Route.DISAGGREGATED: 0, Route.DIRECT: 1, Route.FALLBACK: 2}


def worst_route(routes: Iterable[str]) -> Route | None:
    """The route a response with these choices' routes reports; empty routes (a choice not routed yet,
    or refused) are skipped; None when none is known."""
    known = [Route(r) for r in routes if r]
    return max(known, key=_RANK.__getitem__, default=None)
