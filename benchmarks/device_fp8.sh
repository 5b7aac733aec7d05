#!/usr/bin/env bash
# Issue 23's device calls, time-boxed stages whose partial results survive
# (bash benchmarks/device_fp8.sh [all|1|2]; all = 1 then 2):
#   1  environment; build + check the cuBLASLt FFI GEMM, then the GEMMs side by side with
#      cuBLASLt's per-tensor FP8 (fp8_gemm, both operand arrangements; stops
#      here if the check fails); the GPU tests (FP8, cuBLASLt, Flash-Cache kernel); the FFN,
#      its parts and the fused quantisation kernels (fp8_ffn)
#   2  end to end (fp8_e2e): none bf16 against exact + FP8 at prompt 512 and 1024, batch 1
#      (one token per step) and 8 (64 steps: see fp8_e2e's docstring); threshold + dual with
#      and without FP8 at batch 1
# Logs and JSON land in $OUT (at most 8 files come back: keep it so).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v -i "warn" | cut -c1-400; }
case "${1:-all}" in
all|1)
  { nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
  } > "$OUT/env.txt" 2>&1; cut -c1-300 "$OUT/env.txt"
  timeout ${GEMM_S:-200} python3 -m benchmarks.fp8_gemm --ms ${GEMM_MS:-1024,4096} \
    --kernels ${GEMM_KERNELS:-xla_fp8_fast,xla_fp8_precise,cublaslt,cublaslt_swap} \
    2>&1 | tee "$OUT/fp8_gemm.log" | grep -v "^{" | quiet | tail -24
  grep -q "checks pass: True" "$OUT/fp8_gemm.log" || { echo "cuBLASLt check failed: stop"; exit 1; }
  timeout ${TEST_S:-150} python3 -m pytest -q -s -m gpu tests/test_gpu.py tests/test_fp8_kernels.py \
    tests/test_flash_cache.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" \
    | grep -i "^cublaslt\|passed\|failed\|error" | cut -c1-300 | tail -10
  timeout ${FFN_S:-100} python3 -m benchmarks.fp8_ffn --ms 1024,4096 --ablation-layers 0 \
    --quant-tiles 16x1 --quant-ms 1024,4096 2>&1 | tee "$OUT/fp8_ffn.log" \
    | quiet | grep -v "^quant tiles" | tail -4 | cut -c1-330
  [ "${1:-all}" = all ] || exit 0 ;&
2)
  timeout ${E2E_S:-330} python3 -m benchmarks.fp8_e2e --runs "1:512:none:fixed:0,\
1:512:exact:fixed:1,1:1024:none:fixed:0,1:1024:exact:fixed:1,8:512:none:fixed:0:64,\
8:512:exact:fixed:1:64,8:1024:none:fixed:0:64,8:1024:exact:fixed:1:64,1:512:dual:threshold:both" \
    2>&1 | tee "$OUT/fp8_e2e.log" | quiet | grep "^|\|^B=" | tail -24 ;;
esac
