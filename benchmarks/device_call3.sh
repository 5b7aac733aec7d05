#!/usr/bin/env bash
# Device call: GPU tests (FACache + FP8 kernels), FACache kernel times with chained calls,
# FP8 FFN layer/GEMM/ablation, end-to-end generate with and without the FP8 FFN.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -x 2>&1 \
  | grep -v -i "warn\|^  " | cut -c1-300 | tail -25
timeout 80 python3 -m benchmarks.cached_attention 2>&1 | grep -v -i warn | cut -c1-400 | tail -6
timeout 150 python3 -m benchmarks.fp8_ffn 2>&1 | grep -v -i warn | cut -c1-700 | tail -12
timeout 130 python3 -m benchmarks.generate --batch 1 --modes none,prefix,dual --decoding fixed \
  --prompt 512 --iters 1 --fp8-ffn both 2>&1 | grep -v -i warn | cut -c1-400 | tail -9
