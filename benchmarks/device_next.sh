#!/usr/bin/env bash
# The next session's device calls (time-boxed stages; partial results survive a timeout):
#   bash benchmarks/device_next.sh 1   GPU tests (the Mosaic GPU FP8 variants written after the
#                                      last GPU run: K groups per step, K splits), their sweep,
#                                      also at the decode shape M 32 (split K, one warpgroup)
#   bash benchmarks/device_next.sh 2   FP8 FFN at M 1024 / 16384, exact vs none at 1024 / 2048,
#                                      demo-model token identity of exact with the split path
# On nvidia-h200-x2 or larger: python3 -m benchmarks.multi_gpu --gpus 1,2 (issue 7).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v -i "warn" | cut -c1-400; }
case "${1:-1}" in
1)
  timeout 150 python3 -m pytest -q -s -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 \
    | grep -i "mgpu\|passed\|failed\|error" | cut -c1-400 | tail -25
  timeout 200 python3 -m benchmarks.fp8_tiles --kernels mgpu --shapes down,gate_up \
    --ms 256,4096 2>&1 | grep "best\|->" | quiet
  timeout 100 python3 -m benchmarks.fp8_tiles --kernels mgpu --shapes down,gate_up --ms 32 \
    2>&1 | grep "best\|->" | quiet
  timeout 80 python3 -m benchmarks.fp8_tiles --kernels mgpu --shapes gate_up --ms 16384 \
    2>&1 | grep "best\|->" | quiet ;;
2)
  timeout 150 python3 -m benchmarks.fp8_ffn --ms 1024,16384 --ablation-layers 0 2>&1 \
    | quiet | tail -4
  timeout 200 python3 -m benchmarks.generate --batch 1 --modes none,exact --decoding fixed \
    --prompt 1024,2048 --iters 1 2>&1 | quiet | tail -8
  python3 -m convert demo_model /tmp/demo_ck --force --quiet && timeout 150 python3 -m \
    benchmarks.accuracy --checkpoint /tmp/demo_ck --n 500 \
    --modes fixed,exact,threshold,threshold+exact 2>&1 | quiet | tail -8 ;;
esac
