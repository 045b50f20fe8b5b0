"""The fault suite's model; each fault's tally, printed as one table at the end of the run (captured output
or not).

"at a worker": of the client aborts, those a worker got while still working on the request (measured
where a test measures it, else "-"); "lease expiries": pinned KV the live prefill workers freed by lease.
"""

from __future__ import annotations

import pytest

from tests.checkpoints import make_checkpoint
from tests.faults.harness import REPORTS


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A small checkpoint whose greedy output depends on the whole context, so wrong KV changes it."""
    directory, _ = make_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return str(directory)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REPORTS:
        return
    terminalreporter.section("fault suite")
    terminalreporter.write_line(f"{'fault':50s} {'sent':>6s} {'completed':>10s} {'failed cleanly':>15s} "
                                f"{'client aborts':>14s} {'at a worker':>12s} {'lost':>5s} {'blocks pinned':>14s} "
                                f"{'lease expiries':>15s}")
    for r in REPORTS:
        at_worker = "-" if r.aborts_at_worker is None else str(r.aborts_at_worker)
        terminalreporter.write_line(f"{r.fault:50s} {r.sent:6d} {r.completed:10d} {r.failed_cleanly:15d} "
                                    f"{r.aborted_by_client:14d} {at_worker:>12s} {r.lost:5d} {r.blocks_pinned:14d} "
                                    f"{r.lease_expiries:15d}")
