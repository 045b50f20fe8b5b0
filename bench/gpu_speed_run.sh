#!/usr/bin/env bash
# The GPU-speed matrix in device calls of under 10 minutes each (carry .whl/ and services/proto_gen/pdserve,
# as bench/gpu_run.sh):
#   bash bench/gpu_speed_run.sh kernels   CUDA correctness of the attention backends (kernel vs SDPA, engine
#                                         parity with HF and CUDA graphs) and one layer's attention per backend
#   bash bench/gpu_speed_run.sh engine    dummy Llama-3.1-8B bf16: prefill 512/2k/8k and decode bs 1/8/32 at 2k
#                                         with triton_paged, beside the floors and HF transformers on the same
#                                         weights; then the same engine with torch_sdpa
#   bash bench/gpu_speed_run.sh prefill   the dense prefill path: its CUDA tests (cuDNN against the CPU maths and
#                                         the paged kernel), one layer's prefill attention paged / dense / torch's
#                                         cuDNN SDPA, then the engine's prefill with the dense path on and off
#   bash bench/gpu_speed_run.sh pull      the in-service KV pull beside a raw NIXL READ of the same bytes, 512 to
#                                         32k tokens, contiguous and fragmented pools, with prepared lists and without
#   bash bench/gpu_speed_run.sh staging   KV staging: its tests on CUDA (gather/scatter on the side stream, the READ rows,
#                                         the CUDA digest), then the pull of fragmented pools staged (the default) and
#                                         not (--no-staging), 512 to 32k tokens, beside raw READs of the same bytes;
#                                         and the staging copies alone (bench/staging_copy.py) beside torch's index ops
#   bash bench/gpu_speed_run.sh prefill_graphs  prefill CUDA graphs: their tests on CUDA (captured vs eager, fp32 and
#                                         bf16) with the decode-graph tests, then the engine's prefill at 128/512/2048
#                                         tokens with the graphs on (default) and off (PDSERVE_PREFILL_GRAPH_TOKENS=0)
#   bash bench/gpu_speed_run.sh async     pipelined decode steps: their tests and the CUDA-graph/parity tests on
#                                         CUDA, the e2e serving tests on the GPU, and decode steps pipelined vs sync
#   bash bench/gpu_speed_run.sh digest    the KV digest: its tests on CUDA (the Triton kernel against the host
#                                         arithmetic), the candidates' cost (bench/kv_digest.py) and its cost inside
#                                         the in-service pull (bench/pull_path.py, one GPU)
#   bash bench/gpu_speed_run.sh digest_tcp  the digest inside a pull over UCX's TCP transport (host staging), a
#                                         stand-in for a pull between nodes
#   bash bench/gpu_speed_run.sh decode_fused  the fused K/V write (RoPE of q/k and both cache writes in one launch):
#                                         its CUDA tests, then dummy Llama-3.1-8B bf16 decode bs 1/32 at 2k with
#                                         it on and off (PDSERVE_FUSED_KV_WRITE=1/0, the same engine otherwise)
#   bash bench/gpu_speed_run.sh decode_launches  batch-1 decode's projections and launches: the GEMV's CUDA tests,
#                                         bench/gemv.py (cuBLAS against the GEMV per projection), then the engine
#                                         with everything on, PDL off (PDSERVE_PDL=0) and cuBLAS's projections
#                                         (PDSERVE_DECODE_GEMV=0), alternating twice
#   bash bench/gpu_speed_run.sh decode_rows  decode batches through the tensor-core GEMV (2-32 rows): its CUDA tests,
#                                         bench/gemv.py at 1, 8 and 16 rows (with the tile sweep at 8 and 16)
#   bash bench/gpu_speed_run.sh decode_rows_engine  the engine's decode, bs 1-32, with the GEMVs on and off
#                                         (PDSERVE_DECODE_GEMV=1/0), alternating twice
#   bash bench/gpu_speed_run.sh parts_equal  disaggregated against colocated greedy tokens on the GPU (fp32, 1P1D
#                                         on one GPU, 4096-token prompts: two prefill chunks), KV per chunk and in
#                                         one pull (the router's --no-kv-parts)
#   bash bench/gpu_speed_run.sh mla_moe   DeepSeek's CUDA paths: their CUDA tests and bench/mla_moe.py
#   bash bench/gpu_speed_run.sh profile_families  bench/profile_step.py on both (decode bs 1/32, a 2k prefill)
#   bash bench/gpu_speed_run.sh families  dummy DeepSeek-V2-Lite and Granite-4.0-H-Tiny shapes, bf16: prefill 512/2k
#                                         and decode bs 1/32 at 2k beside floors on the active experts' bytes and FLOPs
#                                         (FAMILY_LIMIT: seconds per model, default 280)
#   bash bench/gpu_speed_run.sh fp8       FP8 checkpoints computed in FP8: their CUDA tests (weights kept, graphs vs
#                                         eager, agreement with bf16, CUDA kernels vs the CPU reference), then
#                                         bench/fp8_engine.py: dummy Llama-3.1-8B bf16 vs its FP8 (128x128 blocks)
#                                         preset, prefill 2k/8k and decode bs 1/8/32 at 2k, floors, greedy agreement
#   bash bench/gpu_speed_run.sh fp8_kernels  the FP8 KV cache's and GEMMs' CUDA tests (kernels against the CPU
#                                         reference), the block GEMM's tile sweep (split-K) at 1 and 8 rows, and the
#                                         KV pull of 2k/8k prompts with FP8 KV beside bf16 KV (bench/pull_path.py)
#   bash bench/gpu_speed_run.sh qwen3_moe  dummy Qwen3-30B-A3B (128 experts, 8 a token), bf16 and its FP8 preset:
#                                         prefill 512/2k and decode bs 1/8/32 at 2k beside floors on the active
#                                         experts' bytes and FLOPs (bench/floors.py); bf16 beside HF transformers
#                                         on the same weights (QWEN3_MOE_LIMIT: seconds for both, default 500)
#   bash bench/gpu_speed_run.sh gpt_oss   the gpt-oss CUDA tests, then dummy gpt-oss-20b: MXFP4 experts kept (beside HF
#                                         transformers) and dequantized at load, prefill 512/2k, decode bs 1/8/32 at 2k
#   bash bench/gpu_speed_run.sh mxfp4_sweep  the MXFP4 grouped GEMM alone beside bf16 grouped_mm per projection of
#                                         gpt-oss-20b/120b, 1-2048 tokens, with the tile sweep (bench/mxfp4_moe.py)
#   bash bench/gpu_speed_run.sh fp8_moe   FP8 routed experts kept as stored: their CUDA tests (the grouped FP8 GEMM
#                                         against the torch reference, a CUDA-graph replay, the sm_90 compile), then
#                                         the GEMM beside bf16 grouped_mm per projection of DeepSeek-V2-Lite and
#                                         Qwen3-30B-A3B, 1/8/32/2048 tokens, with the tile sweep (bench/fp8_moe.py)
#   bash bench/gpu_speed_run.sh moe_fused  the fused MoE layer (ops/moe_fused.py): its CUDA tests (kernels against
#                                         the loop and the torch routers, DeepSeek-V2-Lite shapes against grouped_mm, a
#                                         CUDA-graph replay, the sm_90 compile), DeepSeek's and gpt-oss's CUDA engine
#                                         tests against HF (their experts now fused), then
#                                         bench/moe_fused.py: fused vs grouped_mm vs the weight-read floor, routing alone
#                                         and included, DeepSeek-V2-Lite / Qwen3-30B-A3B / Granite-4.0-H-Tiny experts,
#                                         1/8/32/2048 tokens
#   bash bench/gpu_speed_run.sh moe_fused_sweep  bench/moe_fused.py --sweep: every tile per projection alone at 1, 32
#                                         and 2048 tokens beside config_for's (what to pick it by)
#   bash bench/gpu_speed_run.sh fp8_final  FP8 as shipped: the CUDA tests, bench/fp8_engine.py once, and profiles
#                                         of the FP8 engine's 2k prefill and batch-1 decode step (profiles.tgz)
#   bash bench/gpu_speed_run.sh mamba_decode  Mamba2's fused decode step: its CUDA tests (the kernels against the torch
#                                         step, a CUDA graph, the engine with the kernels and without, the sm_90
#                                         compile), bench/mamba_decode.py (one layer's step, fused vs the torch chain,
#                                         bs 1/8/32 beside the state+weight floor, the tile sweep), then the engine
#                                         on dummy Granite-4.0-H-Tiny shapes, bf16, decode bs 1/8/32 at 2k
#   bash bench/gpu_speed_run.sh mamba_prefill  Mamba2's prefill in Triton (conv + chunked SSD scan): its CUDA tests (the
#                                         kernels against ssd_scan/_chunk, the engine with the kernels and without, the
#                                         sm_90 compile), bench/mamba_prefill.py (one layer's prefill 512/2k/8k, 1 and
#                                         4 requests, Triton vs the torch chain, FLOPs/MFU and the byte floor), then the
#                                         engine on dummy Granite-4.0-H-Tiny shapes, bf16, prefill 512/2k
#   bash bench/gpu_speed_run.sh offload   the host KV tier: its tests on CUDA (pinned memory, copy stream),
#                                         the e2e serving test (decode reading the prefill's host tier into
#                                         VRAM), and TTFT/store/load of an 8k prompt (bench/offload.py)
set -uo pipefail
source bench/gpu_env.sh
for part in "$@"; do
  case "$part" in
    kernels)
      PDSERVE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_attention_backends.py \
          tests/unit/engine/test_cuda_graphs.py tests/unit/engine/test_engine_parity.py 2>&1 | tee "$OUT/kernels_tests.log" | tail -15
      timeout 200 python3 bench/attention.py --json-out "$OUT/attention.jsonl" 2>&1 | tee "$OUT/attention.txt" ;;
    prefill)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_attention_backends.py 2>&1 \
          | tee "$OUT/prefill_tests.log" | tail -8
      timeout 150 python3 bench/attention.py --backends triton_paged,triton_dense,cudnn_sdpa --batches "" --contexts "" \
          --prefills 512,1024,2048,4096,8192 --chunks 2048@6144,2048@2048,2048@1024,4096@4096 --json-out "$OUT/attention_prefill.jsonl" \
          2>&1 | tee "$OUT/attention_prefill.txt" ;;
    prefill_engine)
      for dense in 1024 0; do
        hf=$([ "$dense" = 0 ] && echo --hf)
        PDSERVE_DENSE_MIN_QUERY=$dense timeout 280 python3 bench/engine.py --model dummy:llama-3.1-8b --dtype bfloat16 \
            --device cuda --prefill-lens 512,2048,8192 --batch-sizes 1 --decode-contexts 2048 --decode-steps 8 \
            --rounds 2 $hf --json-out "$OUT/engine_dense$dense.jsonl" 2>&1 | grep -v Warning \
            | tee "$OUT/engine_dense$dense.txt"
      done ;;
    prefill_graphs)
      PDSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_prefill_graphs.py \
          tests/unit/engine/test_cuda_graphs.py 2>&1 | tee "$OUT/prefill_graphs_tests.log" | tail -8
      for tokens in 1024 0; do
        PDSERVE_PREFILL_GRAPH_TOKENS=$tokens timeout 140 python3 bench/engine.py --model dummy:llama-3.1-8b \
            --dtype bfloat16 --device cuda --prefill-lens 128,512,2048 --batch-sizes 1 --decode-contexts 512 \
            --decode-steps 8 --rounds 3 --json-out "$OUT/engine_prefill_graphs$tokens.jsonl" 2>&1 | grep -v Warning \
            | tee "$OUT/engine_prefill_graphs$tokens.txt"
      done ;;
    engine)
      for backend in triton_paged torch_sdpa; do
        hf=$([ "$backend" = triton_paged ] && echo --hf)
        timeout 280 python3 bench/engine.py --model dummy:llama-3.1-8b --dtype bfloat16 --device cuda \
            --attention-backend "$backend" --prefill-lens 512,2048,8192 --batch-sizes 1,8,32 --decode-contexts 2048 \
            --decode-steps 16 --rounds 2 $hf --json-out "$OUT/engine_$backend.jsonl" 2>&1 \
            | grep -v Warning | tee "$OUT/engine_$backend.txt"
      done ;;
    mla_moe)  # DeepSeek's CUDA paths (triton_mla, grouped experts): their CUDA tests, then bench/mla_moe.py, the
              # measurement they were chosen by (loop vs grouped experts, torch_mla vs triton_mla, a tile sweep)
      PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_mla_moe_kernels.py \
          "tests/unit/engine/test_attention_backends.py::test_triton_matches_sdpa" 2>&1 | tee "$OUT/mla_moe_tests.log" | tail -15
      timeout 200 python3 bench/mla_moe.py --json-out "$OUT/mla_moe.jsonl" 2>&1 | tee "$OUT/mla_moe.txt" | tail -32 ;;
    profile_families)  # where DeepSeek-V2-Lite's and Granite-4.0-H-Tiny's decode and prefill steps spend their time
      for model in deepseek-v2-lite granite-4.0-h-tiny-shape; do
        IFS=, read -ra steps <<< "${PROFILES:---batch 1,--batch 32,--prefill 2048}"  # PROFILES: comma-separated
        for what in "${steps[@]}"; do
          name=prof_${model}_$(echo "$what" | tr -d ' -')
          # shellcheck disable=SC2086  # $what is flags
          timeout 120 python3 bench/profile_step.py --model "dummy:$model" $what > "$OUT/$name.txt" 2>&1
          echo "== $model $what: $(grep -c . "$OUT/$name.txt") lines"
        done
      done
      tar czf "$OUT/profiles.tgz" -C "$OUT" $(cd "$OUT" && ls prof_*.txt) && rm -f "$OUT"/prof_*.txt ;;
    families)  # DeepSeek-V2-Lite (MLA + MoE) and Granite-4.0-H-Tiny (Mamba2 + attention + MoE) shapes, bf16, the
               # engine's default paths, against floors of the bytes and FLOPs they use (bench/floors.py)
      for model in deepseek-v2-lite granite-4.0-h-tiny-shape; do
        timeout "${FAMILY_LIMIT:-280}" python3 bench/engine.py --model "dummy:$model" --dtype bfloat16 --device cuda \
            --prefill-lens 512,2048 --batch-sizes 1,32 --decode-contexts 2048 --decode-steps 8 --rounds 2 \
            --json-out "$OUT/engine_$model.jsonl" 2>&1 | grep -v Warning | tee "$OUT/engine_$model.txt"
      done ;;
    mamba_decode)  # the Mamba2 decode kernels (ops/mamba_decode_triton.py): correctness, one layer, then the engine
      PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_mamba_decode_kernel.py \
          2>&1 | tee "$OUT/mamba_decode_tests.log" | tail -8
      timeout 150 python3 bench/mamba_decode.py --json-out "$OUT/mamba_decode.jsonl" 2>&1 | tee "$OUT/mamba_decode.txt" \
          | tail -12
      timeout "${FAMILY_LIMIT:-280}" python3 bench/engine.py --model dummy:granite-4.0-h-tiny-shape --dtype bfloat16 \
          --device cuda --prefill-lens 512 --batch-sizes 1,8,32 --decode-contexts 2048 --decode-steps 8 --rounds 2 \
          --json-out "$OUT/engine_granite_mamba_decode.jsonl" 2>&1 | grep -v Warning \
          | tee "$OUT/engine_granite_mamba_decode.txt" ;;
    mamba_prefill)  # the Mamba2 prefill kernels (ops/ssd_scan_triton.py): correctness, one layer, then the engine
      PDSERVE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_ssd_scan_kernel.py \
          2>&1 | tee "$OUT/mamba_prefill_tests.log" | tail -8
      timeout 200 python3 bench/mamba_prefill.py --json-out "$OUT/mamba_prefill.jsonl" 2>&1 | tee "$OUT/mamba_prefill.txt" \
          | tail -10
      timeout "${FAMILY_LIMIT:-280}" python3 bench/engine.py --model dummy:granite-4.0-h-tiny-shape --dtype bfloat16 \
          --device cuda --prefill-lens 512,2048 --batch-sizes 1 --decode-contexts 2048 --decode-steps 8 --rounds 2 \
          --json-out "$OUT/engine_granite_mamba_prefill.jsonl" 2>&1 | grep -v Warning \
          | tee "$OUT/engine_granite_mamba_prefill.txt" ;;
    decode_fused)  # the K/V write fused with RoPE (1) against RoPE then two index_put scatters (0)
      PDSERVE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_fused_kv_write.py \
          tests/unit/engine/test_fused_ops.py tests/unit/engine/test_cuda_graphs.py 2>&1 | tee "$OUT/decode_fused_tests.log" \
          | tail -8
      for fused in 1 0; do
        PDSERVE_FUSED_KV_WRITE=$fused timeout 130 python3 bench/engine.py --model dummy:llama-3.1-8b --dtype bfloat16 \
            --device cuda --prefill-lens 512 --batch-sizes 1,32 --decode-contexts 2048 --decode-steps 32 --rounds 2 \
            --json-out "$OUT/engine_kv_write$fused.jsonl" 2>&1 | grep -v Warning | tee "$OUT/engine_kv_write$fused.txt"
      done ;;
    decode_launches)  # batch-1 projections through the Triton GEMV, and programmatic dependent launch, on and off
      PDSERVE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_gemv.py \
          tests/unit/engine/test_engine_parity.py 2>&1 | tee "$OUT/decode_launches_tests.log" | tail -4
      python3 bench/gemv.py --json-out "$OUT/gemv.jsonl" 2>&1 | tee "$OUT/gemv.txt" | tail -8
      for round in 1 2; do
        for switches in "" "PDSERVE_PDL=0" "PDSERVE_DECODE_GEMV=0 PDSERVE_PDL=0"; do
          echo "== round $round: ${switches:-all on}"
          env $switches timeout 100 python3 bench/engine.py --model dummy:llama-3.1-8b --dtype bfloat16 --device cuda \
              --prefill-lens 512 --batch-sizes 1,8,32 --decode-contexts 2048 --decode-steps 32 --rounds 2 2>&1 \
              | grep -A4 "graph ms"
        done
      done | tee "$OUT/decode_launches.txt" ;;
    decode_rows)  # several rows through the tensor-core GEMV against cuBLAS
      PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_gemv.py \
          tests/unit/engine/test_engine_parity.py tests/unit/engine/test_cuda_graphs.py 2>&1 \
          | tee "$OUT/decode_rows_tests.log" | tail -4
      timeout 300 python3 bench/gemv.py --rows 1,8,16 --sweep-rows 8,16 --json-out "$OUT/gemv_rows.jsonl" 2>&1 \
          | tee "$OUT/gemv_rows.txt" | grep -v "^{" ;;
    decode_rows_engine)
      timeout 100 python3 bench/gemv.py --rows 8,16 --json-out "$OUT/gemv_rows_default.jsonl" 2>&1 | grep "^|"
      for round in 1 2; do
        for gemv in 1 0; do
          echo "== round $round: PDSERVE_DECODE_GEMV=$gemv"
          PDSERVE_DECODE_GEMV=$gemv timeout 100 python3 bench/engine.py --model dummy:llama-3.1-8b --dtype bfloat16 \
              --device cuda --prefill-lens 512 --batch-sizes 1,4,8,16,32 --decode-contexts 2048 --decode-steps 32 \
              --rounds 2 2>&1 | grep -A6 "graph ms"
        done
      done | tee "$OUT/decode_rows.txt" ;;
    parts_equal)  # greedy equality, disaggregated against colocated, KV per chunk and in one pull
      for parts in "" --no-kv-parts; do
        timeout 200 python3 bench/tp_serving.py --setups "1@cuda:0/1@cuda:0" --num-requests 8 --prompt-len 4096 \
            --max-tokens 16 --num-kv-blocks 2048 $parts 2>&1 | tail -3
      done | tee "$OUT/parts_equal.txt" ;;
    fp8)  # within 540 s: two small engines per test, then each 8B engine loaded once
      PDSERVE_TEST_DEVICE=cuda timeout 180 python3 -m pytest -q -s -p no:cacheprovider \
          tests/unit/engine/test_fp8_compute_cuda.py 2>&1 | tee "$OUT/fp8_compute_tests.log" | grep -v Warning | tail -12
      timeout 340 python3 bench/fp8_engine.py --json-out "$OUT/fp8_engine.jsonl" 2>&1 | grep -v Warning \
          | tee "$OUT/fp8_engine.txt" ;;
    fp8_kernels)
      PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_fp8_kv_kernels.py \
          tests/unit/engine/test_fp8_gemm.py 2>&1 | tee "$OUT/fp8_kernels_tests.log" \
          | grep -v Warning | tail -12
      timeout 170 python3 bench/fp8_gemm.py --rows 1,8 --sweep --sweep-rows 1,8 --json-out "$OUT/fp8_gemm_splitk.jsonl" \
          2>&1 | tee "$OUT/fp8_gemm_splitk.txt" | grep -v "^{" | tail -40
      timeout 170 python3 bench/pull_path.py --device cuda --tokens 2048,8192 --pools contiguous,fragmented --repeats 5 \
          --kv-dtypes bfloat16,float8_e4m3fn --json-out "$OUT/pull_path_fp8.jsonl" 2>&1 | grep -v "NIXL INFO" \
          | tee "$OUT/pull_path_fp8.txt" | tail -8 ;;
    qwen3_moe)  # bf16 with HF transformers on the same weights (--hf: HF's model is built, timed and freed
                # before the engine's, one process; ~61 GB each), then the FP8 preset without HF (its experts are
                # dequantized at load; HF would only run the bf16 network again). QWEN3_MOE_LIMIT: seconds for
                # both (default 500); the FP8 run gets what the bf16 run (at most 300 s) leaves.
      start=$SECONDS
      for model in qwen3-30b-a3b qwen3-30b-a3b-fp8; do
        hf=$([ "$model" = qwen3-30b-a3b ] && echo --hf)
        left=$(( ${QWEN3_MOE_LIMIT:-500} - (SECONDS - start) ))
        limit=$([ -n "$hf" ] && [ "$left" -gt 300 ] && echo 300 || echo "$left")
        [ "$limit" -lt 30 ] && { echo "== $model: skipped, $limit s left"; continue; }  # (timeout 0: no limit)
        echo "== $model: timeout $limit s"
        timeout "$limit" python3 bench/engine.py --model "dummy:$model" --dtype bfloat16 --device cuda \
            --prefill-lens 512,2048 --batch-sizes 1,8,32 --decode-contexts 2048 --decode-steps 8 --rounds 2 \
            $hf --json-out "$OUT/engine_$model.jsonl" 2>&1 | grep -v Warning | tee "$OUT/engine_$model.txt"
        echo "== $model: rc ${PIPESTATUS[0]} after $(( SECONDS - start )) s"
      done ;;
    mxfp4_sweep)
      timeout 200 python3 bench/mxfp4_moe.py --sweep --samples 9 --json-out "$OUT/mxfp4_sweep.jsonl" 2>"$OUT/mxfp4_sweep.err" \
          | tee "$OUT/mxfp4_sweep.txt" ;;
    fp8_moe)  # the CUDA tests of the FP8 grouped GEMM, then it beside bf16 grouped_mm on the same experts, in one run
      PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_fp8_moe.py \
          2>&1 | tee "$OUT/fp8_moe_tests.log" | tail -8
      timeout 300 python3 bench/fp8_moe.py --sweep --samples 9 --json-out "$OUT/fp8_moe.jsonl" 2>"$OUT/fp8_moe.err" \
          | tee "$OUT/fp8_moe.txt" ;;
    gpt_oss)  # the CUDA tests (sinks in the Triton kernels, the MXFP4 grouped GEMM, the engine against HF), then
              # dummy gpt-oss-20b with its MXFP4 experts kept (--quantization auto) beside HF transformers on the
              # same (unquantized) weights, and dequantized at load (--quantization none): the A/B of the kernel
      PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_mxfp4_moe.py \
          tests/unit/engine/test_gpt_oss.py tests/unit/engine/test_attention_backends.py -k "cuda or sinks or kernel" \
          2>&1 | tee "$OUT/gpt_oss_tests.log" | tail -8
      for quant in auto none; do
        hf=$([ "$quant" = auto ] && echo --hf)
        timeout 220 python3 bench/engine.py --model dummy:gpt-oss-20b --dtype bfloat16 --device cuda --quantization "$quant" \
            --prefill-lens 512,2048 --batch-sizes 1,8,32 --decode-contexts 2048 --decode-steps 8 --rounds 2 \
            $hf --json-out "$OUT/engine_gpt_oss_$quant.jsonl" 2>&1 | grep -v Warning | tee "$OUT/engine_gpt_oss_$quant.txt"
      done ;;
    moe_fused)  # the fused MoE layer: correctness on CUDA (its tests, then the MoE models' CUDA tests, which now take
                # it), then one run of fused vs grouped_mm vs the floor (the table: the last lines of moe_fused.txt);
                # the timeouts sum to 570 s, under one device call's 10 minutes
      PDSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_moe_fused.py \
          2>&1 | tee "$OUT/moe_fused_tests.log" | tail -8
      PDSERVE_TEST_DEVICE=cuda timeout 180 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_mla_moe_kernels.py \
          "tests/unit/engine/test_gpt_oss.py::test_cuda_engine_matches_hf" 2>&1 | tee "$OUT/moe_fused_model_tests.log" | tail -8
      timeout 240 python3 bench/moe_fused.py --samples 9 --json-out "$OUT/moe_fused.jsonl" 2>"$OUT/moe_fused.err" \
          | tee "$OUT/moe_fused.txt" ;;
    moe_fused_sweep)  # the fused MoE GEMM's tiles per projection (rows as they come, in moe_fused_sweep.err)
      timeout 290 python3 bench/moe_fused.py --sweep --tokens 1,32,2048 --samples 5 \
          --json-out "$OUT/moe_fused_sweep.jsonl" 2>"$OUT/moe_fused_sweep.err" | tee "$OUT/moe_fused_sweep.txt" ;;
    fp8_final)
      PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/unit/engine/test_fp8_compute_cuda.py \
          tests/unit/engine/test_fp8_gemm.py tests/unit/engine/test_fp8_kv_kernels.py 2>&1 | tee "$OUT/fp8_final_tests.log" \
          | grep -E "equal|FAILED|passed|failed" | tail -12
      timeout 150 python3 bench/fp8_engine.py --json-out "$OUT/fp8_engine_final.jsonl" 2>&1 | grep -v Warning \
          | tee "$OUT/fp8_engine_final.txt"
      PDSERVE_PDL=0 timeout 100 python3 bench/profile_step.py --model dummy:llama-3.1-8b-fp8 --prefill 2048 \
          > "$OUT/prof_fp8_prefill.txt" 2>&1
      PDSERVE_PDL=0 timeout 100 python3 bench/profile_step.py --model dummy:llama-3.1-8b-fp8 --batch 1 --context 2048 \
          > "$OUT/prof_fp8_decode.txt" 2>&1
      tar czf "$OUT/profiles.tgz" -C "$OUT" prof_fp8_prefill.txt prof_fp8_decode.txt \
          && rm -f "$OUT"/prof_fp8_*.txt ;;
    offload)
      PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_kv_offload.py \
          2>&1 | tee "$OUT/offload_tests.log" | tail -8
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_kv_offload_serving.py 2>&1 \
          | tee "$OUT/offload_e2e.log" | tail -8
      for factor in 4 1; do
        timeout 200 python3 bench/offload.py --model dummy:llama-3.1-8b --dtype bfloat16 --prompt-len 8192 \
            --offload-gib 8 --factor "$factor" --rounds 3 --json-out "$OUT/offload_f$factor.jsonl" 2>&1 \
            | grep -v Warning | tee "$OUT/offload_f$factor.txt"
      done ;;
    async)
      PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_async_scheduling.py \
          tests/unit/engine/test_cuda_graphs.py tests/unit/engine/test_engine_parity.py 2>&1 | tee "$OUT/async_tests.log" | tail -8
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_serving.py 2>&1 | tee "$OUT/serving_e2e.log" \
          | tail -8
      timeout 250 python3 bench/engine.py --model dummy:llama-3.1-8b --dtype bfloat16 --device cuda --prefill-lens 512 \
          --batch-sizes 1,8,32 --decode-contexts 2048 --decode-steps 32 --rounds 2 --json-out "$OUT/engine_async.jsonl" \
          2>&1 | grep -v Warning | tee "$OUT/engine_async.txt" ;;
    digest)
      PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/kv/test_kv_digest.py \
          2>&1 | tee "$OUT/digest_tests.log" | tail -8
      timeout 120 python3 bench/kv_digest.py --device cuda --tokens 2048,8192 --json-out "$OUT/kv_digest_gpu.jsonl" \
          2>&1 | tee "$OUT/kv_digest_gpu.txt"
      timeout 240 python3 bench/pull_path.py --device cuda --tokens 2048,8192 --repeats 7 \
          --json-out "$OUT/pull_path_digest_gpu.jsonl" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/pull_path_digest.txt" ;;
    digest_tcp)  # the same pull over UCX's TCP transport with host staging: a stand-in for a link between nodes
      UCX_TLS=tcp,cuda_copy timeout 200 python3 bench/pull_path.py --device cuda --tokens 2048,8192 --pools contiguous \
          --repeats 3 --json-out "$OUT/pull_path_digest_tcp.jsonl" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/pull_path_digest_tcp.txt" ;;
    staging)
      PDSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/kv/test_kv_staging.py \
          tests/unit/kv/test_kv_digest.py tests/integration/test_kv_staging.py 2>&1 | tee "$OUT/staging_tests.log" | tail -6
      timeout 100 python3 bench/staging_copy.py --device cuda --tokens 512,2048,8192,32768 \
          --json-out "$OUT/staging_copy.jsonl" 2>&1 | tee "$OUT/staging_copy.txt"
      for staging in "" --no-staging; do
        timeout 200 python3 bench/pull_path.py --placements cuda:0/cuda:0 --tokens 512,2048,8192,32768 \
            --pools contiguous,fragmented $staging --json-out "$OUT/pull_path_gpu${staging:+_unstaged}.jsonl" 2>&1 \
            | grep -v "NIXL INFO" | tee "$OUT/pull_path${staging:+_unstaged}.txt"
      done ;;
    pull)  # prepared descriptor lists (the default) and, for the A/B, every pull planned from scratch
      for lists in "" --no-prepared-lists; do
        timeout 200 python3 bench/pull_path.py --placements auto --tokens 512,2048,8192,32768 \
            --pools contiguous,fragmented $lists --json-out "$OUT/pull_path_gpu${lists:+_unprepared}.jsonl" 2>&1 \
            | grep -v "NIXL INFO" | tee "$OUT/pull_path${lists:+_unprepared}.txt"
      done ;;
  esac
done
