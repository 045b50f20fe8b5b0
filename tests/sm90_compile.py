"""Compile Triton kernels for sm_90 with the ptxas Triton ships, no GPU needed.

The interpreter the CPU tests run kernels in accepts any Python, so only a real compile catches what
the compiler rejects (and register spills, which cost speed). The kernel test modules run a small
script in a subprocess without ``TRITON_INTERPRET`` (it is fixed when triton is first imported);
the script calls :func:`compile_for_sm90` per case and prints one line each.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compile_for_sm90(fn, types: dict[str, str], constexprs: dict, aligned: list[str] | None = None,
                     num_warps: int = 4, num_stages: int = 2) -> str:
    """Compile ``fn`` (a ``triton.jit`` function); ``types`` maps arguments to Triton types (others are
    i32), ``aligned`` (default: the pointers) are 16-byte aligned. Returns cuobjdump's ``REG:n STACK:n``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    if aligned is None:
        aligned = [n for n in names if types.get(n, "").startswith("*")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    objdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(objdump):
        return "?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([objdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(w for line in out.splitlines() if "REG:" in line for w in line.split()[:2])


def compile_script_lines(script: str) -> list[str]:
    """Run ``script`` (which prints a line per compiled case) in a subprocess without the interpreter;
    its lines, after checking that it succeeded and that no case spills registers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    spills = [line for line in lines if "STACK:" in line and "STACK:0" not in line]
    assert not spills, spills
    return lines
