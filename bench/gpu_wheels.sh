#!/usr/bin/env bash
# Fills the git-ignored folders a GPU device call carries (the image has Python 3.12, torch, triton, grpcio
# and prometheus-client, but not the rest): .whl/ (the workers' wheels, nixl_cu13 stripped of nixl_ep_cu13/
# and UCX's perftest library to fit the 64 MiB carry limit), build/routing_whl/ (the router's and the bench
# client's), build/hf_whl/ (transformers 5.23 for the HF-parity tests: the image has 5.17) and the generated
# gRPC stubs, made by a grpcio-tools of the carried grpcio's minor version. Run here (this machine's pip and its
# configuration), then carry .whl, build/routing_whl, services/proto_gen/pdserve and, for HF parity on the GPU,
# build/hf_whl (the four fit the 64 MiB carry limit).
set -euo pipefail
cd "$(dirname "$0")/.."
GRPC=${GRPC:-1.85}
dl() {  # dl DEST PACKAGE...: cp312 x86_64 wheels, no dependencies (each one is named)
  local dest=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d "$dest" "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
rm -rf .whl build/routing_whl build/hf_whl && mkdir -p .whl build/routing_whl build/hf_whl
dl .whl nixl==1.5.1 nixl-cu13==1.5.1 msgspec "grpcio==$GRPC.*" "grpcio-health-checking==$GRPC.*" protobuf gguf==0.19.0
zip -q -d .whl/nixl_cu13-*.whl 'nixl_ep_cu13/*' 'nixl_cu13.libs/ucx/libucx_perftest*' >/dev/null
dl build/routing_whl tokenizers==0.22.2 fastapi starlette pydantic pydantic-core typing-inspection annotated-types \
    annotated-doc anyio sniffio idna uvicorn click h11 httpx httpcore certifi 'llguidance>=1.9,<2' \
    opentelemetry-api importlib-metadata zipp typing-extensions
dl build/hf_whl transformers==5.23.0 'huggingface-hub>=1.31,<2' 'safetensors>=0.8' 'regex>=2025.10.22'
tools=$(mktemp -d)
python3 -m pip install -q --target "$tools" "grpcio-tools==$GRPC.*" 2>&1 | grep -v "^WARNING: Location" || true
PYTHONPATH=$tools python3 -m grpc_tools.protoc -Iservices/proto_gen=proto --python_out=. --grpc_python_out=. \
    --pyi_out=. proto/pdserve/v1/*.proto
rm -rf "$tools"
du -sh .whl build/routing_whl build/hf_whl
