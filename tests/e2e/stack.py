"""A running pdserve stack for end-to-end tests: real worker processes, a real router, HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import httpx

from services.launch.spawn import Daemon, Router, daemons, start_router, stop_router
from services.proto_gen.pdserve.v1 import kv_pb2, worker_pb2, worker_pb2_grpc

# The tests' HTTP clients talk plain HTTP to local processes, yet httpx builds a TLS context (loading the CA bundle)
# for every new client: ~30 ms of CPU apiece, under the GIL, which a load of a thousand requests paid a thousand
# times. One context, httpx's default, built once, serves every client made through http_client(), http_get() and
# http_post().
TLS_CONTEXT = httpx.create_ssl_context()


def http_client(**kwargs) -> httpx.Client:
    """``httpx.Client(**kwargs)`` with the shared TLS context."""
    return httpx.Client(verify=TLS_CONTEXT, **kwargs)


def http_get(url: str, **kwargs) -> httpx.Response:
    """``httpx.get(url, **kwargs)`` with the shared TLS context."""
    return httpx.get(url, verify=TLS_CONTEXT, **kwargs)


def http_post(url: str, **kwargs) -> httpx.Response:
    """``httpx.post(url, **kwargs)`` with the shared TLS context."""
    return httpx.post(url, verify=TLS_CONTEXT, **kwargs)


# Small pools and blocks so prompts span several blocks; prefill and decode differ in layout and
# block size on purpose (both are reconciled by the transfer). float32 on any device: the colocated
# references run on the CPU in float32 (on a GPU, "auto" would pick bfloat16 and round differently).
PREFILL_ARGS = ("--kv-layout", "cross_layer", "--block-size", "4", "--num-kv-blocks", "512", "--max-num-seqs", "32",
                "--dtype", "float32")
DECODE_ARGS = ("--kv-layout", "per_layer", "--block-size", "8", "--num-kv-blocks", "512", "--max-num-seqs", "32",
               "--dtype", "float32")


@dataclass
class Stack:
    router: Router
    prefill: list[Daemon]
    decode: list[Daemon]

    @property
    def url(self) -> str:
        return self.router.url


@contextmanager
def stack(model: str | None, num_prefill: int = 1, num_decode: int = 1, *router_args: str,
          prefill_args: tuple[str, ...] = PREFILL_ARGS, decode_args: tuple[str, ...] = DECODE_ARGS) -> Iterator[Stack]:
    specs = [("prefill", model, prefill_args)] * num_prefill + [("decode", model, decode_args)] * num_decode
    with daemons(*specs) as started:
        prefill = [d for d in started if d.role == "prefill"]
        decode = [d for d in started if d.role == "decode"]
        router = start_router(model, [d.address for d in prefill], [d.address for d in decode], *router_args)
        try:
            yield Stack(router, prefill, decode)
        finally:
            stop_router(router)


def random_prompt(seed: int, n: int = 20) -> list[int]:
    """``n`` seeded token ids inside the test checkpoints' vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def hold_ticket(stub: worker_pb2_grpc.PrefillWorkerStub, request_id: str, prompt: list[int],
                params: worker_pb2.SamplingParams) -> kv_pb2.TransferTicket:
    """Prefill ``prompt`` straight on a prefill worker for a decode reader of block size 8 (DECODE_ARGS) and
    return its ticket, unpulled: the worker holds the blocks until a pull, a Release or the lease."""
    held = stub.Prefill(worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, params=params,
                                                  reader_tp_size=1, reader_block_size=8), timeout=30)
    assert held.HasField("ticket")
    return held.ticket


def info(d: Daemon) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(d.address) as ch:
        stub = worker_pb2_grpc.PrefillWorkerStub(ch) if d.role == "prefill" else worker_pb2_grpc.DecodeWorkerStub(ch)
        return stub.Info(worker_pb2.InfoRequest(), timeout=5)


def completion_tokens(url: str, prompt: list[int] | str, max_tokens: int, stream: bool, **extra) -> list[int]:
    """Greedy completion through the router; the token ids the client received, in order."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, "logprobs": 0,
            "return_tokens_as_token_ids": True, "ignore_eos": True, **extra}
    with http_client(timeout=300) as client:
        if not stream:
            response = client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            return _token_ids(response.json()["choices"][0]["logprobs"]["tokens"])
        tokens: list[int] = []
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"]
                    if choice and choice[0].get("logprobs"):
                        tokens += _token_ids(choice[0]["logprobs"]["tokens"])
        return tokens


# (prefill args, decode args) of a TP 1 -> 2 and a TP 2 -> 1 pair on CPU (a follower rank in its own process on the
# TP-2 side), different layouts and block sizes on the two sides: the model tests' pairs across TP sizes.
TP_PAIRS = {
    "P-tp1-D-tp2": (
        ("--kv-layout", "cross_layer", "--block-size", "16", "--num-kv-blocks", "256", "--dtype", "float32"),
        ("--tp", "2", "--device", "cpu", "--kv-layout", "per_layer", "--block-size", "8", "--num-kv-blocks", "256",
         "--dtype", "float32"),
    ),
    "P-tp2-D-tp1": (
        ("--tp", "2", "--device", "cpu", "--kv-layout", "per_layer", "--block-size", "8", "--num-kv-blocks", "256",
         "--dtype", "float32"),
        ("--kv-layout", "cross_layer", "--block-size", "16", "--num-kv-blocks", "256", "--dtype", "float32"),
    ),
}


def worker_tp(args: tuple[str, ...]) -> int:
    """The TP size a worker's arguments ask for."""
    return int(args[args.index("--tp") + 1]) if "--tp" in args else 1


def colocated_greedy(model: str, max_tokens: int, num_kv_blocks: int = 256) -> Callable[[list[int]], list[int]]:
    """A prompt's greedy tokens from one engine doing prefill and decode (float32 on CPU, as the workers run):
    the reference a disaggregated answer must equal."""
    from services.contract.sampling_params import SamplingParams
    from services.engine.engine_config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return lambda prompt: engine.generate([prompt], params)[0].token_ids


def _token_ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def metric_total(d: Daemon, name: str, label: str = "") -> float:
    """Sum of a metric's samples (those whose labels contain ``label``) on the worker's /metrics.

    A metric with no such sample is an error, not 0: every series a worker has starts at 0, so a missing
    one is a renamed metric or a wrong label, and "== 0" must not pass on it.
    """
    text = http_get(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10).text
    samples = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line]
    assert samples, f"no {name} sample with {label!r} on the {d.role} worker's /metrics"
    return sum(samples)


def pull_totals(decode: Daemon) -> dict[str, float]:
    """A decode worker's KV pulls so far, the bytes they moved and the requests it recomputed instead."""
    return {"pulls": metric_total(decode, "pdserve_kv_transfer_seconds_count"),
            "bytes": metric_total(decode, "pdserve_kv_transfer_bytes_total"),
            "recomputed": metric_total(decode, "pdserve_local_recompute_fallbacks_total")}


def finished_requests(d: Daemon) -> float:
    """``pdserve_requests_total{outcome="finished"}`` scraped from the worker's /metrics endpoint."""
    return metric_total(d, "pdserve_requests_total", 'outcome="finished"')


def stop_up(proc: subprocess.Popen) -> None:
    """Stop a ``pdserve up`` started in its own session as Ctrl-C would, then kill whatever of it is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    if proc.poll() is None or subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).returncode == 0:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def ideal_pull_bytes(model: str, prefill_args: tuple[str, ...], decode_args: tuple[str, ...], num_tokens: int) -> int:
    """What a decode worker must pull for a ``num_tokens`` prompt: full groups every token, sliding groups the
    tokens of the last window.

    Counted in units of the finer of the two block sizes (the granularity a block can be moved in), on the
    decode worker's layout at TP 1 (a TP decode worker's ranks pull their head slices of the same bytes).
    """
    from services.engine.engine_config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    def block_size(args: tuple[str, ...]) -> int:
        return int(args[args.index("--block-size") + 1])

    unit = min(block_size(prefill_args), block_size(decode_args))
    engine_config = EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=4,
                                 block_size=block_size(decode_args))
    layout = LLMEngine(engine_config).kv_layout
    total = 0
    for g in layout.groups:
        start = 0 if g.sliding_window is None else max(0, num_tokens - g.sliding_window) // unit * unit
        end = -(-num_tokens // unit) * unit
        total += (end - start) * layout.block_bytes(g.group_id) // g.block_size
    return total
