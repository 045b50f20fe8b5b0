"""Collects each fault's tally and prints them as one table at the end of the run (captured output or not)."""

from __future__ import annotations

import pytest

from tests.faults.harness import REPORTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REPORTS:
        return
    terminalreporter.section("fault suite")
    terminalreporter.write_line(f"{'fault':50s} {'sent':>6s} {'completed':>10s} {'failed cleanly':>15s} "
                                f"{'client aborts':>14s} {'lost':>5s} {'blocks pinned':>14s}")
    for r in REPORTS:
        terminalreporter.write_line(f"{r.fault:50s} {r.sent:6d} {r.completed:10d} {r.failed_cleanly:15d} "
                                    f"{r.aborted_by_client:14d} {r.lost:5d} {r.blocks_pinned:14d}")
