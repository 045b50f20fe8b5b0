"""``PDSERVE_FAULT_INJECT``: off unless set, a known name injects, an unknown one stops the worker."""

from __future__ import annotations

import logging

import pytest

from services.common.fault_inject import ENV, active_faults, log_fault_injection


def test_no_fault_unless_the_variable_names_one() -> None:
    assert active_faults({}) == frozenset()
    assert active_faults({ENV: " "}) == frozenset()
    assert active_faults({ENV: "kv_corrupt"}) == {"kv_corrupt"}
    assert active_faults({ENV: "kv_corrupt, kv_corrupt,"}) == {"kv_corrupt"}


def test_an_unknown_fault_is_an_error_naming_it_and_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown fault\(s\) kv_currupt; known: kv_corrupt"):
        active_faults({ENV: "kv_currupt"})


def test_an_active_fault_is_logged_loudly(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ENV, "kv_corrupt")
    with caplog.at_level(logging.ERROR):
        assert log_fault_injection() == {"kv_corrupt"}
    assert any("FAULT INJECTION ACTIVE" in r.message and "kv_corrupt" in r.message for r in caplog.records)
