#!/usr/bin/env bash
# The multi-GPU matrix (prefill and decode on GPUs of their own), in device calls of under 10 minutes each.
# Carry .whl/, services/proto_gen/pdserve and build/routing_whl/ as for bench/gpu_serve_run.sh. Parts:
#   bash bench/gpu_multi_run.sh serve2       nvidia-h200-x2: bench/serve.py, dummy Llama-3.1-8B bf16, 1P1D vs two
#                                            colocated replicas vs the planner, at 4 and 10 req/s, standard mix
#   bash bench/gpu_multi_run.sh shifting2    nvidia-h200-x2: the same three on the shifting workload
#   bash bench/gpu_multi_run.sh serve4       nvidia-h200-x4: 1P3D, 2P2D, 3P1D and the planner vs four colocated
#                                            replicas, 4 and 10 req/s
#   bash bench/gpu_multi_run.sh routing2     nvidia-h200-x2: bench/routing.py (prefix-aware vs least-outstanding)
#                                            with real TTFT: a prefill worker per GPU, the decode worker on GPU 0
#   bash bench/gpu_multi_run.sh tp_pulls     nvidia-h200-x2: mixed-TP pulls across the GPUs (heads_outer, P tp1 ->
#                                            D tp2 and P tp2 -> D tp1) against equal TP, 1 GiB
#   bash bench/gpu_multi_run.sh parts32k     nvidia-h200-x2: 32k-token prompts, KV per chunk vs one pull vs two
#                                            colocated replicas, P on GPU 0 and D on GPU 1 (time to the 2nd token)
# LIMIT (seconds per run), RATES (serve2's request rates), PHASE_S (shifting's phase length) and SHIFT_LIMIT
# (shifting2's whole run) may be set to fit a call.
# DRY=1 runs every part on one GPU (every worker on GPU 0, `--gpus 0,0`), small model, few requests, short
# phases: a check that the commands work, not a measurement (its numbers are not recorded).
set -uo pipefail
source bench/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    build/routing_whl/*.whl || exit 1
DRY=${DRY:-}
MODEL=${MODEL:-$([ -n "$DRY" ] && echo dummy:qwen3-0.6b || echo dummy:llama-3.1-8b)}
G2=$([ -n "$DRY" ] && echo 0,0 || echo 0,1)
G4=$([ -n "$DRY" ] && echo 0,0,0,0 || echo 0,1,2,3)
REQS=$([ -n "$DRY" ] && echo 8 || echo 200)
PHASE_S=${PHASE_S:-$([ -n "$DRY" ] && echo 8 || echo 40)}
LIMIT=${LIMIT:-$([ -n "$DRY" ] && echo 150 || echo 280)}
BLOCKS=$([ -n "$DRY" ] && echo 1024 || echo 8192)
SERVE=(python3 bench/serve.py --device cuda --model "$MODEL" --num-kv-blocks "$BLOCKS")
quiet() { grep -v "NIXL INFO\|nixl_cu13"; }
for part in "$@"; do
  case "$part" in
    serve2)
      for rate in ${RATES:-4 10}; do
        timeout -k 10 "$LIMIT" "${SERVE[@]}" --gpus "$G2" --request-rate "$rate" --num-requests "$REQS" \
            --setups disagg,colocated,planner --json-out "$OUT/serve2_r$rate.jsonl" 2>&1 | quiet \
            | tee "$OUT/serve2_r$rate.txt" | tail -8
      done ;;
    shifting2)
      timeout -k 10 "${SHIFT_LIMIT:-$((LIMIT * 2))}" "${SERVE[@]}" --gpus "$G2" --workload shifting \
          --phase-duration-s "$PHASE_S" \
          --setups disagg,colocated,planner --json-out "$OUT/shifting2.jsonl" 2>&1 | quiet \
          | tee "$OUT/shifting2.txt" | tail -8 ;;
    serve4)
      for rate in 4 10; do
        for prefill in 1 2 3; do
          timeout -k 10 "$LIMIT" "${SERVE[@]}" --gpus "$G4" --num-workers 4 --num-prefill "$prefill" \
              --request-rate "$rate" --num-requests "$REQS" --setups disagg \
              --json-out "$OUT/serve4_${prefill}p_r$rate.jsonl" 2>&1 | quiet | tail -4
        done
        timeout -k 10 "$LIMIT" "${SERVE[@]}" --gpus "$G4" --num-workers 4 --request-rate "$rate" \
            --num-requests "$REQS" --setups colocated,planner --json-out "$OUT/serve4_coloc_r$rate.jsonl" 2>&1 \
            | quiet | tail -5
      done ;;
    routing2)
      timeout -k 10 "$LIMIT" python3 bench/routing.py --device cuda --gpus "$G2" --model "$MODEL" --scale gpu \
          --num-prefill 2 --workloads shared-uniform,multi-turn --records --json-out "$OUT/routing2.jsonl" 2>&1 \
          | quiet | tee "$OUT/routing2.txt" | tail -12 ;;
    tp_pulls)
      owner=$([ -n "$DRY" ] && echo cuda:0 || echo cuda:0)
      reader=$([ -n "$DRY" ] && echo cuda:0 || echo cuda:1)
      timeout -k 10 "$LIMIT" python3 bench/transfer.py --device cuda --scenario tp --tp-tokens 8192 \
          --owner-devices "$owner" --reader-devices "$reader" --tp-pairs 1:1,1:2,2:1 --tp-orders HND \
          --tp-layouts heads_outer,cross_layer --repeats 3 --json-out "$OUT/tp_pulls.jsonl" 2>&1 | quiet \
          | tee "$OUT/tp_pulls.txt" | tail -10 ;;
    parts32k)
      tokens=$([ -n "$DRY" ] && echo 8192 || echo 32768)
      for router_args in "" "--no-kv-parts"; do
        setups=$([ -z "$router_args" ] && echo disagg,colocated || echo disagg)
        timeout -k 10 "$LIMIT" "${SERVE[@]}" --gpus "$G2" --mix "$tokens:16" --num-requests 6 --request-rate 0.25 \
            --setups "$setups" --router-args="$router_args" --json-out "$OUT/parts32k${router_args:+_off}.jsonl" \
            2>&1 | quiet | tee "$OUT/parts32k${router_args:+_off}.txt" | tail -8
      done ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
