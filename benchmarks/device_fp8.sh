#!/usr/bin/env bash
# Issue 23's device calls (2026-12-01), time-boxed stages whose partial results survive:
#   bash benchmarks/device_fp8.sh 1   environment; build + check the cuBLASLt FFI GEMM, then the
#                                     GEMMs side by side with cuBLASLt's per-tensor FP8
#                                     (fp8_gemm; stops here if the check fails); the GPU tests;
#                                     the FFN and its fused quantisation kernels (fp8_ffn)
#   bash benchmarks/device_fp8.sh 2   end to end (fp8_e2e): exact + FP8 vs none at batch 1,
#                                     prompt 512 / 1024; threshold + dual with vs without FP8
# Logs and JSON land in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v -i "warn" | cut -c1-400; }
case "${1:-1}" in
1)
  { nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
    which g++ c++ nvcc; ls -d /usr/local/cuda* 2>&1 | head -3
    python3 -c "import nvidia, os; print([os.path.join(p, d) for p in nvidia.__path__ for d in os.listdir(p)])"
  } > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt" | cut -c1-300
  timeout 200 python3 -m benchmarks.fp8_gemm --ms 32,256,768,1024,4096,16384 2>&1 \
    | tee "$OUT/fp8_gemm.log" | grep -v "^{" | quiet | tail -22
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "cuBLASLt check failed: stopping"; exit 1; }
  timeout 150 python3 -m pytest -q -s -m gpu tests/test_gpu.py tests/test_fp8_kernels.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" \
    | grep -i "cublaslt\|passed\|failed\|error" | cut -c1-300 | tail -12
  timeout 170 python3 -m benchmarks.fp8_ffn --ms 768,1024,4096,16384 --ablation-layers 0 \
    --quant-tiles 16x1,32x4,64x2,16x8 --quant-ms 1024,4096 2>&1 | tee "$OUT/fp8_ffn.log" \
    | quiet | tail -14 ;;
2)
  timeout 330 python3 -m benchmarks.fp8_e2e 2>&1 | tee "$OUT/fp8_e2e.log" | quiet | tail -16 ;;
esac
