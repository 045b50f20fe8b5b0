"""Mamba2's prefill, the Triton kernels against the torch chain, on Granite-4.0-H-Tiny's shapes.

    python bench/mamba_prefill.py                              # CUDA, bf16, 512/2k/8k tokens, 1 and 4 requests
    python bench/mamba_prefill.py --device cpu --quick         # smoke: tiny shapes in the interpreter

One layer's prefill step from the in_proj output to the out_proj input (the projections are the same on both
paths), side by side in one run:
- ``layer``: ``torch`` is the CPU path (per request: ``_chunk``'s F.conv1d, the fp32 ``ssd_scan`` in torch ops,
  the D skip; then the gated norm), ``triton`` is ``_chunks_fused`` and its norm (every request of the step in
  one set of launches: ``ops/causal_conv_triton.py``, ``ops/ssd_scan_triton.py``, then one RMSNorm launch).
- ``scan``: the scan alone on one request's conv output, ``models/mamba2.ssd_scan`` (B and C repeated per head,
  as the torch path feeds it) against ``ops/ssd_scan_triton.ssd_chunks``.
Times are eager (the engine runs prefill steps eagerly, so host launch costs count): medians of ``--iters``
samples of ``--reps`` back-to-back calls between CUDA events, states in a real ``StatePool`` updated in place.
FLOPs are the chunked scan's matmuls at their causal size (q.k within chunks, chunk states, the state read by
the queries, the intra-chunk products) plus the conv; MFU against the dense bf16 peak. The byte floor is the
in_proj output read once, the norm's input written once (bf16) and every request's state read and written.
``all layers`` is a layer's time times the preset's Mamba2 layers (36).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import services  # noqa: E402,F401,I001  (oneDNN ISA cap before torch)
import torch  # noqa: E402

from bench._common import GPU_PEAKS, emit_json, int_list  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="granite-4.0-h-tiny-shape", help="a Granite-4.0-H preset")
    ap.add_argument("--tokens", type=int_list, default=[512, 2048, 8192], help="tokens of the step")
    ap.add_argument("--requests", type=int_list, default=[1, 4], help="requests the step's tokens are split into")
    ap.add_argument("--quick", action="store_true", help="the tiny preset, 40/100 tokens, one sample: a smoke run")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json-out", default=None)
    return ap.parse_args(argv)


class Layer:
    """One Mamba2 mixer with random weights, a pool of ``2 * requests`` slots (random states), and one step's
    in_proj output for ``requests`` requests sharing ``tokens``."""

    def __init__(self, model: str, tokens: int, requests: int, dtype: torch.dtype, device: torch.device) -> None:
        from services.engine.kv_cache.state_pool import StateBatch, StatePool
        from services.engine.model_config.hf import preset
        from services.engine.models.mamba2 import Mamba2Mixer
        from services.engine.parallel import ParallelConfig

        config = preset(model)
        self.num_layers = len(config.state_layer_ids)
        self.mixer = m = Mamba2Mixer(config.granite.mamba, config.hidden_size, config.rms_norm_eps, dtype, device,
                                     ParallelConfig())
        gen = torch.Generator().manual_seed(tokens + requests)
        for name, p in m.named_parameters():
            p.data.copy_((torch.rand(p.shape, generator=gen) * 2 if name == "A_log"
                          else torch.randn(p.shape, generator=gen) * 0.3).to(dtype))
        self.pool = StatePool.for_model(config, 2 * requests, dtype, device)
        self.pool.ssm[0].normal_()
        self.pool.conv[0].normal_()
        slots = torch.randperm(2 * requests, generator=gen)[:requests].tolist()
        self.lens = [tokens // requests + (i < tokens % requests) for i in range(requests)]
        self.states = StateBatch.of(slots, [1] * requests, device)  # carried states: no request starts at token 0
        s = m.spec
        proj = torch.randn(tokens, s.in_proj_width, generator=gen).to(dtype).to(device)
        self.z, self.xbc, self.dt = proj.split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        self.dtype = dtype

    def torch_layer(self) -> torch.Tensor:
        m, pool, start, outs = self.mixer, self.pool, 0, []
        for n, slot in zip(self.lens, self.states.slots, strict=True):
            outs.append(m._chunk(self.xbc[start:start + n], self.dt[start:start + n], pool.conv[0][slot],
                                 pool.ssm[0][slot]))
            start += n
        return m._gated_norm(torch.cat(outs), self.z).to(self.dtype)

    def triton_layer(self) -> torch.Tensor:
        m, pool = self.mixer, self.pool
        gated = m._chunks_fused(self.xbc, self.dt, self.z, self.lens, self.states, pool.conv[0], pool.ssm[0])
        return m._fused_norm(gated).to(self.dtype)

    def max_abs_diff(self) -> float:
        """The two paths' outputs from the same states (both update them in place: restored after each)."""
        saved = self.pool.buffer.clone()
        fused = self.triton_layer().float()
        self.pool.buffer.copy_(saved)
        error = (fused - self.torch_layer().float()).abs().max().item()
        self.pool.buffer.copy_(saved)
        return error

    def floor_bytes(self) -> int:
        s, tokens, size = self.mixer.spec, len(self.z), self.z.element_size()
        state = self.pool.conv[0][0].numel() * self.pool.conv[0].element_size() + self.pool.ssm[0][0].numel() * 4
        return tokens * (s.in_proj_width + s.intermediate_size) * size + 2 * len(self.lens) * state


def scan_flops(spec, lens: list[int]) -> float:
    """The chunked scan's matmul FLOPs at their causal size, plus the conv's multiply-adds."""
    total = 0.0
    for n in lens:
        for at in range(0, n, spec.chunk_size):
            q = min(spec.chunk_size, n - at)
            causal = q * (q + 1) / 2
            total += 2 * causal * spec.n_groups * spec.d_state  # q.k per group
            total += 2 * causal * spec.num_heads * spec.head_dim  # intra-chunk scores times x
            total += 2 * 2 * q * spec.num_heads * spec.head_dim * spec.d_state  # chunk states, the state read
    return total + 2 * sum(lens) * spec.conv_dim * spec.d_conv


class Scan:
    """The scan alone on one request's conv output (computed once), torch against the kernels."""

    def __init__(self, layer: Layer) -> None:
        from services.engine.ops import causal_conv_triton
        from services.engine.ops.scan_chunks import scan_chunks

        m, s = layer.mixer, layer.mixer.spec
        n = len(layer.z)
        self.table = scan_chunks([n], [0], [False], s.chunk_size, layer.z.device)
        conv = causal_conv_triton.causal_conv(layer.xbc, layer.pool.conv[0].clone(), m.conv_weight, m.conv_bias,
                                              self.table)
        x, b, c = conv.split([s.intermediate_size, s.n_groups * s.d_state, s.n_groups * s.d_state], dim=-1)
        self.x, self.b, self.c = x.view(n, s.num_heads, s.head_dim), b.view(n, s.n_groups, s.d_state), \
            c.view(n, s.n_groups, s.d_state)
        self.dt = m._time_step(layer.dt)
        self.a = m._a()
        self.state = layer.pool.ssm[0][:1].clone()
        self.spec = s

    def torch_scan(self) -> torch.Tensor:
        from services.engine.models.mamba2 import ssd_scan

        per_group = self.spec.num_heads // self.spec.n_groups
        return ssd_scan(self.x.float(), self.dt, self.a, self.b.float().repeat_interleave(per_group, 1),
                        self.c.float().repeat_interleave(per_group, 1), self.state[0], self.spec.chunk_size)[0]

    def triton_scan(self) -> torch.Tensor:
        from services.engine.ops.ssd_scan_triton import ssd_chunks

        return ssd_chunks(self.x, self.dt, self.a, self.b, self.c, self.state, self.table, a_is_log=False)


def time_ms(fn, device: torch.device, iters: int, reps: int) -> float:
    """Median ms per eager call (CUDA events); on CPU one call on the host clock."""
    import time

    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    fn()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    return statistics.median(samples)


def step_row(args: argparse.Namespace, tokens: int, requests: int, device: torch.device, dtype: torch.dtype,
             peaks: tuple[float, float] | None) -> dict:
    layer = Layer(args.model, tokens, requests, dtype, device)
    with torch.inference_mode():
        row = {"tokens": tokens, "requests": requests, "layers": layer.num_layers,
               "max_abs_diff": layer.max_abs_diff(), "flops": scan_flops(layer.mixer.spec, layer.lens),
               "floor_bytes": layer.floor_bytes(),
               "torch_ms": time_ms(layer.torch_layer, device, args.iters, args.reps),
               "triton_ms": time_ms(layer.triton_layer, device, args.iters, args.reps)}
        if requests == 1:
            scan = Scan(layer)
            row["scan_max_abs_diff"] = (scan.triton_scan().view(tokens, -1) - scan.torch_scan().view(tokens, -1)
                                        ).abs().max().item()
            row["scan_torch_ms"] = time_ms(scan.torch_scan, device, args.iters, args.reps)
            row["scan_triton_ms"] = time_ms(scan.triton_scan, device, args.iters, args.reps)
    if peaks:
        row["floor_ms"] = max(row["floor_bytes"] / peaks[0], row["flops"] / peaks[1]) * 1e3
        row["triton_mfu"] = row["flops"] / (row["triton_ms"] * 1e-3) / peaks[1]
        if "scan_triton_ms" in row:
            row["scan_triton_mfu"] = row["flops"] / (row["scan_triton_ms"] * 1e-3) / peaks[1]
    return row


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(rows: list[dict]) -> None:
    print("\n| tokens | requests | torch ms | triton ms | torch/triton | floor ms | triton/floor | triton MFU "
          "| torch all layers ms | triton all layers ms | scan torch ms | scan triton ms | scan MFU | GFLOP "
          "| floor MB | max abs diff |")
    print("|" + "---|" * 16)
    for r in rows:
        floor = r.get("floor_ms")
        cells = [str(r["tokens"]), str(r["requests"]), f"{r['torch_ms']:.3f}", f"{r['triton_ms']:.3f}",
                 f"{r['torch_ms'] / r['triton_ms']:.1f}", _cell(floor, ".4f"),
                 _cell(floor and r["triton_ms"] / floor, ".1f"), _cell(r.get("triton_mfu"), ".3f"),
                 f"{r['torch_ms'] * r['layers']:.2f}", f"{r['triton_ms'] * r['layers']:.2f}",
                 _cell(r.get("scan_torch_ms"), ".3f"), _cell(r.get("scan_triton_ms"), ".3f"),
                 _cell(r.get("scan_triton_mfu"), ".3f"), f"{r['flops'] / 1e9:.2f}", f"{r['floor_bytes'] / 1e6:.1f}",
                 f"{r['max_abs_diff']:.2e}"]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: pass --device cpu --quick for a smoke run", file=sys.stderr)
        return 2
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    if args.quick:
        args.model, args.tokens, args.requests, args.iters, args.reps = "granite-4.0-h-tiny", [40, 100], [1, 3], 1, 1
    from services.engine import ops

    ops.set_backend("triton")  # the fused norm's RMSNorm through Triton on every device (CPU: interpreted)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peaks = next((p for k, p in GPU_PEAKS.items() if k in name), None)
    print(f"# {name}, {dtype}, {args.model}, torch {torch.__version__}", flush=True)
    rows = []
    for tokens in args.tokens:
        for requests in args.requests:
            rows.append(step_row(args, tokens, requests, device, dtype, peaks))
            print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    emit_json(rows, args.json_out, False)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
