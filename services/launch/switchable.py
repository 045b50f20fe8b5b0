"""A worker that can serve either role: both daemons' roles attached to one engine (``--role-switching``).

It lives with the launcher because it is the one place that may import both daemons (they never import
each other); the switching itself is ``services/worker/role_switch.py``'s.
"""

from __future__ import annotations

from services.decode.server import DECODE
from services.engine.llm_engine import LLMEngine
from services.prefill.server import PREFILL
from services.worker.config import SwitchableConfig
from services.worker.daemon import serve

_ROLES = {"prefill": PREFILL, "decode": DECODE}


async def serve_switchable(config: SwitchableConfig, engine: LLMEngine, first_role: str) -> str | None:
    """Serve ``first_role`` now and either role after a ``SwitchRole``, until drained; the failure that stopped
    it, if one did."""
    if first_role not in _ROLES:
        raise ValueError(f"role must be one of {sorted(_ROLES)}, got {first_role!r}")
    others = [role for name, role in _ROLES.items() if name != first_role]
    return await serve(config, engine, _ROLES[first_role], others)
