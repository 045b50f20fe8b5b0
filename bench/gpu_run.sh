#!/usr/bin/env bash
# One device call for the whole GPU matrix: CUDA parity tests (engine + decode graphs), the engine
# benchmark (dummy Llama-3.1-8B, bf16) and the KV transfer benchmark (VRAM, two processes).
# Runs from the repo root on the GPU machine; carry .whl/ (wheels, see bench/RESULTS.md) and the
# generated stubs services/proto_gen/pdserve (the image has no grpcio-tools).
set -uo pipefail
source bench/gpu_env.sh
PDSERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/unit/test_engine_parity.py \
    tests/unit/test_cuda_graphs.py tests/unit/test_sampler.py 2>&1 | tee "$OUT/parity_cuda.log" | tail -4
python3 bench/engine.py --model dummy:llama-3.1-8b --dtype bfloat16 --device cuda --batch-sizes 1,32 \
    --prompt-len 512 --decode-steps 32 --json-out "$OUT/engine_gpu.jsonl" 2>&1 | tee "$OUT/engine_gpu.txt"
python3 bench/transfer.py --device cuda --tokens 1024,4096,8192 --json-out "$OUT/transfer_gpu.jsonl" 2>&1 \
    | grep -v "NIXL INFO" | tee "$OUT/transfer_gpu.txt"
