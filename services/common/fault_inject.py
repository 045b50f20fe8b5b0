"""``PDSERVE_FAULT_INJECT``: faults a worker injects on purpose, for tests and for operators drilling a deployment.

Off unless the variable is set: a comma-separated list of faults, each ``name`` or ``name:N`` (the
first N occasions pass untouched, then every one is hit: ``kv_corrupt:1`` lets a decode worker's
first pull, the start-up probe, through). A worker logs every active fault loudly at start (an
injected fault must never be mistaken for a real one), and refuses to start on a name or count it
does not understand (a typo must not silently inject nothing).

==============  ======================================================================================
fault           what the worker does
==============  ======================================================================================
``kv_corrupt``  decode: flips bits in every KV block it pulled, after the READ and before the digest
                check (with the digest on, every such pull is caught and recomputed; with
                ``--no-kv-digest`` the corruption reaches the output); ``:N`` spares its first N
                pulls
==============  ======================================================================================
"""

from __future__ import annotations

import logging
import os

ENV = "PDSERVE_FAULT_INJECT"
FAULTS = {"kv_corrupt": "decode workers flip a bit in every pulled KV block before checking its digest"}

log = logging.getLogger(__name__)


def active_faults(environ: dict[str, str] | None = None) -> dict[str, int]:
    """The faults ``PDSERVE_FAULT_INJECT`` names, each with how many occasions it spares first (0: none);
    ValueError naming an unknown fault or a bad count."""
    text = (os.environ if environ is None else environ).get(ENV, "")
    faults: dict[str, int] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        name, _, count = item.partition(":")
        if name not in FAULTS:
            raise ValueError(f"${ENV}: unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}")
        if count and not (count.isdigit()):
            raise ValueError(f"${ENV}: {item!r}: the count after ':' must be a whole number")
        faults[name] = int(count or 0)
    return faults


def log_fault_injection() -> dict[str, int]:
    """The active faults, each logged at ERROR level so nobody runs a drill by accident."""
    faults = active_faults()
    for name, spared in sorted(faults.items()):
        log.error("FAULT INJECTION ACTIVE: %s=%s: %s%s", ENV, name, FAULTS[name],
                  f" (after the first {spared})" if spared else "")
    return faults
