#!/usr/bin/env bash
# One device call of this session: STAGES (space-separated) picks what runs; logs and JSON go
# to $OUT. Each stage is time-boxed so a slow one cannot lose the others' results.
#   gputests  `pytest -m gpu` (kept as gpu_tests.log)
#   guard     benchmarks.generate: batch 1, every cache mode, fixed, FP8 off/on (one GPU)
#   progress  benchmarks.progress_cost (one GPU)
#   dp        benchmarks.multi_gpu data parallel, batches $DP_BATCH on 1 and 2 GPUs
#   tp        benchmarks.multi_gpu tensor parallel at batch 1, settings $TP
#   dpslots   benchmarks.serve llada: slot refill with the slots over 2 GPUs, then 1 (8 layers)
#   profile   benchmarks.profile_step (weight-sized moves per step in the optimised HLO)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/env.txt"
one() { CUDA_VISIBLE_DEVICES=0 timeout "$@"; }
for stage in ${STAGES:-gputests guard}; do
  echo "=== $stage $(date -u +%T)"
  case $stage in
    gputests) timeout 240 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 \
                | tee "$OUT/gpu_tests.log" | tail -4 ;;
    guard) one 300 python3 -m benchmarks.generate --batch 1 --modes none,exact,prefix,dual \
             --decoding fixed --fp8-ffn both --iters ${ITERS:-2} 2>&1 | tee "$OUT/guard.log" \
             | grep -v -i warn | tail -12 ;;
    progress) one 150 python3 -m benchmarks.progress_cost --iters 3 2>&1 \
                | tee "$OUT/progress.log" | tail -2 ;;
    dp) timeout 330 python3 -m benchmarks.multi_gpu --gpus 1,2 --batch ${DP_BATCH:-32,64,128} \
          --tp none --iters 1 2>&1 | tee "$OUT/dp.log" | grep -v -i warn | tail -8 ;;
    tp) timeout 330 python3 -m benchmarks.multi_gpu --gpus 1,2 --batch none \
          --tp ${TP:-dual,dual+fp8,exact} --iters 2 2>&1 | tee "$OUT/tp.log" \
          | grep -v -i warn | tail -8 ;;
    dpslots) timeout 400 python3 -m benchmarks.serve llada --n 128 --slots 32 --layers 8 \
               --gpus 2,1 2>&1 | tee "$OUT/dpslots.log" | grep -v -i warn | tail -8 ;;
    profile) one 200 python3 -m benchmarks.profile_step 2>&1 | tee "$OUT/profile.log" \
               | tail -6 ;;
  esac
done
echo "=== end $(date -u +%T)"
