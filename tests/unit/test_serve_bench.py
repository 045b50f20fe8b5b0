"""bench/serve.py --quick runs both setups on CPU (real daemons, a real router) and every request completes.

The model is a small random Llama checkpoint (``--model``), not the bundled SmolLM2: the bench's harness is what
is under test here, and SmolLM2 cost each of the run's four workers and two routers a GGUF parse and a
dequantization (~10 s apiece on 2 cores). Its vocabulary covers the bench's random prompt ids (100-29999).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import hf_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The shared test Llama shape with a vocabulary of 32000 (the bench's prompts draw ids up to 29999)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = hf_config("llama")
    config.vocab_size = 32000
    path = tmp_path_factory.mktemp("bench-llama")
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.slow
def test_quick_serve_benchmark_runs_both_setups_without_failures(model: str) -> None:
    out = subprocess.run([sys.executable, "bench/serve.py", "--quick", "--device", "cpu", "--num-requests", "4",
                          "--model", model, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    setups = {r["setup"]: r for r in rows if r["kind"] == "setup"}
    assert set(setups) == {"1p1d", "2x-colocated"}
    for name, r in setups.items():
        assert "error" not in r, (name, r.get("error"))
        assert (r["completed"], r["failed"]) == (4, 0), (name, r["errors"])
        assert r["output_tok_s"] > 0 and r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0
        assert 0 <= r["slo_met"] <= 4 and r["goodput_req_s"] <= r["req_s"]
    # 1p1d disaggregates every request; the replicas prefill their own and both take a share
    assert setups["1p1d"]["routes"]["disaggregated"] == 4 and setups["1p1d"]["routes"]["fallback"] == 0
    assert setups["2x-colocated"]["routes"]["direct"] == 4
    # where the pulls went: each request's last ticket to its first decode token, stage by stage
    profile = setups["1p1d"]["pull_profile"]
    assert profile["pulls"] >= 4 and set(profile["mean_join_ms"]) == {"last_pull", "resume", "first_step"}
    assert all(ms > 0 for ms in profile["mean_join_ms"].values()), profile
    assert len(setups["2x-colocated"]["decode_finished"]) == 2 and min(setups["2x-colocated"]["decode_finished"]) > 0
    assert "router_added_ms" in setups["2x-colocated"]
    ratio = next(r for r in rows if r["kind"] == "ratio")
    assert ratio["req_s"] > 0 and {"goodput_req_s", "ttft_p99_ms", "itl_p99_ms"} <= set(ratio)
