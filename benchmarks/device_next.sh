#!/usr/bin/env bash
# One device call, time-boxed stages: the FP8 GPU test (Mosaic GPU kernel numerics), end to
# end with and without the FP8 FFN in every cache mode (and exact vs none with the FACache
# split-key path), the FP8 FFN layer table and ablation, exact vs none at prompt 2048.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 70 python3 -m pytest -q -m gpu tests/test_gpu.py -k fp8 -p no:cacheprovider 2>&1 \
  | grep -v -i "warn\|^  " | cut -c1-300 | tail -12
timeout 200 python3 -m benchmarks.generate --batch 1 --modes none,exact,prefix,dual \
  --decoding fixed --prompt 512 --iters 1 --fp8-ffn both 2>&1 | grep -v -i warn \
  | cut -c1-300 | tail -10
timeout 170 python3 -m benchmarks.fp8_ffn --ms 32,256,4096,16384 --ablation-layers 8 2>&1 \
  | grep -v -i warn | cut -c1-700 | tail -9
timeout 75 python3 -m benchmarks.generate --batch 1 --modes none,exact --decoding fixed \
  --prompt 2048 --iters 1 2>&1 | grep -v -i warn | cut -c1-300 | tail -4
