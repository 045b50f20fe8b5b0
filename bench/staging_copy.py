"""KV staging's copies (kv/ranks/staging_area.py) on one device: a fragmented pool's blocks gathered into a span and
scattered back (``index_select``/``index_copy_`` of whole rows), beside one contiguous copy of the same bytes.

Llama-3.1-8B KV (cross-layer, bf16, block 16: 2 MiB a block), every other block of the pool. Per prompt length
and path: the host time to queue the copy (what the caller's thread pays), the copy's time on the device
(CUDA events), its bandwidth (read + write), and the time through ``StagingArea.run`` as the owner's gather
runs it (queued on the side stream, waited for). Median of ``--repeats``.

    python bench/staging_copy.py --device cuda --tokens 512,2048,8192,32768
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench._common import emit_json  # noqa: E402
from bench.kv_synthetic import layout_for  # noqa: E402
from bench.transfer import SHAPE  # noqa: E402
from services.engine.kv_cache.buffers import KVCache  # noqa: E402
from services.kv.plan.staging import staged_spans
from services.kv.ranks.staging_area import StagingArea, gather, scatter  # noqa: E402
from services.kv.spec.wire import MemoryRegion  # noqa: E402


def contiguous_copy(layout, buffers, area, offset, ids) -> None:  # noqa: ANN001
    """The same bytes from consecutive blocks: one contiguous copy, the floor a gather or scatter is held to."""
    (s,), _ = staged_spans(layout, (len(ids[0]),))
    area.buffer[offset:offset + s.num_bytes].copy_(buffers[0].view(-1).view(torch.uint8)[:s.num_bytes])


PATHS = {"gather": gather, "scatter": scatter, "contiguous": contiguous_copy}


def measure(device: torch.device, tokens: int, repeats: int) -> list[dict]:
    n = -(-tokens // SHAPE["block_size"])
    layout = layout_for({**SHAPE, "kind": "cross_layer", "num_blocks": 2 * n + 1}, 1)
    cache = KVCache(layout, device)
    (_, num_bytes) = staged_spans(layout, (n,))
    buf = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    area = StagingArea(buf, MemoryRegion(0, buf.data_ptr(), num_bytes, 0, "VRAM" if device.type == "cuda" else "DRAM"))
    offset = area.alloc(num_bytes)
    ids = [np.arange(0, 2 * n, 2, dtype=np.int64)]
    rows = []
    for name, fn in PATHS.items():
        host, dev, through_run = [], [], []
        for _ in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(area.stream):
                    start.record()
                    t = time.perf_counter()
                    fn(layout, cache.buffers, area, offset, ids)
                    host.append(time.perf_counter() - t)
                    end.record()
                end.synchronize()
                dev.append(start.elapsed_time(end) / 1e3)
            t = time.perf_counter()
            area.run(fn, layout, cache.buffers, area, offset, ids)
            through_run.append(time.perf_counter() - t)
        med = {k: statistics.median(v[1:]) if v else float("nan")
               for k, v in (("host", host), ("device", dev), ("run", through_run))}
        rows.append({"scenario": "staging_copy", "device": str(device), "tokens": tokens, "path": name,
                     "bytes": num_bytes, "host_seconds": med["host"], "device_seconds": med["device"],
                     "run_seconds": med["run"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = [r for t in args.tokens.split(",") for r in measure(device, int(t), args.repeats)]
    if emit_json(rows, args.json_out, args.json):
        return
    print(f"# KV staging copies on {device}: Llama-3.1-8B KV (cross-layer, bf16, block 16), every other block, "
          f"median of {args.repeats}")
    print(f"{'tokens':>6} {'path':>15} {'MiB':>6} {'host us':>8} {'device ms':>10} {'GB/s (r+w)':>10} {'run ms':>8}")
    for r in rows:
        bw = 2 * r["bytes"] / r["device_seconds"] / 1e9 if r["device_seconds"] == r["device_seconds"] else float("nan")
        print(f"{r['tokens']:>6} {r['path']:>15} {r['bytes'] / 2**20:>6.0f} {r['host_seconds'] * 1e6:>8.0f} "
              f"{r['device_seconds'] * 1e3:>10.3f} {bw:>10.0f} {r['run_seconds'] * 1e3:>8.3f}")


if __name__ == "__main__":
    main()
