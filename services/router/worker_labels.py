"""The opaque id a worker goes by on the router's ``/metrics``: its address is not for whoever can scrape.

``/metrics`` stays open (Prometheus scrapes without the API key, as vLLM's and Dynamo's do), and the router's
HTTP port is the public one, so its per-worker series are labelled ``worker="<12 hex digits>"``, an HMAC of
the worker's address keyed with the router's API key, instead of ``address="host:port"``:

* stable: the same worker keeps its id across scrapes, restarts and role switches (its address does not
  change), and every router replica of a deployment (one API key) gives it the same id, so ``sum by
  (worker)`` over replicas adds up one worker's load;
* not reversible without the key: trying every ``host:port`` of a cluster needs the key;
* mapped back to the address where the key is shown anyway: ``/health`` with the key and ``GET /admin/workers``
  list each worker's ``worker`` beside its ``address``.

Without an API key nothing on the router is closed to anyone (``/health`` lists the addresses), and the id is the
same HMAC with an empty key: the same label, the same dashboards.
"""

from __future__ import annotations

import hashlib
import hmac
from functools import lru_cache

# 48 bits: a collision among a thousand workers has odds of about 2e-9.
_ID_HEX_DIGITS = 12


class WorkerLabels:
    """``labels(address)``: the worker's id on ``/metrics`` (the docstring above says why and how)."""

    def __init__(self, api_key: str | None = None) -> None:
        key = (api_key or "").encode()
        self._of = lru_cache(maxsize=4096)(
            lambda address: hmac.new(key, address.encode(), hashlib.sha256).hexdigest()[:_ID_HEX_DIGITS])

    def __call__(self, address: str) -> str:
        return self._of(address)
