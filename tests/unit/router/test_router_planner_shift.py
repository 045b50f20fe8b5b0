"""The P:D planner when a decode-heavy load follows a prefill-heavy one (issue 46, item 7), on a simulated pool.

Four workers start as 2P2D, as in the chaos run that found the fault. The rates are the 2-core CPU machine's:
a prefill worker computes 115 prompt tokens/s and a decode step takes 0.19 s + 6.5 ms per sequence. Both were
measured with real daemons by ``bench/serve.py --workload shifting`` (2P2D, the planner's inputs in
``GET /admin/planner``). The load is that bench's CPU shifting workload, arriving evenly instead of Poisson:
384:2 and 512:2 (prompt:output tokens) at 0.4/s for 60 s, then 16:64 and 32:48 at 0.6/s. The planner has the
bench's CPU settings: an evaluation every 2 s over a 16-s window, two in a row before a switch, 16 s between
switches, and TTFT 4 s and ITL 0.5 s targets.

The pool is a fluid model. A prefill worker computes its FIFO queue at its rate, and a decode worker advances
every sequence it carries by one token per step. Switches take effect at once, and a switched worker's
requests go to the others of its old role. The planner sees what the router would: the ended requests in
its traffic window, each prefill worker's measured rate, and each decode worker's sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.pairing import Role
from services.router.planner import Decision, DecisionReason, Planner, PlannerConfig, RoleCounts, WorkerView
from services.router.prefix_index import Load
from services.router.traffic import FinishedRequest, TrafficWindow

PREFILL_TOKENS_PER_S = 115.0
STEP_BASE_S, STEP_PER_SEQ_S = 0.19, 0.0065
PHASES = ((0.0, 60.0, 0.4, ((384, 2), (512, 2))), (60.0, 120.0, 0.6, ((16, 64), (32, 48))))
PHASE_CHANGE_S = 60.0
WINDOW_S, INTERVAL_S, TICK_S = 16.0, 2.0, 0.05
CONFIG = PlannerConfig(slo_ttft_s=4.0, slo_itl_s=0.5, hysteresis_evaluations=2, margin_workers=0.25,
                       min_dwell_s=16.0, default_decode_tokens_per_s=100.0)
# The last prefill-heavy request ends at most one queued prefill (~4.5 s) after the phase change, and leaves the
# window WINDOW_S later; then the split needs `hysteresis` evaluations in a row.
SWITCH_BACK_EVALUATIONS = round((4.5 + WINDOW_S) / INTERVAL_S) + CONFIG.hysteresis_evaluations + 1


@dataclass
class _Request:
    prompt: int
    output: int
    prefill_left: float
    tokens: float = 0.0  # generated after the first (which the prefill worker samples)
    second_s: float | None = None


class _Pool:
    """Four workers, 2P2D to start; the requests each one holds (a prefill FIFO, or the sequences decoding)."""

    def __init__(self) -> None:
        self.roles = {"p0": Role.PREFILL, "p1": Role.PREFILL, "d0": Role.DECODE, "d1": Role.DECODE}
        self.held: dict[str, list[_Request]] = {address: [] for address in self.roles}
        self.window = TrafficWindow(WINDOW_S)
        self.window.start(0.0)

    def of(self, role: Role) -> list[str]:
        return [a for a, r in self.roles.items() if r == role]

    def arrive(self, prompt: int, output: int) -> None:
        address = min(self.of(Role.PREFILL), key=lambda a: sum(r.prefill_left for r in self.held[a]))
        self.held[address].append(_Request(prompt, output, float(prompt)))

    def tick(self, now_s: float) -> None:
        for address in list(self.roles):
            held = self.held[address]
            if self.roles[address] == Role.PREFILL:
                if held:
                    held[0].prefill_left -= PREFILL_TOKENS_PER_S * TICK_S
                    if held[0].prefill_left <= 0:
                        request = held.pop(0)
                        min((self.held[a] for a in self.of(Role.DECODE)), key=len).append(request)
                continue
            step_s = STEP_BASE_S + STEP_PER_SEQ_S * len(held)
            for request in list(held):
                request.tokens += TICK_S / step_s
                if request.second_s is None and request.tokens >= 1:
                    request.second_s = now_s
                if request.tokens >= request.output - 1:
                    held.remove(request)
                    decode_s = now_s - request.second_s if request.output > 2 else 0.0
                    self.window.record(FinishedRequest(now_s, request.prompt, request.output, address, decode_s,
                                                       num_decode_gaps=request.output - 2))

    def views(self) -> list[WorkerView]:
        return [WorkerView(a, role, True, Load(num_running=len(self.held[a])) if role == Role.DECODE else
                           Load(prefill_tokens_per_s=PREFILL_TOKENS_PER_S), len(self.held[a]),
                           decoding_requests=len(self.held[a]) if role == Role.DECODE else 0)
                for a, role in self.roles.items()]

    def switch(self, address: str, role: Role) -> None:
        moved, self.held[address] = self.held[address], []
        self.roles[address] = role
        for request in moved:
            min((self.held[a] for a in self.of(Role.DECODE if role == Role.PREFILL else Role.PREFILL)),
                key=len).append(request)


def _arrivals() -> list[tuple[float, int, int]]:
    arrivals = []
    for start_s, end_s, rate, mix in PHASES:
        n = round((end_s - start_s) * rate)
        arrivals += [(start_s + i / rate, *mix[i % len(mix)]) for i in range(n)]
    return arrivals


def _run(until_s: float) -> tuple[list[Decision], list[tuple[float, RoleCounts]]]:
    """Every evaluation of an acting planner over the shifting load, and the roles after each one."""
    pool, planner = _Pool(), Planner(CONFIG)
    arrivals = _arrivals()
    decisions, roles = [], []
    ticks_per_evaluation = round(INTERVAL_S / TICK_S)
    for tick in range(1, round(until_s / TICK_S) + 1):
        now_s = tick * TICK_S
        while arrivals and arrivals[0][0] <= now_s:
            pool.arrive(*arrivals.pop(0)[1:])
        pool.tick(now_s)
        if tick % ticks_per_evaluation:
            continue
        decision = planner.evaluate(pool.views(), pool.window.stats(now_s), now_s, fixed_pool=True)
        if decision.reason is DecisionReason.SWITCH:
            pool.switch(decision.switch.address, decision.switch.to_role)
            planner.record_switch(now_s)
        decisions.append(decision)
        roles.append((now_s, RoleCounts(len(pool.of(Role.PREFILL)), len(pool.of(Role.DECODE)))))
    return decisions, roles


def test_the_planner_follows_a_prefill_heavy_then_a_decode_heavy_load():
    decisions, roles = _run(until_s=120.0)
    switches = [(d.at_s, d.switch.from_role, d.switch.to_role) for d in decisions if d.switch]
    # Prefill-heavy: a decode worker turns prefill within a few evaluations of the first prompts ending.
    first = next(s for s in switches if s[1] == Role.DECODE)
    assert first[0] <= 10 * INTERVAL_S, switches
    assert next(r for t, r in roles if t == first[0]) == RoleCounts(3, 1)
    assert all(d.desired.prefill > d.desired.decode for d in decisions if 10 <= d.at_s < PHASE_CHANGE_S)
    # Decode-heavy: a worker turns back once the prefill-heavy tail has left the window, and the desired
    # counts go back toward decode.
    back = [s for s in switches if s[0] > PHASE_CHANGE_S and s[1] == Role.PREFILL]
    assert back, switches
    assert back[0][0] <= PHASE_CHANGE_S + SWITCH_BACK_EVALUATIONS * INTERVAL_S, switches
    late = [d for d in decisions if d.at_s >= back[0][0]]
    assert all(d.desired.prefill == 1 for d in late), [(d.at_s, d.desired) for d in late]
    assert roles[-1][1].decode >= 2
    # A fixed pool of four: never more desired than that, in any evaluation.
    assert all(d.desired.prefill + d.desired.decode <= 4 for d in decisions), \
        max((d.desired.prefill + d.desired.decode, d.at_s) for d in decisions)
