"""Schema fuzz: schemathesis generates requests from the router's own ``/openapi.json`` and sends them to a
real router over a real decode worker; no answer may be a server error, and answers must match the
document's response schemas.

The worker serves ``dummy:tiny`` (random weights, the bundled tokenizer) with a 64-token context, so
every generated request is fast whatever it asks for; the number of examples per operation is
bounded so the fuzz fits in CI.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.launch.spawn import daemons, start_router, stop_router

MODEL = "dummy:tiny"
WORKER_ARGS = ("--max-model-len", "64", "--num-kv-blocks", "64", "--block-size", "16", "--max-num-seqs", "16")
EXAMPLES_PER_OPERATION = 40


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    with daemons(("decode", MODEL, WORKER_ARGS)) as (decode,):
        router = start_router(MODEL, [], [decode.address])
        try:
            yield router.local_url
        finally:
            stop_router(router)


def test_no_server_errors_and_answers_match_the_document(router_url: str) -> None:
    api = schemathesis.openapi.from_url(f"{router_url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    statuses: Counter[tuple[str, int]] = Counter()
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            response = case.call_and_validate(timeout=30, checks=[not_a_server_error, status_code_conformance,
                                                                  content_type_conformance,
                                                                  response_schema_conformance])
            statuses[case.operation.path, response.status_code] += 1

        fuzz()
    print("schema fuzz, requests by (path, status):", dict(sorted(statuses.items())))
    # Generated bodies reached the workers, not only the validation at the door.
    assert statuses["/v1/completions", 200] and statuses["/v1/chat/completions", 200]
