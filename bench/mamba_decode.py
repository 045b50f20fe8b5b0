"""Mamba2's decode step, the fused Triton kernels against the torch chain, on Granite-4.0-H-Tiny's shapes.

    python bench/mamba_decode.py                               # CUDA, bf16, bs 1/8/32, the tile sweep
    python bench/mamba_decode.py --device cpu --quick          # smoke: tiny shapes in the interpreter

One layer's step from the in_proj output to the out_proj input (the projections are the same on both paths):
``torch`` is ``Mamba2Mixer._step`` and its gated norm (the CPU path: states gathered from the pool and scattered
back, each op a kernel), ``fused`` is ``_step_fused`` and its norm (``ops/mamba_decode_triton.py``: two launches,
states in place, then one RMSNorm launch). Both are replayed from CUDA graphs (as the engine's decode steps run)
on a real ``StatePool`` (strided slot views) with the rows' slots scattered over it. The floor is the bytes the
step cannot avoid at the HBM peak: each row's conv window and SSM state read and written once, the mixer's small
weights and the step's inputs and outputs read or written once. ``all layers`` is the step's time times the preset's
Mamba2 layers (36). ``--sweep`` times the selective update alone per ``block_p`` (rows of a head's state per program).
Times: medians of ``--iters`` samples of ``--reps`` replays (CUDA events).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import services  # noqa: E402,F401,I001  (oneDNN ISA cap before torch)
import torch  # noqa: E402

from bench._common import GPU_PEAKS, cuda_graph_ms, emit_json, int_list  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="granite-4.0-h-tiny-shape", help="a Granite-4.0-H preset")
    ap.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32])
    ap.add_argument("--sweep", type=int_list, default=[4, 8, 16, 32, 64], help="block_p values ('' for none)")
    ap.add_argument("--quick", action="store_true", help="the tiny preset, two samples: a smoke run")
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json-out", default=None)
    return ap.parse_args(argv)


class Layer:
    """One Mamba2 mixer with random weights, a pool of ``2 * max_batch`` slots and a batch's inputs."""

    def __init__(self, model: str, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        from services.engine.kv_cache.state_pool import StatePool
        from services.engine.model_config.hf import preset
        from services.engine.models.mamba2 import Mamba2Mixer
        from services.engine.parallel import ParallelConfig

        config = preset(model)
        self.num_layers = len(config.state_layer_ids)
        self.mixer = m = Mamba2Mixer(config.granite.mamba, config.hidden_size, config.rms_norm_eps, dtype, device,
                                     ParallelConfig())
        gen = torch.Generator().manual_seed(batch)
        for name, p in m.named_parameters():
            p.data.copy_((torch.rand(p.shape, generator=gen) * 2 if name == "A_log"
                          else torch.randn(p.shape, generator=gen) * 0.3).to(dtype))
        self.pool = StatePool.for_model(config, 2 * batch, dtype, device)
        self.pool.ssm[0].normal_()
        self.pool.conv[0].normal_()
        self.slots = torch.randperm(2 * batch, generator=gen)[:batch].to(device)
        s = m.spec
        proj = torch.randn(batch, s.in_proj_width, generator=gen).to(dtype).to(device)
        self.z, self.xbc, self.dt = proj.split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        self.dtype = dtype
        self.conv: torch.Tensor | None = None

    def torch_step(self) -> torch.Tensor:
        m, pool = self.mixer, self.pool
        y = m._step(self.xbc, self.dt, self.slots, pool.conv[0], pool.ssm[0])
        return m._gated_norm(y, self.z).to(self.dtype)

    def fused_step(self) -> torch.Tensor:
        m, pool = self.mixer, self.pool
        gated = m._step_fused(self.xbc, self.dt, self.z, self.slots, pool.conv[0], pool.ssm[0])
        return m._fused_norm(gated).to(self.dtype)

    def selective(self, block_p: int) -> torch.Tensor:
        """The selective update alone (on a conv output computed once) with ``block_p`` rows per program."""
        from services.engine.ops import mamba_decode_triton as kernels

        m, s = self.mixer, self.mixer.spec
        if self.conv is None:
            self.conv = kernels.conv_update(self.xbc, self.pool.conv[0], self.slots, m.conv_weight, m.conv_bias)
        return kernels.selective_update(self.conv, self.dt, self.z, self.pool.ssm[0], self.slots, m.dt_bias,
                                        m.A_log, m.D, s.n_groups, s.time_step_limit, block_p)

    def max_abs_diff(self) -> float:
        """The two paths' outputs from the same states (both update them in place: restored after each)."""
        saved = self.pool.buffer.clone()
        fused = self.fused_step().float()
        self.pool.buffer.copy_(saved)
        error = (fused - self.torch_step().float()).abs().max().item()
        self.pool.buffer.copy_(saved)
        return error

    def floor_bytes(self) -> int:
        """State read + written, weights and step inputs/outputs read or written once."""
        pool, batch, m = self.pool, len(self.slots), self.mixer
        state = batch * 2 * (pool.conv[0][0].numel() * pool.conv[0].element_size() + pool.ssm[0][0].numel() * 4)
        weights = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "proj" not in n)
        io = (self.z.numel() + self.xbc.numel() + self.dt.numel() + self.z.numel()) * self.z.element_size()
        return state + weights + io


def time_ms(fn, device: torch.device, iters: int, reps: int) -> float:
    if device.type != "cuda":  # the smoke run: one call, untimed beyond the host clock
        import time

        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return cuda_graph_ms(fn, iters, replays=reps, warmup_replays=2, device=device)


def batch_rows(args: argparse.Namespace, batch: int, device: torch.device, dtype: torch.dtype,
               peak_bw: float | None) -> list[dict]:
    layer = Layer(args.model, batch, dtype, device)
    with torch.inference_mode():
        error = layer.max_abs_diff()
        row = {"kind": "step", "batch": batch, "max_abs_diff": error, "floor_bytes": layer.floor_bytes(),
               "torch_ms": time_ms(layer.torch_step, device, args.iters, args.reps),
               "fused_ms": time_ms(layer.fused_step, device, args.iters, args.reps), "layers": layer.num_layers}
        if peak_bw:
            row["floor_ms"] = row["floor_bytes"] / peak_bw * 1e3
        rows = [row]
        from services.engine.ops import mamba_decode_triton as kernels

        s = layer.mixer.spec
        default_p, _ = kernels.ssm_tile(batch, s.num_heads, s.head_dim, s.d_state)
        for block_p in [p for p in args.sweep if p <= s.head_dim]:
            rows.append({"kind": "selective", "batch": batch, "block_p": block_p, "default": block_p == default_p,
                         "ms": time_ms(lambda p=block_p: layer.selective(p), device, args.iters, args.reps)})
    return rows


def print_table(rows: list[dict]) -> None:
    print("\n| bs | torch ms | fused ms | torch/fused | floor ms | torch/floor | fused/floor | torch all layers ms "
          "| fused all layers ms | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in (r for r in rows if r["kind"] == "step"):
        floor = r.get("floor_ms")
        cells = [str(r["batch"]), f"{r['torch_ms']:.4f}", f"{r['fused_ms']:.4f}",
                 f"{r['torch_ms'] / r['fused_ms']:.2f}",
                 f"{floor:.4f}" if floor else "-", f"{r['torch_ms'] / floor:.1f}" if floor else "-",
                 f"{r['fused_ms'] / floor:.1f}" if floor else "-", f"{r['torch_ms'] * r['layers']:.3f}",
                 f"{r['fused_ms'] * r['layers']:.3f}", f"{r['max_abs_diff']:.2e}"]
        print("| " + " | ".join(cells) + " |")
    sweep = [r for r in rows if r["kind"] == "selective"]
    if sweep:
        print("\nselective update alone, ms by block_p (* the default tile):")
        for batch in sorted({r["batch"] for r in sweep}):
            cells = [f"{r['block_p']}{'*' if r['default'] else ''}: {r['ms']:.4f}" for r in sweep
                     if r["batch"] == batch]
            print(f"  bs {batch}: " + ", ".join(cells))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: pass --device cpu --quick for a smoke run", file=sys.stderr)
        return 2
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    if args.quick:
        args.model, args.iters, args.reps = "granite-4.0-h-tiny", 2, 1
    from services.engine import ops

    ops.set_backend("triton")  # the fused norm's RMSNorm through Triton on every device (CPU: interpreted)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_bw = next((p[0] for k, p in GPU_PEAKS.items() if k in name), None)
    print(f"# {name}, {dtype}, {args.model}, torch {torch.__version__}", flush=True)
    rows = []
    for batch in args.batch_sizes:
        rows += batch_rows(args, batch, device, dtype, peak_bw)
        print(f"# {next(r for r in rows if r['kind'] == 'step' and r['batch'] == batch)}", file=sys.stderr, flush=True)
    emit_json(rows, args.json_out, False)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
