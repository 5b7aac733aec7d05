#!/usr/bin/env bash
# Device call: FP8 FFN layer/GEMM/ablation after split-K and the tiled fused RMSNorm, then the
# batch-1 dual-cache step with and without the FP8 FFN.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 -m benchmarks.fp8_ffn --ms 32,256,4096,16384 --ablation-layers 8 2>&1 \
  | grep -v -i warn | cut -c1-900 | tail -12
timeout 75 python3 -m benchmarks.generate --batch 1 --modes dual --decoding fixed \
  --prompt 512 --iters 1 --fp8-ffn both 2>&1 | grep -v -i warn | cut -c1-400 | tail -4
