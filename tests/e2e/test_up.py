"""`pdserve up` (what `make run` starts): the bundled SmolLM2 behind the router answers a chat request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from services.launcher import free_port


def test_up_serves_the_default_model_and_stops_on_ctrl_c() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        ready = proc.stdout.readline()  # the one line `pdserve up` prints when everything serves
        assert ready.startswith("pdserve up: ready on http://127.0.0.1:"), ready
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=120) as client:
            assert client.get(f"{url}/health").status_code == 200
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            answer = client.post(f"{url}/v1/chat/completions", json={
                "model": model, "temperature": 0, "max_tokens": 24,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            }).json()
        assert "Paris" in answer["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGINT)  # Ctrl-C stops the router and every worker
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        leftovers = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert not leftovers, f"processes left behind: {leftovers}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
