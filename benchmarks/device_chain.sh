#!/usr/bin/env bash
# Issue 15's device call: train the chain model (<= 10 minutes with its evaluation) and bring
# it back as a split tar ($OUT/chain_model.tar.part-*: `cat` the parts, then `tar xf`).
# VARIANTS (default: one run of `chain`) are task names trained side by side on the one GPU
# (each gets a third of the memory), each scored on EVAL_N held-out problems at the fixed
# schedule and threshold 0.9; the one whose fixed accuracy lies in [0.85, 0.98] (nearest the
# middle; else nearest the range) comes back. MINUTES: each run's training budget. WORKERS:
# batch-building processes per run (default: 14 of the 16 cores shared among the runs; a
# chain batch takes 0.13 s of Python, a bf16 step far less). The logs keep the measured step
# rate and a progress line every 30 s, so a run cut off by its box still shows how far it got.
# INIT (an earlier run's HF directory, carried in; one variant, its task): go on training that
# model (`train_demo --init`) with SEED (default 1: batches the first run did not see) and LR
# (default: the task's) over a fresh schedule.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader | tee "$OUT/env.txt"
VARIANTS=${VARIANTS:-chain}
n=$(wc -w <<< "$VARIANTS")
[ -z "${INIT:-}" ] || [ "$n" = 1 ] || { echo "INIT goes on training one variant" >&2; exit 2; }
for v in $VARIANTS; do
  XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / $n, 2))") timeout 570 \
    python3 -m benchmarks.train_demo --task "$v" --out "/tmp/$v" --minutes ${MINUTES:-6.3} \
    --workers ${WORKERS:-$((14 / n))} --eval ${EVAL_N:-300} \
    ${INIT:+--init "$INIT" --seed "${SEED:-1}"} ${LR:+--lr "$LR"} 2>&1 | tr '\r' '\n' \
    | grep -v -i "warn" > "$OUT/train-$v.log" &
done
wait
tail -n 4 "$OUT"/train-*.log
best=$(python3 - $VARIANTS <<'PY'
import re, sys, os
out = os.environ.get("OUT", "/tmp/out")
def score(v):
    text = open(f"{out}/train-{v}.log").read()
    m = re.search(r"held-out fixed: accuracy ([\d.]+)", text)
    if not m or not os.path.exists(f"/tmp/{v}/model.safetensors"):
        return None
    a = float(m.group(1))
    return abs(a - 0.915) if 0.85 <= a <= 0.98 else 1 + min(abs(a - 0.85), abs(a - 0.98))
scores = {v: s for v in sys.argv[1:] if (s := score(v)) is not None}
print(min(scores, key=scores.get) if scores else "")
PY
)
echo "chosen: ${best:-none}" | tee "$OUT/chosen.txt"
[ -n "$best" ] || exit 1
sha256sum "/tmp/$best"/* | tee -a "$OUT/chosen.txt"
(cd /tmp && tar cf - "$best" | split -b 15m - "$OUT/chain_model.tar.part-")
