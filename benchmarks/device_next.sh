#!/usr/bin/env bash
# Device calls of 2026-11-30 (time-boxed stages; partial results survive a timeout):
#   bash benchmarks/device_next.sh 1   GPU tests, then issue 5's FP8 numbers with the
#                                      shape-dependent Mosaic GPU pipeline (mgpu_config): FFN
#                                      at every M, prefix and dual generate bf16 vs FP8
#   bash benchmarks/device_next.sh 2   GPU tests, exact vs none at prompt 1024 / 2048,
#                                      demo-model token identity of exact with the split path
#                                      (issue 4's repeat)
#   bash benchmarks/device_next.sh 3   FP8 GEMM: GPU test, persistent CTAs vs one per tile
#   bash benchmarks/device_next.sh 4   FP8 FFN from M 256 with the persistent dispatch
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v -i "warn" | cut -c1-400; }
case "${1:-1}" in
1)
  timeout 120 python3 -m pytest -q -s -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 \
    | grep -i "mgpu\|passed\|failed\|error" | cut -c1-400 | tail -25
  timeout 250 python3 -m benchmarks.fp8_ffn --ms 32,256,1024,4096,16384 --ablation-layers 0 \
    2>&1 | quiet | tail -7
  timeout 180 python3 -m benchmarks.generate --batch 1 --modes prefix,dual --decoding fixed \
    --prompt 512 --iters 1 --fp8-ffn both 2>&1 | quiet | tail -8 ;;
2)
  timeout 120 python3 -m pytest -q -s -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 \
    | grep -i "mgpu\|passed\|failed\|error" | cut -c1-400 | tail -25
  timeout 200 python3 -m benchmarks.generate --batch 1 --modes none,exact --decoding fixed \
    --prompt 1024,2048 --iters 1 2>&1 | quiet | tail -8
  python3 -m convert demo_model /tmp/demo_ck --force --quiet && timeout 150 python3 -m \
    benchmarks.accuracy --checkpoint /tmp/demo_ck --n 500 \
    --modes fixed,exact,threshold,threshold+exact 2>&1 | quiet | tail -8 ;;
3)
  timeout 100 python3 -m pytest -q -s -m gpu tests/test_gpu.py -k fp8_kernels_on_gpu \
    -p no:cacheprovider 2>&1 | grep -i "mgpu\|passed\|failed\|error" | cut -c1-300 | tail -20
  timeout 240 python3 -m benchmarks.fp8_tiles --kernels mgpu --persistent --shapes down,gate_up \
    --ms 256,4096 2>&1 | quiet | grep "'ms'\|best\|->\|rror" | cut -c1-260 ;;
4)
  timeout 250 python3 -m benchmarks.fp8_ffn --ms 256,1024,4096,16384 --ablation-layers 0 \
    2>&1 | quiet | tail -6 ;;
esac
