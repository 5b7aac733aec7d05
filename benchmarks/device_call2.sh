#!/usr/bin/env bash
# Device call: the demo model's accuracy table, the FACache kernel on the GPU (tests +
# kernel benchmark), end-to-end exact vs none on LLaDA-8B shapes. Logs and JSON in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m convert demo_model /tmp/demo_ck --force --quiet
timeout 150 python3 -m benchmarks.accuracy --checkpoint /tmp/demo_ck --n 500 2>&1 \
  | grep -v -i warn | tee "$OUT/accuracy.log" | tail -14
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 \
  | cut -c1-300 | tee "$OUT/gpu_tests.log" | tail -30
timeout 100 python3 -m benchmarks.cached_attention 2>&1 | grep -v -i warn | cut -c1-400 \
  | tee "$OUT/cached_attention.log" | tail -8
# Random weights reveal one token per step under threshold decoding too (same work as fixed),
# so threshold runs at one prompt length only.
timeout 290 python3 -m benchmarks.generate --batch 1 --modes none,exact --decoding fixed \
  --prompt 512,1024,2048 --iters 1 2>&1 | grep -v -i warn | cut -c1-400 \
  | tee "$OUT/generate_fixed.log" | tail -9
timeout 80 python3 -m benchmarks.generate --batch 1 --modes none,exact --decoding threshold \
  --prompt 512 --iters 1 2>&1 | grep -v -i warn | cut -c1-400 \
  | tee "$OUT/generate_threshold.log" | tail -5
