"""Which device each TP rank of each worker runs on.

Pure functions of the ``--device`` flag and a GPU count, so they are testable on a machine without a
GPU; only :func:`detect_gpus` asks torch, and only when called. A worker's device string is one
entry per rank, comma separated (``"cuda:0,cuda:1"`` for tp 2), or ``"cpu"``; :func:`rank_devices`
turns it back into the list rank ``r`` reads its device from.

Rules: a worker's own ranks are always on distinct GPUs (two ranks of one TP group on a GPU would
only share its memory and compute for nothing). Different workers may share a GPU when there are
fewer GPUs than ranks; :func:`plan_placement` says which ones do and why.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

_CUDA_ENTRY = re.compile(r"cuda:(\d+)")
_DEVICE_FORMS = "auto, cpu, cuda, cuda:N or a comma list such as cuda:2,cuda:3"


def detect_gpus() -> int:
    """The CUDA devices torch sees (0 when torch has no CUDA); imports torch, so call it only when needed."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_devices(device: str, tp: int, num_gpus: int | None = None) -> list[str]:
    """The device of each of ``tp`` ranks from a ``--device`` flag (``num_gpus``: default, ask torch).

    ``auto``: ``cuda:0..tp-1`` when GPUs are visible, every rank on CPU when none is (and an error when
    some are but fewer than ``tp``: silently running on CPU would be a surprise on a GPU machine);
    ``cpu``: all on CPU; ``cuda``: ``cuda:0..tp-1``; ``cuda:N``: ``cuda:N..N+tp-1``; a comma list:
    exactly ``tp`` distinct entries, all ``cuda:N`` (or all ``cpu``).
    """
    _check_tp(tp)
    device = device.strip()
    if device == "cpu":
        return ["cpu"] * tp
    if num_gpus is None:
        num_gpus = detect_gpus()
    if device == "auto":
        if num_gpus == 0:
            return ["cpu"] * tp
        if num_gpus < tp:
            raise ValueError(f"--device auto: tp {tp} needs {tp} GPUs, only {num_gpus} visible "
                             "(pass --device cpu to run every rank on CPU)")
        return [f"cuda:{i}" for i in range(tp)]
    if device == "cuda":
        indices = list(range(tp))
    else:
        entries = [e.strip() for e in device.split(",")]
        if len(entries) == 1:
            start = _gpu_index(entries[0])
            indices = list(range(start, start + tp))
        else:
            if "cpu" in entries:
                return _cpu_list(device, entries, tp)
            indices = _gpu_list(device, entries, tp)
    _check_visible(f"--device {device}", indices, num_gpus)
    return [f"cuda:{i}" for i in indices]


def _check_tp(tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {tp}")


def _gpu_index(entry: str) -> int:
    """``cuda:N`` -> N; anything else is a syntax error that lists the accepted forms."""
    match = _CUDA_ENTRY.fullmatch(entry)
    if match is None:
        raise ValueError(f"bad device {entry!r}: expected {_DEVICE_FORMS}")
    return int(match.group(1))


def _cpu_list(device: str, entries: list[str], tp: int) -> list[str]:
    """A comma list with ``cpu`` in it: allowed only when every entry is ``cpu`` (one rank each)."""
    if any(e != "cpu" for e in entries):
        raise ValueError(f"--device {device}: mixes cpu and cuda; all ranks of a worker run on one kind of device")
    if len(entries) != tp:
        raise ValueError(f"--device {device}: {len(entries)} entries for tp {tp}; give one per rank")
    return entries


def _gpu_list(device: str, entries: list[str], tp: int) -> list[int]:
    """The GPU indices of a comma list: one per rank, no GPU twice."""
    indices = [_gpu_index(e) for e in entries]
    if len(indices) != tp:
        raise ValueError(f"--device {device}: {len(indices)} entries for tp {tp}; give one per rank")
    _check_distinct(f"--device {device}", indices)
    return indices


def _check_distinct(what: str, indices: list[int]) -> None:
    twice = sorted(i for i, n in Counter(indices).items() if n > 1)
    if twice:
        raise ValueError(f"{what}: GPU {_join(twice)} listed twice; each rank needs its own GPU")


def _check_visible(what: str, indices: list[int], num_gpus: int) -> None:
    missing = sorted({i for i in indices if i >= num_gpus})
    if missing:
        raise ValueError(f"{what}: needs GPU {_join(missing)} but only {num_gpus} GPU(s) visible"
                         + (f" (0-{num_gpus - 1})" if num_gpus else ""))


def _join(indices: list[int]) -> str:
    return ",".join(str(i) for i in indices)


def parse_gpu_list(text: str) -> list[int]:
    """``"0,1,3"`` -> [0, 1, 3] (``--prefill-gpus``/``--decode-gpus``); a bad entry names itself."""
    try:
        indices = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"bad GPU list {text!r}: expected comma separated GPU indices such as 0,1") from None
    if any(i < 0 for i in indices):
        raise ValueError(f"bad GPU list {text!r}: GPU indices are >= 0")
    return indices


def gpu_pool(device: str, num_gpus: int) -> list[int]:
    """The GPUs ``pdserve up`` may place workers on, from its ``--device`` flag.

    ``cpu``: none; ``auto``: every visible GPU (none on a CPU machine); ``cuda``: every visible GPU,
    an error when there is none; ``cuda:N`` or a comma list: exactly those GPUs.
    """
    device = device.strip()
    if device == "cpu":
        return []
    if device == "cuda" and num_gpus == 0:
        raise ValueError("--device cuda: no CUDA device is visible")
    if device in ("auto", "cuda"):
        return list(range(num_gpus))
    entries = [e.strip() for e in device.split(",")]
    if "cpu" in entries:
        raise ValueError(f"--device {device}: mixes cpu and cuda; give cpu alone or only cuda:N entries")
    indices = [_gpu_index(e) for e in entries]
    _check_distinct(f"--device {device}", indices)
    _check_visible(f"--device {device}", indices, num_gpus)
    return indices


@dataclass(frozen=True)
class Placement:
    """The ``--device`` of each prefill and each decode worker, and how they were chosen (one paragraph)."""

    prefill: list[str]
    decode: list[str]
    explanation: str


def plan_placement(num_gpus: int, prefill: list[int], decode: list[int], prefill_gpus: list[int] | None = None,
                   decode_gpus: list[int] | None = None, gpus: list[int] | None = None) -> Placement:
    """Place workers (``prefill``/``decode``: the tp of each) on GPUs; ``gpus``: those allowed (default all,
    ``[]``: CPU by choice).

    Enough GPUs: every rank gets its own. Too few: prefill and decode keep separate GPUs when each side
    can still hold its largest worker (disaggregation keeps prefill bursts off decode's GPUs), and
    workers of one role share; otherwise prefill and decode workers share GPUs. A worker's own ranks are
    always on distinct GPUs; a tp larger than the GPUs available is an error.

    ``prefill_gpus``/``decode_gpus`` choose by hand: that role's ranks take the listed GPUs in order
    (worker 0's ranks first). The list must hold a GPU for every rank of that role (fewer is an error;
    surplus GPUs stay unused); the two lists may overlap, which shares those GPUs on purpose. A role not
    chosen by hand is placed on the GPUs no list names (on all of them, least loaded first, when its
    largest worker does not fit there).
    """
    for tp in (*prefill, *decode):
        _check_tp(tp)
    pool = list(range(num_gpus)) if gpus is None else list(gpus)
    if not pool:
        why = "no GPU visible" if gpus is None else "--device cpu"
        return _all_cpu(why, prefill, decode, prefill_gpus, decode_gpus)
    tps = {"prefill": prefill, "decode": decode}
    chosen = {"prefill": prefill_gpus, "decode": decode_gpus}
    assigned: dict[str, list[list[int]]] = {}
    notes = []
    for role in ("prefill", "decode"):
        if chosen[role] is not None:
            assigned[role], note = _by_hand(role, tps[role], chosen[role], num_gpus)
            notes.append(note)
    auto = {role: tps[role] for role in ("prefill", "decode") if role not in assigned}
    if any(auto.values()):
        label = f"{len(pool)} GPU(s)" if gpus is None else f"GPU {_join(pool)} (from --device)"
        reserved = {g for role in assigned for g in chosen[role]}
        placed, note = _automatic(auto, pool, assigned, reserved, label)
        assigned.update(placed)
        notes.append(note)
    for role in auto:
        assigned.setdefault(role, [])
    explanation = " ".join([f"placement: {num_gpus} GPU(s) visible;", *notes, _summary(assigned)])
    return Placement(_devices(assigned["prefill"]), _devices(assigned["decode"]), explanation)


def _all_cpu(why: str, prefill: list[int], decode: list[int], prefill_gpus: list[int] | None,
             decode_gpus: list[int] | None) -> Placement:
    """No GPU to use: every worker (and every TP rank) on CPU; naming GPUs by hand is then an error."""
    for flag, listed in (("--prefill-gpus", prefill_gpus), ("--decode-gpus", decode_gpus)):
        if listed:
            raise ValueError(f"{flag} {_join(listed)}: there is no GPU to use ({why})")
    ranks = sum(prefill) + sum(decode)
    explanation = (f"placement: {why}: {len(prefill)} prefill and {len(decode)} decode worker(s) run on CPU "
                   f"({ranks} rank process(es) in all).")
    return Placement(["cpu"] * len(prefill), ["cpu"] * len(decode), explanation)


def _by_hand(role: str, tps: list[int], listed: list[int], num_gpus: int) -> tuple[list[list[int]], str]:
    """Hand the listed GPUs out in order to the role's ranks; too short a list names what is missing."""
    flag = f"--{role}-gpus {_join(listed)}"
    _check_distinct(flag, listed)
    _check_visible(flag, listed, num_gpus)
    needed = sum(tps)
    if len(listed) < needed:
        raise ValueError(f"{flag}: lists {len(listed)} GPU(s) but {len(tps)} {role} worker(s) at tp "
                         f"{_join(tps)} need {needed} (one per rank)")
    workers, start = [], 0
    for tp in tps:
        workers.append(listed[start:start + tp])
        start += tp
    unused = listed[needed:]
    note = f"{role} by hand ({flag})" + (f", GPU {_join(unused)} left unused;" if unused else ";")
    return workers, note


def _automatic(auto: dict[str, list[int]], pool: list[int], assigned: dict[str, list[list[int]]],
               reserved: set[int], label: str) -> tuple[dict[str, list[list[int]]], str]:
    """Place the roles not chosen by hand on the GPUs of ``pool`` no hand list names (all when they do not fit).

    ``label`` names the pool in the explanation.
    """
    load = Counter(g for workers in assigned.values() for w in workers for g in w)
    free = [g for g in pool if g not in reserved]
    ranks = sum(sum(tps) for tps in auto.values())
    largest = max(tp for tps in auto.values() for tp in tps)
    where = f"the {len(free)} GPU(s) no hand list names" if assigned else label
    roles = [role for role, tps in auto.items() if tps]
    said = (f"{' and '.join(roles)} placed automatically: " if assigned else "") + f"{ranks} rank(s)"
    if largest > len(pool):
        raise ValueError(f"a tp {largest} worker needs {largest} distinct GPUs but only {len(pool)} usable "
                         f"({label}); a worker's ranks cannot share a GPU")
    if ranks <= len(free):
        return _in_order(auto, free), f"{said} on {where}: every rank on its own GPU."
    if len(roles) == 2 and len(free) >= sum(max(auto[r]) for r in roles):
        return _split(auto, free, load), (
            f"{said} but {where}: prefill and decode keep separate GPUs and workers of one role share them.")
    if largest <= len(free):
        return {role: _least_loaded(tps, free, load) for role, tps in auto.items()}, (
            f"{said} but {where}: workers share GPUs (a worker's own ranks stay on distinct GPUs).")
    return {role: _least_loaded(tps, pool, load) for role, tps in auto.items()}, (
        f"{said} but {where}: placed on all {len(pool)} usable GPU(s), least loaded first.")


def _in_order(auto: dict[str, list[int]], gpus: list[int]) -> dict[str, list[list[int]]]:
    """Enough GPUs: hand them out in order, prefill workers first, one per rank."""
    placed, start = {}, 0
    for role, tps in auto.items():
        placed[role] = []
        for tp in tps:
            placed[role].append(gpus[start:start + tp])
            start += tp
    return placed


def _split(auto: dict[str, list[int]], gpus: list[int], load: Counter) -> dict[str, list[list[int]]]:
    """Too few GPUs for both roles: split them in proportion to each role's ranks, share within a role."""
    prefill, decode = auto["prefill"], auto["decode"]
    share = round(len(gpus) * sum(prefill) / (sum(prefill) + sum(decode)))
    share = min(max(share, max(prefill)), len(gpus) - max(decode))
    return {"prefill": _least_loaded(prefill, gpus[:share], load),
            "decode": _least_loaded(decode, gpus[share:], load)}


def _least_loaded(tps: list[int], gpus: list[int], load: Counter) -> list[list[int]]:
    """Each worker's ranks on the ``tp`` least loaded GPUs (ties: the earlier GPU); updates ``load``."""
    workers = []
    for tp in tps:
        picked = sorted(sorted(gpus, key=lambda g: (load[g], gpus.index(g)))[:tp], key=gpus.index)
        load.update(picked)
        workers.append(picked)
    return workers


def _devices(workers: list[list[int]]) -> list[str]:
    return [",".join(f"cuda:{g}" for g in w) for w in workers]


def _summary(assigned: dict[str, list[list[int]]]) -> str:
    """``prefill 0 on cuda:0,cuda:1; decode 0 on cuda:2`` plus which GPUs host more than one worker."""
    parts, hosts = [], {}
    for role in ("prefill", "decode"):
        for i, gpus in enumerate(assigned[role]):
            parts.append(f"{role} {i} on {_devices([gpus])[0]}")
            for g in gpus:
                hosts.setdefault(g, []).append(f"{role} {i}")
    shared = [f"GPU {g} is shared by {' and '.join(names)}" for g, names in sorted(hosts.items()) if len(names) > 1]
    return "; ".join(parts) + "." + (" " + "; ".join(shared) + "." if shared else "")
