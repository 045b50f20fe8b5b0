#!/usr/bin/env bash
# Serving-level benchmarks on one lent GPU, in device calls of under 10 minutes each. Carry .whl/,
# services/proto_gen/pdserve and build/routing_whl/ (the router's and the bench client's wheels the image lacks:
# fastapi, starlette, pydantic, uvicorn, httpx, tokenizers and their dependencies; see bench/RESULTS.md):
#   bash bench/gpu_serve_run.sh routing_shared   bench/routing.py, shared-prefix workloads, both policies:
#                                                4 prefill + 1 decode workers of dummy Llama-3.1-8B on one GPU
#                                                (about 80 GB of weights: an H200)
#   bash bench/gpu_serve_run.sh routing_chat     the same for the multi-turn workloads (one and two routers)
#   SETUPS=planner,disagg bash bench/gpu_serve_run.sh shifting
#                                                bench/serve.py's shifting workload (40 s phases) with three
#                                                workers of dummy Llama-3.1-8B on GPU 0: the planner-on setup,
#                                                1P2D, 3 colocated replicas (SETUPS picks them: one device call
#                                                holds about two setups)
#   bash bench/gpu_serve_run.sh kv_parts         32k-token prompts on one GPU (dummy Llama-3.1-8B, P and D on GPU 0):
#                                                time to the second token with KV sent per chunk, with one pull
#                                                (--no-kv-parts), and two colocated replicas' inter-token latency
#   bash bench/gpu_serve_run.sh kv_parts_tcp     the same two disaggregated runs with UCX forced to TCP + host staging;
#                                                two requests TCP_RATE (default 0.02) req/s apart, so that one's pull
#                                                does not share the link with the next one's (earlier runs: 0.05)
#   bash bench/gpu_serve_run.sh final_part       the short final chunk: 32k-token prompts on one GPU with the prefill's
#                                                --kv-final-part-tokens at its default (512, beside colocated) and 0,
#                                                then its price in prefill time alone (bench/final_part.py, 512 and 256)
set -uo pipefail
source bench/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    build/routing_whl/*.whl || exit 1
ROUTING=(python3 bench/routing.py --device cuda --model dummy:llama-3.1-8b --scale gpu --num-prefill 4
         --decode-kv-blocks 4096 --worker-args=--enforce-eager --records)
for part in "$@"; do
  case "$part" in
    routing_shared)
      timeout 560 "${ROUTING[@]}" --workloads shared-uniform,shared-zipf --json-out "$OUT/routing_shared_gpu.jsonl" \
          2>&1 | grep -v "NIXL INFO" | tee "$OUT/routing_shared_gpu.txt" ;;
    routing_chat)
      timeout 560 "${ROUTING[@]}" --workloads multi-turn,multi-turn-2routers --json-out "$OUT/routing_chat_gpu.jsonl" \
          2>&1 | grep -v "NIXL INFO" | tee "$OUT/routing_chat_gpu.txt" ;;
    shifting)
      timeout 580 python3 bench/serve.py --workload shifting --device cuda --model dummy:llama-3.1-8b --num-workers 3 \
          --gpus 0,0,0 --num-kv-blocks 2048 --phase-duration-s 40 --setups "${SETUPS:-disagg,colocated,planner}" \
          --json-out "$OUT/shifting_gpu.jsonl" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/shifting_gpu.txt" ;;
    kv_parts)
      for router_args in "" "--no-kv-parts"; do
        setups=$([ -z "$router_args" ] && echo disagg,colocated || echo disagg)
        timeout 280 python3 bench/serve.py --device cuda --model dummy:llama-3.1-8b --gpus 0,0 --mix 32768:16 \
            --num-requests 6 --request-rate 0.25 --num-kv-blocks 6144 --setups "$setups" --router-args="$router_args" \
            --json-out "$OUT/kv_parts${router_args:+_off}.jsonl" 2>&1 | grep -v "NIXL INFO" \
            | tee "$OUT/kv_parts${router_args:+_off}.txt" | tail -12
      done ;;
    final_part)
      for tokens in 512 0; do
        setups=$([ "$tokens" = 512 ] && echo disagg,colocated || echo disagg)
        timeout 300 python3 bench/serve.py --device cuda --model dummy:llama-3.1-8b --gpus 0,0 --mix 32768:16 \
            --num-requests 6 --request-rate 0.25 --num-kv-blocks 6144 --setups "$setups" \
            --worker-args="--kv-final-part-tokens=$tokens" --json-out "$OUT/final_part$tokens.jsonl" 2>&1 \
            | grep -v "NIXL INFO" | tee "$OUT/final_part$tokens.txt" | tail -8
      done
      for tokens in 512 256; do
        timeout 150 python3 bench/final_part.py --model dummy:llama-3.1-8b --dtype bfloat16 --device cuda \
            --prompt-len 32768 --final-part-tokens "$tokens" --rounds 3 2>&1 | tail -4
      done ;;
    kv_parts_tcp)  # the same over UCX's TCP transport with host staging: a stand-in for nodes without RDMA
      for router_args in "" "--no-kv-parts"; do
        UCX_TLS=tcp,cuda_copy timeout 280 python3 bench/serve.py --device cuda --model dummy:llama-3.1-8b --gpus 0,0 \
            --mix 32768:8 --num-requests 2 --request-rate "${TCP_RATE:-0.02}" --num-kv-blocks 6144 --setups disagg \
            --router-args="$router_args" --json-out "$OUT/kv_parts_tcp${router_args:+_off}.jsonl" 2>&1 \
            | grep -v "NIXL INFO" | tee "$OUT/kv_parts_tcp${router_args:+_off}.txt" | tail -12
      done ;;
  esac
done
