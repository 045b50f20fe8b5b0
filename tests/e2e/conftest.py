"""What the e2e modules share: one 1P1D stack on the bundled SmolLM2 for the modules that only talk to it through
the API, every request disaggregated (``--direct-decode-threshold 0``).

Each of those modules started the same stack of its own: three SmolLM2 processes loading the GGUF, ~15-20 s of a
2-core CI box apiece. Their tests read worker counters as deltas and never change a worker, so one stack serves
them all. It is package-scoped, and ``pytest_collection_modifyitems`` runs those modules last in ``tests/e2e``
(each module's tests in their order), so the stack is up only while they run, not beside every other module's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.stack import Stack, stack

SHARED_STACK = "smollm2_stack"
_HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="package")
def smollm2_stack() -> Iterator[Stack]:
    """The shared SmolLM2 1P1D stack (router, one prefill and one decode worker), disaggregating every request."""
    with stack(None, 1, 1, "--direct-decode-threshold", "0") as s:
        yield s


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the modules using the shared stack behind the other e2e modules (the e2e items stay where they were)."""
    positions = [i for i, item in enumerate(items) if _HERE in Path(item.path).resolve().parents]
    if not positions or positions[-1] - positions[0] + 1 != len(positions):
        return  # no e2e items, or not one run of them: leave the order alone
    block = items[positions[0]: positions[-1] + 1]
    sharing = {item.path for item in block if SHARED_STACK in getattr(item, "fixturenames", ())}
    items[positions[0]: positions[-1] + 1] = ([item for item in block if item.path not in sharing]
                                              + [item for item in block if item.path in sharing])
