#!/usr/bin/env bash
# Issue 23's device call (2026-12-01), time-boxed stages whose partial results survive
# (bash benchmarks/device_fp8.sh [all|1|2]; all = 1 then 2, under 10 minutes):
#   1  environment; build + check the cuBLASLt FFI GEMM, then the GEMMs side by side with
#      cuBLASLt's per-tensor FP8 (fp8_gemm; stops here if the check fails); the FP8 GPU tests;
#      the FFN, its parts and the fused quantisation kernels' tiles (fp8_ffn)
#   2  end to end (fp8_e2e): exact + FP8 vs none at batch 1, prompt 512 (then 1024);
#      threshold + dual with vs without FP8 at batch 1 and 8
# Logs and JSON land in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v -i "warn" | cut -c1-400; }
case "${1:-all}" in
all|1)
  { nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
    which g++ c++ nvcc; ls -d /usr/local/cuda* 2>&1 | head -3
    python3 -c "import nvidia, os; print([os.path.join(p, d) for p in nvidia.__path__ for d in os.listdir(p)])"
  } > "$OUT/env.txt" 2>&1; cut -c1-300 "$OUT/env.txt"
  timeout ${GEMM_S:-200} python3 -m benchmarks.fp8_gemm --ms ${GEMM_MS:-1024,4096,768,256,32} 2>&1 \
    | tee "$OUT/fp8_gemm.log" | grep -v "^{" | quiet | tail -16
  grep -q "checks pass: True" "$OUT/fp8_gemm.log" || { echo "cuBLASLt check failed: stop"; exit 1; }
  timeout ${TEST_S:-100} python3 -m pytest -q -s -m gpu tests/test_gpu.py tests/test_fp8_kernels.py \
    -k "fp8 or cublaslt" -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" \
    | grep -i "^cublaslt\|passed\|failed\|error" | cut -c1-300 | tail -8
  timeout ${FFN_S:-120} python3 -m benchmarks.fp8_ffn --ms 768,1024,4096 --ablation-layers 0 \
    --quant-tiles 16x1,32x4,64x2 --quant-ms 1024,4096 2>&1 | tee "$OUT/fp8_ffn.log" \
    | quiet | grep -v "^quant tiles" | tail -4 | cut -c1-330
  [ "${1:-all}" = all ] || exit 0 ;&
2)
  timeout ${E2E_S:-150} python3 -m benchmarks.fp8_e2e --runs "1:512:none:fixed,1:512:exact:fixed,\
1:512:dual:threshold,8:512:dual:threshold,1:1024:none:fixed,1:1024:exact:fixed" 2>&1 \
    | tee "$OUT/fp8_e2e.log" | quiet | grep "^|" | tail -14 ;;
esac
