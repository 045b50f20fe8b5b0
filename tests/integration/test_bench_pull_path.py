"""bench/pull_path.py runs on the CI machine (real processes, real NIXL) and reports every stage and variant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B: 32 layers x K/V x 8 heads x 128 x bf16
VARIANTS = {"pull", "agent", "raw_plan", "raw_prep", "raw_1"}


def test_pull_path_breakdown_reports_every_variant_and_stage() -> None:
    out = subprocess.run([sys.executable, "bench/pull_path.py", "--tokens", "256", "--repeats", "2", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    (first,) = [r for r in rows if r["variant"] == "first"]
    assert first["stages"]["handshake"] > 0 and first["seconds"] > 0  # the first pull handshakes
    # A fragmented pool's ticket is staged: the pull reads its span in one descriptor, the raw READs the 16 blocks.
    for pool, descriptors, staged in (("contiguous", 1, False), ("fragmented", 16, True)):
        by = {r["variant"]: r for r in rows if r["pool"] == pool and r["variant"] != "first"}
        assert set(by) == VARIANTS
        assert {r["bytes"] for r in by.values()} == {256 * KV_BYTES_PER_TOKEN}  # every variant moves the same
        assert by["raw_plan"]["descriptors"] == descriptors and by["pull"]["staged"] is staged
        assert by["pull"]["descriptors"] == 1 and by["pull"]["hand_out_seconds"] > 0
        assert by["raw_1"]["descriptors"] == 1
        assert all(r["seconds"] > 0 for r in by.values())
        pull = by["pull"]
        assert {"handshake", "check", "pieces", "plan", "read.submit", "read.prepare", "read.post", "read.complete",
                "read.wake"} <= set(pull["stages"])
        assert sum(pull["stages"][k] for k in ("handshake", "check", "pieces", "plan")) < pull["seconds"]
        assert 0 < pull["planning_warm_seconds"] < pull["seconds"]
        assert set(by["raw_1"]["stages"]) == {"prepare", "post", "complete"}


def test_staging_benchmarks_run_on_the_ci_machine() -> None:
    """bench/staging_copy.py (the copies beside one contiguous copy) and bench/profile_staged_scatter.py (the
    scatter's steps inside real staged pulls) run on CPU and report every path and step."""
    out = subprocess.run([sys.executable, "bench/staging_copy.py", "--tokens", "256", "--repeats", "2", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["path"] for r in rows} == {"gather", "scatter", "contiguous"}
    assert all(r["bytes"] == 256 * KV_BYTES_PER_TOKEN and r["run_seconds"] > 0 for r in rows)
    out = subprocess.run([sys.executable, "bench/profile_staged_scatter.py", "--tokens", "256", "--repeats", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180, check=True)
    steps = out.stdout.split("a staged pull's scatter, host time per step")[1]
    assert all(f"{step}:" in steps for step in ("views", "rows", "upload", "copy call"))
