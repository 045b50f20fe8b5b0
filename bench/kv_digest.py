"""Which KV digest: the candidates' cost on the same KV, side by side, and what each can detect.

The KV of one request (Llama-3.1-8B shape: 32 layers, 8 KV heads of 128, bf16, block 16, cross-layer
blocks scattered over the pool) is digested by:

  mix32-sum   the chosen digest (``services.kv.digest.scheme``): each 32-bit word's bits XOR its position key,
              through a 32-bit bijection, summed mod 2**32 per token unit. Splits by token range, TP
              head slice and source; any one-element change is caught. Triton on CUDA, numpy on CPU,
              run as a KV rank runs it (``DigestRunner``).
  plain-sum   the sum of the raw bits (one reduction): the cheapest pass over the bytes, the floor a
              digest can reach; blind to reordering (a block read into the wrong slot sums the same).
  read-floor  torch's float32 sum of as many contiguous bytes (no gather): what one read of them costs on the
              device, the reference for the chosen digest's rate (not a digest of the blocks).
  crc32-host  zlib's CRC-32 of the gathered blocks, copied to the host first on CUDA (what "on the
              device where the KV lives" avoids); order-sensitive, so it cannot be split by token
              range or TP slice when the two sides' block sizes or layouts differ.
  adler32-host  zlib's Adler-32 (SGLang's choice, there on the GPU), same limits as crc32.

A second table times the chosen digest the way a pull runs it (a rank's ``DigestRunner``) after the
device has been idle for a while (``--idle-gaps``, ms): a digest that follows a sub-millisecond copy
on an otherwise idle GPU pays the device's wake-up, which back-to-back timings hide.

    python bench/kv_digest.py                      # CPU
    python bench/kv_digest.py --device cuda        # GPU
    python bench/kv_digest.py --device cuda --warps 1,2,4   # the kernel at other warp counts too
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench._common import emit_json  # noqa: E402
from services.kv.digest import scheme as D  # noqa: E402
from services.kv.digest.runner import DigestRunner  # noqa: E402
from services.kv.spec.groups import AttentionKind, KVCacheGroupSpec  # noqa: E402
from services.kv.spec.layout import BlockOrder, KVLayoutSpec, LayoutKind  # noqa: E402

BLOCK, LAYERS, HEADS, HEAD_DIM = 16, 32, 8, 128


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def run(device: torch.device, tokens: int, repeats: int, warps: list[int], only: set[str]) -> list[dict]:
    num_blocks = 2 * -(-tokens // BLOCK) + 1
    group = KVCacheGroupSpec(0, AttentionKind.FULL, tuple(range(LAYERS)), BLOCK)
    layout = KVLayoutSpec(LayoutKind.CROSS_LAYER, BlockOrder.NHD, num_blocks, HEADS, HEAD_DIM, "bfloat16", (group,))
    (buffer,) = [torch.randn(b.num_bytes // 2, device=device).to(torch.bfloat16) for b in layout.buffers()]
    ids = list(range(0, num_blocks - 1, 2))[: -(-tokens // BLOCK)]  # every other block: scattered
    job = D.DigestJob(0, ids, 0, tokens, BLOCK, 0, HEADS, 0)
    index = torch.tensor(ids, device=device)
    blocks = buffer.view(num_blocks, -1)
    num_bytes = len(ids) * layout.block_bytes(0)

    def host_bytes() -> bytes:
        return blocks[index].view(torch.uint8).cpu().numpy().tobytes()

    runner = DigestRunner(layout, [buffer])  # as a KV rank runs it: its views and device buffers kept
    contiguous = buffer.view(torch.int32)[: num_bytes // 4]
    candidates = {
        "mix32-sum": lambda: runner.run([job]),
        **{f"mix32-sum/w{w}": _with_warps(w, lambda: runner.run([job])) for w in warps if device.type == "cuda"},
        "read-floor": lambda: contiguous.view(torch.float32).sum().item(),
        "plain-sum": lambda: blocks[index].view(torch.int16).sum(dtype=torch.int64).item(),
        "crc32-host": lambda: zlib.crc32(host_bytes()),
        "adler32-host": lambda: zlib.adler32(host_bytes()),
    }
    rows = []
    for name, fn in candidates.items():
        if only and name.split("/")[0] not in only:
            continue
        seconds = timed(fn, device, repeats)
        rows.append({"scenario": "kv_digest", "device": str(device), "tokens": tokens, "candidate": name,
                     "bytes": num_bytes, "seconds": seconds, "gbps": num_bytes / seconds / 1e9})
    return rows


def _with_warps(warps: int, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the CUDA digest kernel launched at ``warps`` warps (its default restored after)."""
    from services.kv.digest import kernel as digest_triton

    def call() -> object:
        default, digest_triton.NUM_WARPS = digest_triton.NUM_WARPS, warps
        try:
            return fn()
        finally:
            digest_triton.NUM_WARPS = default
    return call


def after_idle(device: torch.device, tokens: int, gaps_ms: list[float], repeats: int) -> list[dict]:
    """The chosen digest through a rank's runner, each call after ``gap`` ms with nothing on the device."""
    num_blocks = -(-tokens // BLOCK) + 1
    group = KVCacheGroupSpec(0, AttentionKind.FULL, tuple(range(LAYERS)), BLOCK)
    layout = KVLayoutSpec(LayoutKind.CROSS_LAYER, BlockOrder.HND, num_blocks, HEADS, HEAD_DIM, "bfloat16", (group,))
    buffers = [torch.zeros(b.num_bytes // 2, dtype=torch.bfloat16, device=device) for b in layout.buffers()]
    runner = DigestRunner(layout, buffers)
    job = D.DigestJob(0, list(range(num_blocks - 1)), 0, tokens, BLOCK, 0, HEADS, 0)
    rows = []
    for gap in gaps_ms:
        samples = []
        for _ in range(repeats):
            sync(device)
            time.sleep(gap / 1e3)
            t = time.perf_counter()
            runner.run([job])
            samples.append(time.perf_counter() - t)
        rows.append({"scenario": "kv_digest_after_idle", "device": str(device), "tokens": tokens, "gap_ms": gap,
                     "seconds": statistics.median(samples)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--candidates", default="", help="only these (e.g. mix32-sum,read-floor; default: all, "
                    "whose host checksums take seconds a run at 32k tokens)")
    ap.add_argument("--warps", default="", help="also time the CUDA kernel at these warp counts (e.g. 1,2,4,8)")
    ap.add_argument("--idle-gaps", default="0,0.5,2,20", help="ms of idle device before each digest (second table)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    warps = [int(w) for w in args.warps.split(",") if w]
    rows = [r for n in args.tokens.split(",") for r in run(device, int(n), args.repeats, warps,
                                                                  set(filter(None, args.candidates.split(","))))]
    gaps = [float(g) for g in args.idle_gaps.split(",") if g]
    idle = [r for n in args.tokens.split(",") for r in after_idle(device, int(n), gaps, 4 * args.repeats)] if gaps \
        else []
    if emit_json(rows + idle, args.json_out, args.json):
        return
    print(f"# KV digest candidates on {device}: Llama-3.1-8B KV (bf16, block 16, scattered blocks), median of "
          f"{args.repeats}; ratio = time / mix32-sum's")
    print(f"{'tokens':>6} {'MiB':>6} {'candidate':>13} {'ms':>9} {'GB/s':>8} {'ratio':>6}")
    for n in dict.fromkeys(r["tokens"] for r in rows):
        mine = [r for r in rows if r["tokens"] == n]
        chosen = next(r for r in mine if r["candidate"] == "mix32-sum")["seconds"]
        for r in mine:
            print(f"{n:>6} {r['bytes'] / 2**20:>6.0f} {r['candidate']:>13} {r['seconds'] * 1e3:>9.3f} "
                  f"{r['gbps']:>8.1f} {r['seconds'] / chosen:>6.2f}")
    if idle:
        print(f"\n# mix32-sum through a rank's DigestRunner after the device sat idle, median of {4 * args.repeats}; "
              "ratio = time / back-to-back (gap 0)")
        print(f"{'tokens':>6} {'idle ms':>8} {'ms':>9} {'ratio':>6}")
        for r in idle:
            base = next(x for x in idle if x["tokens"] == r["tokens"] and x["gap_ms"] == gaps[0])["seconds"]
            print(f"{r['tokens']:>6} {r['gap_ms']:>8} {r['seconds'] * 1e3:>9.3f} {r['seconds'] / base:>6.2f}")


if __name__ == "__main__":
    main()
