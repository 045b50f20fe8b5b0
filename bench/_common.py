"""What every benchmark here shares: GPU peaks, writing its rows as JSON lines."""

from __future__ import annotations

import json
from pathlib import Path

# (HBM bytes/s, dense bf16/fp16 FLOP/s) from the datasheets, by device-name substring.
GPU_PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}


def emit_json(rows: list[dict], json_out: str | None, to_stdout: bool) -> bool:
    """Write one JSON object per row to ``json_out`` and/or stdout; True when stdout got them."""
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    if json_out:
        Path(json_out).write_text(lines)
    if to_stdout:
        print(lines, end="")
    return to_stdout
