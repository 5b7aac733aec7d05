#!/usr/bin/env bash
# One device call: environment facts, the whole test suite on the GPU (fp32 parity tests at
# full fp32 matmul precision, since XLA's GPU default for fp32 dots is TF32), the `gpu` tests,
# then the benchmarks named in $BENCH (default: forward). Logs and JSON land in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import jax, flax, orbax.checkpoint as o, torch, transformers; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'orbax', o.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
if [ "${TESTS:-1}" = 1 ]; then
  JAX_DEFAULT_MATMUL_PRECISION=highest python3 -m pytest -q -m "gpu or not gpu" tests -x -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -15
fi
for b in ${BENCH:-forward}; do
  python3 -m benchmarks.$b ${BENCH_ARGS:-} 2>&1 | tee "$OUT/$b.log" | grep -v -i warn | tail -20
done
