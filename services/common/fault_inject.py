"""``PDSERVE_FAULT_INJECT``: faults a worker injects on purpose, for tests and for operators drilling a deployment.

Off unless the variable is set: a comma-separated list of fault names. A worker logs every active
fault loudly at start (an injected fault must never be mistaken for a real one), and refuses to
start on a name it does not know (a typo must not silently inject nothing).

==============  ======================================================================================
fault           what the worker does
==============  ======================================================================================
``kv_corrupt``  decode: flips a bit in every KV block it pulled, after the READ and before the digest
                check (with the digest on, every such pull is caught and recomputed; with
                ``--no-kv-digest`` the corruption reaches the output)
==============  ======================================================================================
"""

from __future__ import annotations

import logging
import os

ENV = "PDSERVE_FAULT_INJECT"
FAULTS = {"kv_corrupt": "decode workers flip a bit in every pulled KV block before checking its digest"}

log = logging.getLogger(__name__)


def active_faults(environ: dict[str, str] | None = None) -> frozenset[str]:
    """The faults ``PDSERVE_FAULT_INJECT`` names; ValueError naming an unknown one."""
    text = (os.environ if environ is None else environ).get(ENV, "")
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - FAULTS.keys())
    if unknown:
        raise ValueError(f"${ENV}: unknown fault(s) {', '.join(unknown)}; known: {', '.join(sorted(FAULTS))}")
    return names


def log_fault_injection() -> frozenset[str]:
    """The active faults, each logged at ERROR level so nobody runs a drill by accident."""
    faults = active_faults()
    for name in sorted(faults):
        log.error("FAULT INJECTION ACTIVE: %s=%s: %s", ENV, name, FAULTS[name])
    return faults
