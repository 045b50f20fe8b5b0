"""bench/transfer.py --quick runs on the CI machine (real processes, real NIXL) and reports every case."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"device", "layout", "tokens", "bytes", "descriptors", "seconds", "gbps"}


def test_quick_transfer_benchmark_reports_every_case() -> None:
    started = time.monotonic()
    out = subprocess.run([sys.executable, "bench/transfer.py", "--quick", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=180, check=True)
    elapsed = time.monotonic() - started
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert all(set(r) >= FIELDS for r in rows)
    by = {(r["tokens"], r["layout"]): r for r in rows}
    assert {layout for _, layout in by} == {"per_layer", "cross_layer", "cross_layer_runs", "raw"}
    for tokens in {t for t, _ in by}:
        cases = [by[(tokens, layout)] for layout in ("per_layer", "cross_layer", "cross_layer_runs", "raw")]
        assert len({c["bytes"] for c in cases}) == 1, "every case moves the same bytes"
        descs = [c["descriptors"] for c in cases]
        assert descs[0] > descs[1] > descs[2] == descs[3] == 1
        assert all(c["gbps"] > 0 for c in cases)
    assert elapsed < 60, f"--quick took {elapsed:.0f} s (the brief: under a minute on the CI machine)"
