"""What every benchmark here shares: GPU peaks, timing from CUDA-graph replays, integer-list arguments,
writing its rows as JSON lines."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

# (HBM bytes/s, dense bf16/fp16 FLOP/s) from the datasheets, by device-name substring.
GPU_PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}


def cuda_graph_ms(fn: Callable[[], object], samples: int, *, captures: int = 1, replays: int = 1,
                  warmup_replays: int = 0, device=None,
                  median: Callable[[Sequence[float]], float] = statistics.median) -> float:
    """Median ms per ``fn()`` replayed from a CUDA graph: what a decode step's graph pays, without launches.

    ``fn`` runs once on a side stream first, so compiling, autotuning and allocating stay out of the
    capture; the graph holds ``captures`` calls of it, replays ``warmup_replays`` times untimed, then
    ``samples`` times ``replays`` back to back between two CUDA events. ``median`` picks the sample
    (``statistics.median_high`` keeps a measured value when ``samples`` is even).
    """
    import torch  # not at import: some benchmarks import ``services`` before torch

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(captures):
            fn()
    for _ in range(warmup_replays):
        graph.replay()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (replays * captures))
    return median(times)


def int_list(text: str) -> list[int]:
    """A comma-separated argument of integers (an argparse ``type``); empty items are skipped, so "" is none."""
    return [int(v) for v in text.split(",") if v.strip()]


def emit_json(rows: list[dict], json_out: str | None, to_stdout: bool) -> bool:
    """Write one JSON object per row to ``json_out`` and/or stdout; True when stdout got them."""
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    if json_out:
        Path(json_out).write_text(lines)
    if to_stdout:
        print(lines, end="")
    return to_stdout
