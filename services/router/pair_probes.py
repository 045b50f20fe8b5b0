"""Which (prefill, decode) pairs have shown they can move KV: the pair probe's state machine, pure.

Compatibility (``kv.pair_support``) says a pair should work; the probe (a decode worker's ``Probe`` RPC:
one real transfer, services/decode/probe.py) says it does. Each compatible pair of available workers
has an entry, keyed by the two addresses and tied to the epochs of the two workers it was made for::

    pending ──probe ok──► probed
       │  ▲                  │
       │  └─ epoch change ◄──┘ (either side restarted: a new entry, pending)
       └──probe failed──► failed ──retry_after_s──► probed again (ok) or failed (again)

Only a probed pair is used for disaggregation (``usable``). A failed one keeps its reason for
``/health`` and is probed again once ``retry_after_s`` passed (``due``); an epoch change makes any
entry pending at once. A result for epochs the pair no longer has is dropped. Entries of pairs no
longer compatible and available are forgotten. Discovery drives it (``sync``, ``due``, ``start``,
``record``) with its clock; the pairing policy reads it; no I/O, no clock of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class PairState(enum.StrEnum):
    PENDING = "pending"  # not probed yet for these epochs (or a probe is under way)
    PROBED = "probed"  # the probe moved KV: the pair may take requests
    FAILED = "failed"  # the probe did not: not used until a later probe succeeds


@dataclass(frozen=True)
class ProbeOutcome:
    """What a decode worker's ``Probe`` answered (or why it did not). ``unprobed``: the decode worker
    predates the RPC, so the pair counts as probed without a transfer."""

    ok: bool
    reason: str = ""
    prefill_engine_id: str = ""
    prefill_epoch: int = 0
    seconds: float = 0.0
    unprobed: bool = False


#: (prefill address, decode address, prefill epoch, decode epoch): one compatible pair of available workers.
PairKey = tuple[str, str, int, int]


@dataclass
class PairProbe:
    """One pair's probe state for the epochs its workers have now."""

    prefill: str
    decode: str
    epochs: tuple[int, int]  # (prefill, decode) the state is for
    state: PairState = PairState.PENDING
    reason: str = ""  # why it failed
    retry_at: float = 0.0  # failed: not probed again before this (discovery's clock)
    in_flight: bool = False
    seconds: float = 0.0  # the last probe's duration, as the decode worker measured it
    unprobed: bool = False  # probed counts because the decode worker has no Probe RPC


class PairProbeTable:
    """The probe state of every compatible pair of available workers."""

    def __init__(self, retry_after_s: float = 15.0) -> None:
        if not retry_after_s > 0:
            raise ValueError(f"retry_after_s must be > 0, got {retry_after_s!r}")
        self.retry_after_s = retry_after_s
        self._pairs: dict[tuple[str, str], PairProbe] = {}
        self.results = {"ok": 0, "failed": 0}  # probes answered, for pdserve_router_pair_probes_total

    def sync(self, pairs: Iterable[PairKey]) -> None:
        """Make the table hold exactly these pairs: new ones (and those whose epochs changed) pending."""
        wanted = {(p, d): (pe, de) for p, d, pe, de in pairs}
        for key in self._pairs.keys() - wanted.keys():
            del self._pairs[key]
        for key, epochs in wanted.items():
            entry = self._pairs.get(key)
            if entry is None or entry.epochs != epochs:
                self._pairs[key] = PairProbe(key[0], key[1], epochs)

    def due(self, now: float) -> list[PairProbe]:
        """Entries to probe now: pending ones, and failed ones whose back-off is over; none in flight."""
        return [e for e in self._pairs.values() if not e.in_flight and
                (e.state is PairState.PENDING or (e.state is PairState.FAILED and now >= e.retry_at))]

    def start(self, entry: PairProbe) -> None:
        entry.in_flight = True

    def record(self, entry: PairProbe, outcome: ProbeOutcome, now: float) -> bool:
        """Apply a probe's outcome to ``entry``; False (and nothing changed) when the pair has moved on
        since (another epoch, or gone), or the decode worker probed another epoch of the prefill worker
        than the one the entry is for (it restarted in between: probed again next round)."""
        entry.in_flight = False
        if self._pairs.get((entry.prefill, entry.decode)) is not entry:
            return False
        if outcome.prefill_epoch and outcome.prefill_epoch != entry.epochs[0]:
            return False
        self.results["ok" if outcome.ok else "failed"] += 1
        entry.seconds, entry.unprobed = outcome.seconds, outcome.unprobed
        if outcome.ok:
            entry.state, entry.reason = PairState.PROBED, ""
        else:
            entry.state, entry.reason = PairState.FAILED, outcome.reason or "the probe failed (no reason given)"
            entry.retry_at = now + self.retry_after_s
        return True

    def get(self, prefill: str, decode: str) -> PairProbe | None:
        return self._pairs.get((prefill, decode))

    def usable(self, prefill: str, decode: str, epochs: tuple[int, int]) -> bool:
        """Whether the pair passed its probe for these epochs."""
        entry = self._pairs.get((prefill, decode))
        return entry is not None and entry.epochs == epochs and entry.state is PairState.PROBED

    def pairs(self) -> list[PairProbe]:
        return list(self._pairs.values())

    def counts(self) -> dict[str, int]:
        """Entries per state, every state present."""
        counts = {state.value: 0 for state in PairState}
        for entry in self._pairs.values():
            counts[entry.state.value] += 1
        return counts
