"""``bench/serve.py``'s planner setup: the router flags it runs the P:D planner with, a watcher that records
what the planner decided and which roles the workers had while the load ran, and the per-phase tables.

The watcher polls the router's ``GET /admin/planner`` and ``GET /admin/workers`` (the router is started with
``--admin-without-api-key``; it listens on 127.0.0.1 only) every ``poll_s`` on a thread of its own, and keeps
only changes: a new decision (reason, target, switch) or a new set of roles and states. Times are seconds
from the start of the load (the first arrival).
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from dataclasses import dataclass

# The planner's settings per machine kind: (interval s, window s, hysteresis evaluations, min dwell s,
# margin workers, decode tokens/s assumed until the step model is fitted). Chosen so that it can react within
# one phase of the shifting workload's default length (CPU 40 s, GPU 120 s): after a phase change the window
# is half new traffic within window/2, and a switch needs `hysteresis` evaluations in a row after that.
PLANNER_DEFAULTS = {"cpu": (2.0, 16.0, 2, 16.0, 0.25, 100.0), "gpu": (5.0, 30.0, 2, 30.0, 0.25, 1024.0)}


@dataclass(frozen=True)
class PlannerSettings:
    interval_s: float
    window_s: float
    hysteresis: int
    dwell_s: float
    margin: float
    decode_tokens_per_s: float

    def router_argv(self, slo_ttft_ms: float, slo_itl_ms: float) -> list[str]:
        """The router flags of the planner setup: acting planner at the bench's SLO, admin API open (local)."""
        return ["--role-planner", "--admin-without-api-key",
                "--planner-interval-s", f"{self.interval_s:g}", "--planner-window-s", f"{self.window_s:g}",
                "--planner-hysteresis-evaluations", str(self.hysteresis),
                "--planner-min-dwell-s", f"{self.dwell_s:g}", "--planner-margin-workers", f"{self.margin:g}",
                "--planner-decode-tokens-per-s", f"{self.decode_tokens_per_s:g}",
                "--planner-slo-ttft-ms", f"{slo_ttft_ms:g}", "--planner-slo-itl-ms", f"{slo_itl_ms:g}"]

    def describe(self) -> str:
        return (f"evaluates every {self.interval_s:g} s over the last {self.window_s:g} s of ended requests, switches "
                f"after {self.hysteresis} evaluations in a row past the rounding boundary + {self.margin:g} workers, "
                f"at least {self.dwell_s:g} s apart; decode capacity {self.decode_tokens_per_s:g} tok/s/worker until "
                "its step model is fitted")


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def roles_label(workers: list[dict]) -> str:
    """``1P2D`` from GET /admin/workers' entries (healthy ones), plus how many are switching."""
    healthy = [w for w in workers if w.get("state") == "healthy"]
    p = sum(w["role"] == "prefill" for w in healthy)
    d = sum(w["role"] == "decode" for w in healthy)
    other = len(workers) - len(healthy)
    return f"{p}P{d}D" + (f" (+{other} {'/'.join(sorted({w.get('state', '?') for w in workers} - {'healthy'}))})"
                          if other else "")


class PlannerWatch:
    """Polls the router's admin API while the load runs; ``events`` are the changes seen, in order."""

    def __init__(self, router_url: str, poll_s: float) -> None:
        self.url = router_url
        self.poll_s = poll_s
        self.t0 = time.perf_counter()
        self.events: list[dict] = []
        self.decisions: list[dict] = []  # every distinct decision (with its inputs), for the JSON row
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="planner-watch", daemon=True)
        self._last_decision: tuple | None = None
        self._last_roles: tuple | None = None
        self._switches_seen: set[tuple] = set()

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()  # the state at the end

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        now = time.perf_counter() - self.t0
        body = _get_json(f"{self.url}/admin/planner")
        decision = (body or {}).get("decision")
        if decision:
            key = (decision["reason"], json.dumps(decision["target"]), json.dumps(decision["desired"]),
                   json.dumps(decision["switch"]))
            if key != self._last_decision:
                self._last_decision = key
                at = round(now - decision.get("age_s", 0.0), 2)
                self.decisions.append({"t_s": at, **decision})
                self.events.append({"t_s": at, "event": "decision", "reason": decision["reason"],
                                    "current": decision["current"], "target": decision["target"],
                                    "desired": decision["desired"], "switch": decision["switch"],
                                    "need": (decision["inputs"]["prefill_need"], decision["inputs"]["decode_need"]),
                                    "decode_basis": decision["inputs"]["decode_basis"]})
        workers = (_get_json(f"{self.url}/admin/workers") or {}).get("workers")
        if workers:
            roles = tuple(sorted((w["address"], w["role"], w["state"]) for w in workers))
            if roles != self._last_roles:
                self._last_roles = roles
                self.events.append({"t_s": round(now, 2), "event": "roles", "roles": roles_label(workers),
                                    "workers": {w["address"]: f"{w['role']}/{w['state']}" for w in workers}})

    def switches(self) -> list[dict]:
        """The switch decisions seen (the planner starts each one the evaluation it decides it)."""
        return [e for e in self.events if e["event"] == "decision" and e["switch"]]

    def timeline(self) -> list[dict]:
        """Role changes and switch decisions, the lines worth printing."""
        return [e for e in self.events if e["event"] == "roles" or e["switch"]]


def phase_of(t_s: float, bounds: list[tuple[str, float, float]]) -> str:
    for name, start, end in bounds:
        if start <= t_s < end:
            return name
    return "after" if bounds and t_s >= bounds[-1][2] else "before"


def counts_by_phase(events: list[dict], bounds: list[tuple[str, float, float]]) -> list[dict]:
    """Per phase (the last one until the load is drained): the desired counts the planner asked for, lowest to
    highest (the decision in force at the phase's start included) and at its end, the workers' roles at its
    start and at each change, and the switches it decided."""
    decisions = [e for e in events if e["event"] == "decision"]
    roles = [e for e in events if e["event"] == "roles"]
    rows = []
    for i, (name, start, end) in enumerate(bounds):
        end = math.inf if i == len(bounds) - 1 else end
        seen = [e for e in decisions if e["t_s"] < start][-1:] + [e for e in decisions if start <= e["t_s"] < end]
        had = [e["roles"] for e in roles if e["t_s"] < start][-1:] + \
            [e["roles"] for e in roles if start <= e["t_s"] < end]
        rows.append({
            "phase": name,
            "desired_prefill": [min((e["desired"]["prefill"] for e in seen), default=None),
                                max((e["desired"]["prefill"] for e in seen), default=None)],
            "desired_decode": [min((e["desired"]["decode"] for e in seen), default=None),
                               max((e["desired"]["decode"] for e in seen), default=None)],
            "desired_at_end": f"{seen[-1]['desired']['prefill']}P{seen[-1]['desired']['decode']}D" if seen else "-",
            "roles": had,
            "switches": [f"{e['switch']['from']}->{e['switch']['to']} at {e['t_s']:.1f} s" for e in seen
                         if e["switch"] and e["t_s"] >= start]})
    return rows


def _span(low_high: list) -> str:
    low, high = low_high
    return "-" if low is None else f"{low}" if low == high else f"{low}-{high}"


# ---- tables --------------------------------------------------------------------------------------------


PHASE_COLS = [("ok", "completed", "d"), ("fail", "failed", "d"), ("SLO", "slo_met", "d"),
              ("good/s", "goodput_req_s", ".3f"), ("TTFT p50", "ttft_p50_ms", ".0f"), ("p99", "ttft_p99_ms", ".0f"),
              ("ITL p50", "itl_p50_ms", ".1f"), ("p99", "itl_p99_ms", ".1f"), ("TPOT p50", "tpot_p50_ms", ".1f"),
              ("p99", "tpot_p99_ms", ".1f")]
PHASE_RATIO_FIELDS = ("goodput_req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms",
                      "tpot_p99_ms")


def ratio(x: float | None, y: float | None) -> float:
    if x is None or y is None or (isinstance(x, float) and math.isnan(x)) or (isinstance(y, float) and math.isnan(y)):
        return float("nan")
    return x / y if y else (float("nan") if not x else float("inf"))


def phase_ratio_rows(rows: list[dict], planner: str, others: list[str]) -> list[dict]:
    """planner / each other setup, per phase (and overall): goodput and latency ratios."""
    by = {r["setup"]: r for r in rows if "error" not in r and "phases" in r}
    if planner not in by:
        return []
    out = []
    for other in others:
        if other not in by:
            continue
        a, b = by[planner], by[other]
        out.append({"kind": "phase_ratio", "setup": f"{planner}/{other}",
                    "phases": {name: {k: ratio(a["phases"][name].get(k), b["phases"][name].get(k))
                                      for k in PHASE_RATIO_FIELDS} for name in a["phases"]}})
    return out


def print_phase_tables(rows: list[dict], ratios: list[dict], phases: list[tuple[str, float, float]]) -> None:
    good = [r for r in rows if "error" not in r and "phases" in r]
    if not good:
        return
    names = [*(name for name, _, _ in phases), "overall"]
    for name in names:
        span = next(((s, e) for n, s, e in phases if n == name), None)
        where = f"arrivals {span[0]:.0f}-{span[1]:.0f} s" if span else "every request"
        print(f"\n## phase {name} ({where}; goodput = SLO-met requests / "
              f"{'the phase' if span else 'the run'}'s {'arrival window' if span else 'duration'})")
        print(f"{'setup':>22} " + " ".join(f"{c:>9}" for c, _, _ in PHASE_COLS) + "   (ms)")
        for r in good:
            p = r["phases"][name]
            cells = [format(p[key], fmt) if p.get(key) is not None else "-" for _, key, fmt in PHASE_COLS]
            print(f"{r['setup']:>22} " + " ".join(f"{c:>9}" for c in cells) + f"   of {p['requests']}")
        for q in ratios:
            p = q["phases"][name]
            cells = [format(p[key], ".2f") + "x" if key in p else "" for _, key, _ in PHASE_COLS]
            print(f"{q['setup']:>22} " + " ".join(f"{c:>9}" for c in cells))


def print_planner_row(row: dict) -> None:
    """The planner setup's switches and role timeline, and the counters that confirm them."""
    if "planner" not in row:
        return
    p = row["planner"]
    print(f"\n# {row['setup']}: planner {p['settings']}")
    if p.get("cannot_switch"):
        print(f"# {row['setup']}: !!! {p['cannot_switch']} !!!")
    print(f"# {row['setup']}: switches decided {len(p['switch_decisions'])}; router pdserve_planner_switches_total "
          f"{p['router_switches']}; workers' pdserve_role_switches_total {p['worker_switches']}; "
          f"migrated requests {p['migrated']}; decisions by reason {p['decisions_by_reason']}")
    if p.get("by_phase"):
        print(f"# {row['setup']}: per phase: the desired counts the planner asked for (lowest-highest, and at the "
              "phase's end), the workers' roles (at the start, then each change), its switches")
        for c in p["by_phase"]:
            print(f"#   {c['phase']:>13}: desired {_span(c['desired_prefill'])}P {_span(c['desired_decode'])}D "
                  f"(end {c['desired_at_end']}); "
                  f"roles {' -> '.join(c['roles']) or '-'}; switches {', '.join(c['switches']) or 'none'}")
    for e in p["timeline"]:
        if e["event"] == "roles":
            print(f"#   t={e['t_s']:7.1f} s [{e['phase']}] roles {e['roles']}")
        else:
            s = e["switch"]
            print(f"#   t={e['t_s']:7.1f} s [{e['phase']}] switch {s['address']} {s['from']}->{s['to']} "
                  f"(current {e['current']['prefill']}P{e['current']['decode']}D, target "
                  f"{e['target']['prefill']}P{e['target']['decode']}D, need {e['need'][0]:.2f}P {e['need'][1]:.2f}D, "
                  f"decode capacity: {e['decode_basis']})")
