"""Build hook: generate the gRPC stubs from proto/ before the Python files are collected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def generate_protos() -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto").rglob("*.proto"))
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-Iservices/proto_gen=proto",
           "--python_out=.", "--grpc_python_out=.", "--pyi_out=.", *protos]
    subprocess.run(cmd, cwd=ROOT, check=True)


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
