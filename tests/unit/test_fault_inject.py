"""``PDSERVE_FAULT_INJECT``: off unless set, a known name injects, an unknown one stops the worker."""

from __future__ import annotations

import logging

import pytest

from services.common.fault_inject import ENV, active_faults, log_fault_injection


def test_no_fault_unless_the_variable_names_one() -> None:
    assert active_faults({}) == {}
    assert active_faults({ENV: " "}) == {}
    assert active_faults({ENV: "kv_corrupt"}) == {"kv_corrupt": 0}
    assert active_faults({ENV: "kv_corrupt, kv_corrupt:2,"}) == {"kv_corrupt": 2}


def test_an_unknown_fault_or_a_bad_count_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"unknown fault 'kv_currupt'; known: kv_corrupt"):
        active_faults({ENV: "kv_currupt"})
    with pytest.raises(ValueError, match=r"'kv_corrupt:x': the count"):
        active_faults({ENV: "kv_corrupt:x"})


def test_an_active_fault_is_logged_loudly(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ENV, "kv_corrupt")
    with caplog.at_level(logging.ERROR):
        assert log_fault_injection() == {"kv_corrupt": 0}
    assert any("FAULT INJECTION ACTIVE" in r.message and "kv_corrupt" in r.message for r in caplog.records)
