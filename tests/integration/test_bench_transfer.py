"""bench/transfer.py --quick runs on the CI machine (real processes, real NIXL) and reports every case."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"scenario", "device", "layout", "tokens", "bytes", "descriptors", "seconds", "gbps"}
GROUP_FIELDS = FIELDS | {"shape", "window", "bytes_vs_ideal", "descriptors_vs_ideal", "bytes_vs_all_full"}


def test_quick_transfer_benchmark_reports_every_case() -> None:
    started = time.monotonic()
    out = subprocess.run([sys.executable, "bench/transfer.py", "--quick", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=180, check=True)
    elapsed = time.monotonic() - started
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert all(set(r) >= FIELDS for r in rows)
    layouts = [r for r in rows if r["scenario"] == "layouts"]
    by = {(r["tokens"], r["layout"]): r for r in layouts}
    assert {layout for _, layout in by} == {"per_layer", "cross_layer", "cross_layer_runs", "raw"}
    for tokens in {t for t, _ in by}:
        cases = [by[(tokens, layout)] for layout in ("per_layer", "cross_layer", "cross_layer_runs", "raw")]
        assert len({c["bytes"] for c in cases}) == 1, "every case moves the same bytes"
        descs = [c["descriptors"] for c in cases]
        assert descs[0] > descs[1] > descs[2] == descs[3] == 1
        assert all(c["gbps"] > 0 for c in cases)

    groups = [r for r in rows if r["scenario"] == "groups"]
    assert groups and all(set(r) >= GROUP_FIELDS for r in groups)
    for shape in {r["shape"] for r in groups}:
        by_variant = {r["layout"]: r for r in groups if r["shape"] == shape}
        assert set(by_variant) == {"groups", "all_full", "ideal"}
        pulled, full, ideal = by_variant["groups"], by_variant["all_full"], by_variant["ideal"]
        # window clipping pulls exactly the ideal, measured between two real processes
        assert (pulled["bytes"], pulled["descriptors"]) == (ideal["bytes"], ideal["descriptors"])
        assert pulled["bytes_vs_ideal"] == 1.0 and pulled["gbps"] > 0 and full["gbps"] > 0
        assert full["bytes"] > pulled["bytes"] and full["descriptors"] > pulled["descriptors"]
        assert full["bytes_vs_all_full"] == 1.0 and pulled["bytes_vs_all_full"] < 1.0
    assert elapsed < 60, f"--quick took {elapsed:.0f} s (the brief: under a minute on the CI machine)"
