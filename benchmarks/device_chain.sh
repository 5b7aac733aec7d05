#!/usr/bin/env bash
# Issue 15's device call: train the chain model (one run, <= 10 minutes with its evaluation),
# ship it back as a split tar ($OUT/chain_model.tar.part-*; `cat` the parts, then `tar xf`),
# then score held-out problems at the fixed schedule and threshold 0.9 to see where it landed.
#   MINUTES (default 6.3) training budget;  EVAL_N (default 300) held-out problems
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader | tee "$OUT/env.txt"
python3 -m benchmarks.train_demo --task chain --out /tmp/chain_model --minutes ${MINUTES:-6.3} \
  2>&1 | tr '\r' '\n' | grep -v -i "warn\|it/s\]$" | tee "$OUT/train.log" | tail -4
(cd /tmp && tar cf - chain_model | split -b 15m - "$OUT/chain_model.tar.part-")
sha256sum /tmp/chain_model/* | tee -a "$OUT/train.log"
python3 -m convert /tmp/chain_model /tmp/chain_ck --force --quiet && timeout ${EVAL_S:-140} \
  python3 -m benchmarks.accuracy --checkpoint /tmp/chain_ck --task chain --n ${EVAL_N:-300} \
  --modes fixed,threshold,threshold0.7 --no-plot 2>&1 | grep -v -i warn | tee "$OUT/eval.log" | tail -8
