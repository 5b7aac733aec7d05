#!/usr/bin/env bash
# Next device call (written when this session's device time ran out): compile and time the
# FACache split-key reuse path, the FP8 ablation and M = 16384, all time-boxed.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 \
  | grep -v -i "warn\|^  " | cut -c1-300 | tail -20
timeout 100 python3 -m benchmarks.cached_attention --tiles 64 2>&1 | grep -v -i warn \
  | cut -c1-600 | tail -6
timeout 200 python3 -m benchmarks.fp8_ffn --ms 32,16384 --ablation-layers 8 2>&1 \
  | grep -v -i warn | cut -c1-900 | tail -8
