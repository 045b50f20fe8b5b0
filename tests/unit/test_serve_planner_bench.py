"""bench/serve_planner.py's per-phase summary: the desired counts and the roles each phase of the shifting
workload saw (what RESULTS quotes to show a switch each way)."""

from __future__ import annotations

from bench.serve_planner import counts_by_phase


def _decision(t_s: float, desired: tuple[int, int], switch: tuple[str, str] | None = None) -> dict:
    return {"t_s": t_s, "event": "decision", "desired": {"prefill": desired[0], "decode": desired[1]},
            "switch": None if switch is None else {"address": "w", "from": switch[0], "to": switch[1]}}


def test_counts_by_phase_carry_the_decision_and_roles_in_force_into_the_next_phase():
    events = [{"t_s": 0.5, "event": "roles", "roles": "2P2D"}, _decision(1.0, (1, 1)),
              _decision(6.0, (3, 1), ("decode", "prefill")), {"t_s": 6.5, "event": "roles", "roles": "3P1D"},
              _decision(75.0, (1, 2), ("prefill", "decode")), {"t_s": 76.0, "event": "roles", "roles": "2P2D"},
              _decision(130.0, (2, 1))]
    rows = counts_by_phase(events, [("prefill-heavy", 0, 60), ("decode-heavy", 60, 120)])
    assert rows[0] == {"phase": "prefill-heavy", "desired_prefill": [1, 3], "desired_decode": [1, 1],
                       "desired_at_end": "3P1D", "roles": ["2P2D", "3P1D"], "switches": ["decode->prefill at 6.0 s"]}
    # The last phase runs until the load is drained; the split in force at its start counts as seen.
    assert rows[1] == {"phase": "decode-heavy", "desired_prefill": [1, 3], "desired_decode": [1, 2],
                       "desired_at_end": "2P1D", "roles": ["3P1D", "2P2D"], "switches": ["prefill->decode at 75.0 s"]}
    assert counts_by_phase([], [("mix", 0, 10)])[0]["desired_prefill"] == [None, None]
