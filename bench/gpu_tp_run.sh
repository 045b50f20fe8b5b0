#!/usr/bin/env bash
# The two-GPU matrix of the TP issue, one device call on nvidia-h200-x2: TP serving across GPUs
# (greedy check against a colocated TP1 engine, --device cuda:1 with CUDA graphs, NCCL TP2 across
# both GPUs) and the KV transfer benchmark GPU 0 -> GPU 1 and with TP2 spanning both GPUs.
# Runs from the repo root; carry .whl/ (nixl + stripped nixl_cu13, msgspec, grpcio,
# grpcio-health-checking and protobuf matching the stub generator, fastapi/starlette/pydantic/
# pydantic_core/anyio/uvicorn/click/h11/opentelemetry-api and their small deps, all cp312) and the
# generated stubs services/proto_gen/pdserve (the image has no grpcio-tools).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/tpb
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader; nvidia-smi topo -m; } 2>&1 | tee "$OUT/env.txt"
echo "=== serving"
timeout -k 10 260 python3 bench/tp_serving.py --model dummy:qwen3-0.6b --dtype float32 --num-requests 16 \
  --concurrency 4 --prompt-len 2048 --max-tokens 16 --num-kv-blocks 2048 --json-out "$OUT/tp_serving.jsonl" \
  --setups "1@cuda:0/1@cuda:1; 2@cuda:0,cuda:1/1@cuda:1; 1@cuda:0/2@cuda:0,cuda:1; 2@cuda:0,cuda:1/2@cuda:0,cuda:1" \
  2>&1 | grep -v "NIXL INFO\|nixl_cu13" | tail -12 | tee "$OUT/tp_serving.txt"
run() {
  local name=$1 limit=$2; shift 2
  echo "=== $name: bench/transfer.py $*"
  timeout -k 10 "$limit" python3 bench/transfer.py "$@" --json-out "$OUT/$name.jsonl" 2>&1 | grep -v "NIXL INFO\|nixl_cu13\|pulling from" | tail -14
}
run gpu0_to_gpu1 90 --scenario layouts,tp --tokens 8192 --owner-devices cuda:0 --reader-devices cuda:1 --tp-pairs 1:1,2:2,1:2,2:1 --tp-orders HND --repeats 2
run tp_span 70 --scenario tp --owner-devices cuda:0,cuda:1 --reader-devices cuda:0,cuda:1 --tp-pairs 1:1,2:2,1:2,2:1 --tp-orders HND --repeats 2
run p_tp2_to_d_gpu1 50 --scenario tp --owner-devices cuda:0,cuda:1 --reader-devices cuda:1 --tp-pairs 2:1 --tp-orders HND,NHD --repeats 2
