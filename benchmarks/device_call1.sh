#!/usr/bin/env bash
# Device call: FACache kernel on the GPU (tests + kernel benchmark), then the demo model's
# training, conversion and accuracy table. Each stage is time-boxed; logs and JSON in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/env.txt"
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -40
timeout 100 python3 -m benchmarks.cached_attention 2>&1 | grep -v -i warn | tee "$OUT/cached_attention.log" | tail -8
timeout 330 python3 -m benchmarks.train_demo --out "$OUT/demo_model" --minutes ${MINUTES:-4} 2>&1 \
  | grep -v "training:" | tee "$OUT/train_demo.log" | tail -5
python3 -m convert "$OUT/demo_model" /tmp/demo_ck --force --quiet
timeout ${ACC_S:-150} python3 -m benchmarks.accuracy --checkpoint /tmp/demo_ck --n 500 2>&1 \
  | grep -v -i warn | tee "$OUT/accuracy.log" | tail -15
