"""Programmatic dependent launch inside the engine's Triton kernels (Hopper and later).

A kernel launched with ``launch_pdl`` may start before the kernel ahead of it in the stream has
finished. ``pdl_enter`` is what every such kernel runs before it touches memory another kernel writes
(or reads and another then overwrites): it lets the next kernel launch (all of this one's programs
have started), then waits until the previous kernel is done and its writes are visible. Loads of
weights, which no kernel writes, may go before it (the GEMV's first tile does). Without the launch
attribute both instructions are no-ops, so a kernel compiled with ``PDL`` is still correct when
launched plainly. ``triton_support.pdl_enabled`` decides per device.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """With ``LAUNCH_NEXT=False`` the next kernel launches only as this one's programs end: for a kernel
    whose successor has nothing to load before it waits (attention's split reduce), whose programs would
    only hold SM slots, spinning, while this kernel still runs (measured: split attention 1.8 us slower)."""
    if PDL:
        if LAUNCH_NEXT:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def launch_options(pdl: bool) -> dict:
    """The launch keyword for ``pdl`` (nothing when off: the interpreter takes no launch attributes)."""
    return {"launch_pdl": True} if pdl else {}
