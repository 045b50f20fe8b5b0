"""What every benchmark here shares: writing its rows as JSON lines."""

from __future__ import annotations

import json
from pathlib import Path


def emit_json(rows: list[dict], json_out: str | None, to_stdout: bool) -> bool:
    """Write one JSON object per row to ``json_out`` and/or stdout; True when stdout got them."""
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    if json_out:
        Path(json_out).write_text(lines)
    if to_stdout:
        print(lines, end="")
    return to_stdout
