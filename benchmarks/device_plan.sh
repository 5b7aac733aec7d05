#!/usr/bin/env bash
# The device calls the GPU-side work left open after the third session of 2026-12-01 needs, in
# priority order, each a time-boxed stage list under 10 minutes (bash benchmarks/device_plan.sh
# N; COMMIT=<sha>):
#   1  issue 15: one chain training round (chain-d2 and chain-d3 side by side, bf16 forward,
#      7 batch workers each; the logs now keep the step rate and progress)
#   2  issues 17, 18: every `-m gpu` test (window attention's rerun at one-ulp bound), then
#      Flash-dLLM at LLaDA-8B shapes: the cache update with a tile sweep (the fused batch-1 step
#      was slower than the unfused one), the verify pass's cost, the batch-32 step, memory
#   3  issues 19, 16, 23: the GSM8K-sized wall time (benchmarks/eval_time.py), the serve
#      benchmark without flash, route (b)'s ptxas spill counts
# Logs and JSON land in $OUT (at most 8 files come back).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v -i "warn" | cut -c1-400; }
case "${1:-1}" in
1)
  VARIANTS=${VARIANTS:-"chain-d2 chain-d3"} bash benchmarks/device_chain.sh ;;
2)
  timeout 60 python3 -m pytest -q -m gpu tests/test_window_attention.py -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu_tests_window.log" | tail -3
  timeout 150 python3 -m pytest -q -m gpu tests -p no:cacheprovider \
    --ignore=tests/test_window_attention.py --ignore=tests/test_fp8_mgpu_ws.py \
    --ignore=tests/test_lm_eval.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
  timeout 150 python3 -m benchmarks.flash --parts update,verify \
    --update-blocks 128:128:8:3,128:64:8:4,64:128:4:3,32:128:4:4 2>&1 \
    | tee "$OUT/flash_update_verify.log" | quiet | tail -8
  timeout 200 python3 -m benchmarks.flash --parts step,memory --batch 32 2>&1 \
    | tee "$OUT/flash_step32.log" | quiet | tail -8 ;;
3)
  timeout 240 python3 -m benchmarks.eval_time 2>&1 | tee "$OUT/eval_time.log" | quiet | tail -4
  timeout 150 python3 -m benchmarks.serve llada --slots 16 --n 48 --gen 256 \
    --answer-range 32 256 --prompt-range 128 512 2>&1 | tee "$OUT/serve.log" | quiet | tail -4
  mkdir -p /tmp/wsdump && MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/wsdump \
    timeout 120 python3 -c "from tests.test_fp8_mgpu_ws import operands; \
from kernels.fp8_matmul_mgpu_ws import fp8_matmul_mgpu_ws as f; \
print(f(*operands(1024, 4096, 24576)).block_until_ready().shape)" 2>&1 | quiet | tail -2
  cat /tmp/wsdump/*.ptxas > "$OUT/ws_ptxas.txt"; grep -i "spill\|stack\|registers" \
    "$OUT/ws_ptxas.txt" | head -8 ;;
esac
