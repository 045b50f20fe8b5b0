"""The P:D planner: how many prefill and decode workers the traffic needs, and which worker should switch.

Rate matching at the SLO targets. Over the last window (``traffic.py``) requests arrive at ``λ`` per second
with ``L_in`` prompt tokens to compute (the prompt less the prefix a cache held) and ``L_out`` output tokens
on average. Each role's demand, in workers:

    prefill_need = λ · L_in  / prefill_capacity
    decode_need  = max(λ · L_out / decode_capacity, decoding / decode_sequences)

**Prefill capacity** (prompt tokens/s one worker sustains with TTFT within ``slo_ttft_s``): a worker
computes ``R`` prompt tokens/s (``WorkerLoad.prefill_tokens_per_s``, the mean over the prefill workers
that measured one; ``default_prefill_tokens_per_s`` before any did). A mean prompt takes ``S = L_in / R``.
Seen as one M/D/1 server, TTFT = S + ρ·S / (2(1-ρ)), so TTFT <= T holds up to the utilization

    ρ_max = max(2(T - S) / (2T - S), MIN_UTILIZATION)          prefill_capacity = R · ρ_max

(ρ_max -> 1 for short prompts). The bound falls to 0 as S nears T, where more workers buy little: at
``MIN_UTILIZATION`` (0.5) the queue adds S/2, so the TTFT is within 1.5 S, and planning lower would ask for
many times the work in workers for the last third of it (on CPU, where S is close to T, that asked for 32
prefill workers of 4). A prompt that alone takes longer than T cannot meet the target: ``slo_unattainable``
says so.

**Decode capacity** (output tokens/s one worker delivers with ITL within ``slo_itl_s``): a decode step's
time grows with the sequences it carries, ``step(b) = base + per_seq · b``, fitted by least squares
to the (concurrency, ITL) each decode worker showed in recent evaluations. At the target a worker
carries ``b* = (T - base) / per_seq`` sequences, at most what its KV pool holds (``kv_blocks_total ·
block_size / (prompt + L_out)``, with the whole prompt), and delivers ``b* / step(b*)`` tokens/s. Until
the fit has two concurrencies at least a sequence apart (or its slope is not positive),
``default_decode_tokens_per_s``, which at the target is ``default · T`` sequences.

**Decoding now** (``decoding``): the window counts a request when it ends, so a decode worker's backlog
shows there only one request duration later, and a saturated one delivers (and so shows) no more than its
own throughput. The sequences the decode workers carry for this router now (per worker the smaller of the
router's requests whose Generate it sent, which include KV pulls in progress, and the engine's running and
waiting, which count every router's) are demand at once: ``decoding / decode_sequences`` workers, where
``decode_sequences`` is what one carries at the target (``b*``, at least 1). Below the target it is at most
the rate term (Little's law), so it decides only when decode runs past its target. Prefill has no such
term: its queue also grows when decode is saturated (prefilled KV waits to be pulled), which is decode's
demand, not prefill's.

**Split** (acting mode, a fixed pool of N workers): prefill gets ``N · prefill_need / (prefill_need +
decode_need)`` workers, rounded, at least one per role. A switch is proposed only when

* the rounded split differs from the current one by more than ``margin_workers`` beyond the rounding
  boundary (0.5 + margin from the current count), for ``hysteresis_evaluations`` evaluations in a row
  (the same direction each time),
* no switch happened in the last ``min_dwell_s``, and none is in progress (one switch at a time).

The worker to switch is the least loaded available worker of the over-provisioned role. A window in which
nothing ended is sized by what is decoding (nothing: ``no_traffic``).

**Desired** (advisory, for a Kubernetes HPA): each role's need rounded up, at least 1; the HPA's own
stabilization is its hysteresis. With a fixed pool (``fixed_pool``: acting mode) no more than the pool: when
the rounded needs add up to more, the split above. Pure: no I/O and no clock; the caller passes ``now_s``.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from services.router.pairing import Role
from services.router.prefix_index import Load
from services.router.traffic import TrafficStats

#: The lowest utilization a prefill worker is planned at (the M/D/1 bound is below it once S > 2T/3).
MIN_UTILIZATION = 0.5
#: Step-model samples kept (one per decode worker with traffic per evaluation).
MAX_STEP_SAMPLES = 256
#: A need within this of an integer is that integer (ceil(2.0000001) is not 3 workers).
_NEED_TOLERANCE = 1e-6


class DecisionReason(enum.StrEnum):
    """Why the planner decided what it did: the ``reason`` label of ``pdserve_planner_decisions_total``."""

    BALANCED = "balanced"  # the current split matches the demand (within the margin)
    PENDING = "pending"  # it does not, but not yet for enough evaluations in a row
    DWELL = "dwell"  # it does not, but the last switch is too recent
    SWITCH = "switch"  # a worker should change role now
    SWITCH_IN_PROGRESS = "switch_in_progress"  # one switch at a time
    NO_TRAFFIC = "no_traffic"  # nothing ended in the window and nothing is decoding: nothing to size by
    TOO_FEW_WORKERS = "too_few_workers"  # fewer than one available worker per role


@dataclass(frozen=True)
class PlannerConfig:
    """The planner's settings (the router's ``--planner-*`` flags)."""

    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.05
    hysteresis_evaluations: int = 3
    margin_workers: float = 0.25
    min_dwell_s: float = 300.0
    default_prefill_tokens_per_s: float = 4096.0
    default_decode_tokens_per_s: float = 1024.0

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_itl_s", "default_prefill_tokens_per_s", "default_decode_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.hysteresis_evaluations < 1:
            raise ValueError(f"hysteresis_evaluations must be >= 1, got {self.hysteresis_evaluations}")
        if self.margin_workers < 0 or self.min_dwell_s < 0:
            raise ValueError("margin_workers and min_dwell_s must be >= 0")


@dataclass(frozen=True)
class WorkerView:
    """One worker as the planner sees it: its role now, whether it takes work, its load."""

    address: str
    role: Role
    available: bool  # healthy and not draining
    load: Load | None = None  # its last WorkerLoad (None: unknown)
    outstanding_requests: int = 0  # the router's requests on it
    block_size: int | None = None
    decoding_requests: int = 0  # decode role: the router's requests whose Generate it was sent (pulls included)


@dataclass(frozen=True)
class RoleCounts:
    prefill: int
    decode: int

    def of(self, role: Role) -> int:
        return self.prefill if role == Role.PREFILL else self.decode

    def to_json(self) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode}


@dataclass(frozen=True)
class StepModel:
    """Decode step time against the sequences in the batch: ``base_s + per_seq_s · b``."""

    base_s: float
    per_seq_s: float

    def step_s(self, concurrency: float) -> float:
        return self.base_s + self.per_seq_s * concurrency


@dataclass(frozen=True)
class DecodeCapacity:
    """What one decode worker delivers within the ITL target, and the sequences it carries doing so."""

    tokens_per_s: float
    sequences: float  # at least 1
    basis: str  # "fit", "kv_bound" or "default"
    unattainable: bool = False  # one sequence's step alone is over the target


@dataclass(frozen=True)
class Estimate:
    """What a decision was computed from: the inputs the log and ``GET /admin/planner`` show."""

    rate_rps: float
    mean_prompt_tokens: float
    mean_computed_prompt_tokens: float  # less what prefix caches held: what prefill computes
    mean_output_tokens: float
    prefill_tokens_per_s: float  # one prefill worker's measured (or default) rate
    prefill_capacity_tps: float  # ... and what it sustains within the TTFT target
    decode_capacity_tps: float  # one decode worker's output tokens/s within the ITL target
    decode_basis: str  # "fit", "kv_bound" or "default": where decode_capacity_tps came from
    prefill_need: float  # workers
    decode_need: float  # the larger of the rate's and the decoding sequences'
    slo_unattainable: tuple[str, ...] = ()  # roles whose target one worker cannot meet at any load
    step_model: StepModel | None = None
    decoding_sequences: float = 0.0  # what the decode workers carry for this router now
    decode_sequences: float = 1.0  # what one decode worker carries within the ITL target

    def to_json(self) -> dict[str, object]:
        model = self.step_model
        return {
            "rate_rps": round(self.rate_rps, 4), "mean_prompt_tokens": round(self.mean_prompt_tokens, 1),
            "mean_computed_prompt_tokens": round(self.mean_computed_prompt_tokens, 1),
            "mean_output_tokens": round(self.mean_output_tokens, 1),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
            "prefill_capacity_tps": round(self.prefill_capacity_tps, 1),
            "decode_capacity_tps": round(self.decode_capacity_tps, 1), "decode_basis": self.decode_basis,
            "decoding_sequences": round(self.decoding_sequences, 1),
            "decode_sequences": round(self.decode_sequences, 1),
            "prefill_need": round(self.prefill_need, 3), "decode_need": round(self.decode_need, 3),
            "slo_unattainable": list(self.slo_unattainable),
            "step_model": None if model is None else {"base_ms": round(model.base_s * 1e3, 3),
                                                      "per_seq_ms": round(model.per_seq_s * 1e3, 4)},
        }


@dataclass(frozen=True)
class Switch:
    """A worker to move from one role to the other."""

    address: str
    from_role: Role
    to_role: Role

    def to_json(self) -> dict[str, str]:
        return {"address": self.address, "from": self.from_role.value, "to": self.to_role.value}


@dataclass(frozen=True)
class Decision:
    """One evaluation's outcome."""

    at_s: float
    reason: DecisionReason
    current: RoleCounts  # available workers per role now
    target: RoleCounts  # the split of those workers the traffic calls for (acting mode moves toward it)
    desired: RoleCounts  # workers each role needs, rounded up (what an HPA scales to)
    estimate: Estimate
    switch: Switch | None = None  # set when reason is SWITCH
    streak: int = 0  # evaluations in a row the target has differed in this direction

    def to_json(self) -> dict[str, object]:
        return {"reason": self.reason.value, "current": self.current.to_json(), "target": self.target.to_json(),
                "desired": self.desired.to_json(), "switch": self.switch.to_json() if self.switch else None,
                "streak": self.streak, "inputs": self.estimate.to_json()}

    def summary(self) -> str:
        """One line for the log: the outcome and the inputs it came from."""
        e = self.estimate
        what = f"switch {self.switch.address} {self.switch.from_role}->{self.switch.to_role}" if self.switch else ""
        return (f"planner {self.reason.value}{': ' + what if what else ''} current={self.current.prefill}P"
                f"{self.current.decode}D target={self.target.prefill}P{self.target.decode}D desired="
                f"{self.desired.prefill}P{self.desired.decode}D rate={e.rate_rps:.3f}/s in={e.mean_prompt_tokens:.0f} "
                f"computed={e.mean_computed_prompt_tokens:.0f} "
                f"out={e.mean_output_tokens:.0f} prefill_cap={e.prefill_capacity_tps:.0f}tok/s "
                f"decode_cap={e.decode_capacity_tps:.0f}tok/s ({e.decode_basis}) decoding={e.decoding_sequences:.0f}/"
                f"{e.decode_sequences:.0f} need={e.prefill_need:.2f}P"
                f"{e.decode_need:.2f}D")


# ---- the load model ------------------------------------------------------------------------------------


def prefill_utilization(service_s: float, ttft_s: float) -> float:
    """The utilization at which an M/D/1 server's mean response time equals ``ttft_s``, at least
    ``MIN_UTILIZATION`` (where more workers would buy at most a third of the TTFT)."""
    if service_s >= ttft_s:
        return MIN_UTILIZATION
    return max(2 * (ttft_s - service_s) / (2 * ttft_s - service_s), MIN_UTILIZATION)


def measured_prefill_rate(workers: Sequence[WorkerView], default: float) -> float:
    """Mean prompt tokens/s the available prefill workers report (``default`` when none measured one)."""
    rates = [w.load.prefill_tokens_per_s for w in workers
             if w.role == Role.PREFILL and w.available and w.load is not None and w.load.prefill_tokens_per_s > 0]
    return sum(rates) / len(rates) if rates else default


def fit_step_model(samples: Sequence[tuple[float, float]]) -> StepModel | None:
    """Least squares of (concurrency, step seconds); None without two concurrencies a sequence apart or with
    a slope that is not positive (then the samples say nothing about how steps grow)."""
    if len(samples) < 2:
        return None
    xs = [b for b, _ in samples]
    if max(xs) - min(xs) < 1.0:
        return None
    n = len(samples)
    mean_x = sum(xs) / n
    mean_y = sum(s for _, s in samples) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((b - mean_x) * (s - mean_y) for b, s in samples) / var
    if slope <= 0:
        return None
    return StepModel(max(mean_y - slope * mean_x, 0.0), slope)


def kv_concurrency(workers: Sequence[WorkerView], seq_tokens: float) -> float | None:
    """Mean sequences of ``seq_tokens`` tokens the available decode workers' KV pools hold (None: unknown)."""
    held = [w.load.kv_blocks_total * w.block_size / seq_tokens for w in workers
            if w.role == Role.DECODE and w.available and w.load is not None and w.load.kv_blocks_total
            and w.block_size and seq_tokens > 0]
    return sum(held) / len(held) if held else None


def decode_capacity(model: StepModel | None, itl_s: float, kv_sequences: float | None,
                    default_tps: float) -> DecodeCapacity:
    """What one decode worker delivers within ``itl_s``: by the fitted step model, or ``default_tps`` (which at
    ``itl_s`` per token is ``default_tps · itl_s`` sequences)."""
    if model is None:
        return DecodeCapacity(default_tps, max(default_tps * itl_s, 1.0), "default")
    unattainable = model.step_s(1.0) > itl_s
    sequences = max((itl_s - model.base_s) / model.per_seq_s, 1.0)
    basis = "fit"
    if kv_sequences is not None and kv_sequences < sequences:
        sequences, basis = max(kv_sequences, 1.0), "kv_bound"
    return DecodeCapacity(sequences / model.step_s(sequences), sequences, basis, unattainable)


def decoding_sequences(workers: Sequence[WorkerView]) -> float:
    """The sequences the decode workers carry for this router now: per worker its requests whose Generate the
    router sent (KV pulls included), at most what the engine last reported running and waiting (every
    router's, pulls not included)."""
    total = 0
    for w in workers:
        if w.role != Role.DECODE or w.decoding_requests <= 0:
            continue
        engine = w.load.num_running + w.load.num_waiting if w.load is not None else w.decoding_requests
        total += min(w.decoding_requests, engine)
    return float(total)


def split(total: int, prefill_need: float, decode_need: float) -> float:
    """The prefill workers of ``total`` that match the two needs' ratio (unrounded)."""
    return total * prefill_need / (prefill_need + decode_need)


def pool_split(total: int, prefill_need: float, decode_need: float) -> RoleCounts:
    """The split of ``total`` (>= 2) workers the two needs call for: rounded, at least one per role."""
    prefill = min(max(round(split(total, prefill_need, decode_need)), 1), total - 1)
    return RoleCounts(prefill, total - prefill)


def desired(need: float) -> int:
    """Workers a role needs: its need rounded up, at least one."""
    return max(1, math.ceil(need - _NEED_TOLERANCE))


def desired_counts(estimate: Estimate, pool: int | None) -> RoleCounts:
    """Each role's need rounded up; within a fixed ``pool`` of workers (>= 2) the split when they do not fit."""
    wanted = RoleCounts(desired(estimate.prefill_need), desired(estimate.decode_need))
    if pool is None or pool < 2 or wanted.prefill + wanted.decode <= pool:
        return wanted
    return pool_split(pool, estimate.prefill_need, estimate.decode_need)


# ---- the planner ---------------------------------------------------------------------------------------


@dataclass
class _Streak:
    direction: int = 0  # +1: prefill should grow, -1: decode should grow
    count: int = 0


class Planner:
    """Evaluates the load each time it is asked; keeps what hysteresis and dwell need between evaluations."""

    def __init__(self, config: PlannerConfig | None = None) -> None:
        self.config = config or PlannerConfig()
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_STEP_SAMPLES)
        self._streak = _Streak()
        self._last_switch_s: float | None = None

    def record_switch(self, now_s: float) -> None:
        """A switch was started now: the dwell time runs from here."""
        self._last_switch_s = now_s
        self._streak = _Streak()

    def estimate(self, workers: Sequence[WorkerView], traffic: TrafficStats) -> Estimate:
        """Each role's demand in workers, from the traffic and the measured rates (also feeds the step model)."""
        c = self.config
        decoders = {w.address for w in workers if w.role == Role.DECODE}
        for address, sample in traffic.decode.items():
            if address in decoders and sample.concurrency > 0:
                self._samples.append((sample.concurrency, sample.itl_s))
        rate = traffic.rate_rps
        l_in, l_out = traffic.mean_prompt_tokens, traffic.mean_output_tokens
        computed = traffic.mean_computed_prompt_tokens  # what prefill costs: the prompt less its cached prefix
        prefill_rate = measured_prefill_rate(workers, c.default_prefill_tokens_per_s)
        service_s = computed / prefill_rate
        prefill_cap = prefill_rate * prefill_utilization(service_s, c.slo_ttft_s)
        model = fit_step_model(self._samples)
        decode = decode_capacity(model, c.slo_itl_s, kv_concurrency(workers, l_in + l_out),
                                 c.default_decode_tokens_per_s)
        decoding = decoding_sequences(workers)
        unattainable = tuple(role for role, missed in (("prefill", service_s >= c.slo_ttft_s),
                                                       ("decode", decode.unattainable)) if missed)
        return Estimate(rate, l_in, computed, l_out, prefill_rate, prefill_cap, decode.tokens_per_s, decode.basis,
                        prefill_need=rate * computed / prefill_cap,
                        decode_need=max(rate * l_out / decode.tokens_per_s, decoding / decode.sequences),
                        slo_unattainable=unattainable, step_model=model, decoding_sequences=decoding,
                        decode_sequences=decode.sequences)

    def evaluate(self, workers: Sequence[WorkerView], traffic: TrafficStats, now_s: float,
                 switch_in_progress: bool = False, fixed_pool: bool = False) -> Decision:
        """The decision for now; a SWITCH names the worker. The caller acts on it (or only reports it).
        ``fixed_pool``: the workers are all there will be (acting mode), so ``desired`` stays within them."""
        estimate = self.estimate(workers, traffic)
        available = [w for w in workers if w.available]
        current = RoleCounts(sum(w.role == Role.PREFILL for w in available),
                             sum(w.role == Role.DECODE for w in available))
        total = current.prefill + current.decode
        wanted = desired_counts(estimate, total if fixed_pool else None)

        def decided(reason: DecisionReason, target: RoleCounts = current, switch: Switch | None = None) -> Decision:
            return Decision(now_s, reason, current, target, wanted, estimate, switch, self._streak.count)

        if current.prefill < 1 or current.decode < 1 or total < 2:
            self._streak = _Streak()
            return decided(DecisionReason.TOO_FEW_WORKERS)
        if estimate.prefill_need + estimate.decode_need <= 0:  # nothing ended and nothing is decoding
            self._streak = _Streak()
            return decided(DecisionReason.NO_TRAFFIC)
        exact = split(total, estimate.prefill_need, estimate.decode_need)
        target = pool_split(total, estimate.prefill_need, estimate.decode_need)
        if target.prefill == current.prefill or abs(exact - current.prefill) < 0.5 + self.config.margin_workers:
            self._streak = _Streak()
            return decided(DecisionReason.BALANCED)
        direction = 1 if target.prefill > current.prefill else -1
        if self._streak.direction != direction:
            self._streak = _Streak(direction, 0)
        self._streak.count += 1
        if switch_in_progress:
            return decided(DecisionReason.SWITCH_IN_PROGRESS, target)
        if self._streak.count < self.config.hysteresis_evaluations:
            return decided(DecisionReason.PENDING, target)
        if self._last_switch_s is not None and now_s - self._last_switch_s < self.config.min_dwell_s:
            return decided(DecisionReason.DWELL, target)
        giver = Role.DECODE if direction > 0 else Role.PREFILL
        worker = least_loaded([w for w in available if w.role == giver])
        taker = Role.PREFILL if giver == Role.DECODE else Role.DECODE
        return decided(DecisionReason.SWITCH, target, Switch(worker.address, giver, taker))


def least_loaded(workers: Sequence[WorkerView]) -> WorkerView:
    """The worker whose switch disturbs least: fewest router requests, then engine requests and queued
    prompt tokens, then address (stable)."""
    def key(w: WorkerView) -> tuple[int, int, int, str]:
        load = w.load or Load()
        return (w.outstanding_requests, load.num_running + load.num_waiting, load.waiting_prefill_tokens, w.address)

    return min(workers, key=key)

