#!/usr/bin/env bash
# One device call, time-boxed stages: the GPU tests, the FACache kernel benchmark (with the
# split-key reuse path), the FP8 GEMM tile sweep. Partial results survive a stage's timeout.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 \
  | grep -v -i "warn\|^  " | cut -c1-300 | tail -20
timeout 100 python3 -m benchmarks.cached_attention --tiles 64 2>&1 | grep -v -i warn \
  | cut -c1-600 | tail -6
timeout 260 python3 -m benchmarks.fp8_tiles ${TILES_ARGS:-} 2>&1 | grep -v -i warn \
  | grep "best\|->\|error" | cut -c1-400
