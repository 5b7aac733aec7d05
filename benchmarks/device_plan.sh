#!/usr/bin/env bash
# The device calls the GPU-side work left open after the twenty-seventh session of 2026-12-05
# needs (bash benchmarks/device_plan.sh N; COMMIT=<sha>, or the JSON carry the device
# checkout's stale HEAD), each a time-boxed stage list under 10 minutes. Done in the
# twenty-seventh: 31, 32, 29 and the four-shape end to end (RESULTS.md); the twenty-fifth,
# twenty-sixth and twenty-eighth were lent no device (the twenty-eighth's one call, stage 33,
# found no machine to start). Done in the twenty-ninth, on an H100: 33, 35, 22 (all 47); in
# the thirtieth, on an H200: 37, 36 (the FP8 GEMMs' rates at the power limit); the
# thirty-first was lent none (one failed start, then loans paused); the thirty-second, on an
# H100 after four failed starts: 41, 42, 43 (each new kernel slower in the step: all stay off)
# and 22 (all 50 GPU tests pass at 529a41c); the thirty-third, on an H100 after two hours of
# failed starts: 45 (persistent programs and prefetch both slower: off) and 44 (no PTX in
# jax 0.11.2's XLA dump: stage 44 needs another source before it runs again); the
# thirty-fourth, on an H200 at the first try: 49, 47, 48 (wgmma FP8 dots and scales loaded
# ahead: the step's time unchanged, both stay off; the FFN's 120 s boxes timed one setting of
# four: ffn_settings needs about 60 s a setting), 21 at four more tilings (slower), 39 (the
# heuristic's configuration the fastest), 33 (padded once 1.04x) and 38; the thirty-fifth, on
# an H100 at the first try: 51 (the fused SwiGLU epilogue faster at 4,608 rows: on from there;
# its ptxas dump came back empty), 52, 22 (all 56 GPU tests pass at f80c6fe), batch 8's step
# traced at 6,144 rows and the FFN at 1,536 / 3,072 rows (the budget ended before the kernel
# on: the crossing below 4,608 rows is untimed); the thirty-sixth, on an H100 at the first
# try: 54 (no knob faster at both row counts), 53 (the fused epilogue faster at 768 rows: on
# from there), the four-shape end to end, 29, 50 (one key share at batch 8: 2% faster, on), 34
# (rows padded once 6% faster at 756 rows); the thirty-seventh, on an H100 at the first try:
# 55 (the wave-filling tile slower in the step: off), 22 (61 of 62 pass: one check too
# broad, narrowed), then four failed starts; the thirty-eighth, on an H100 after five: 56
# (stored scales slower in the step: off; the narrowed test passes), the attention mask probe
# and the unmasked step; the thirty-ninth, on an H100 at the first try: 57, 22 (all 65 pass
# at 916cfa3), 58 and 59 (no SwiGLU pairs below 4,608 rows: faster, on) (RESULTS.md).
# Done in the twenty-fourth: 30, 29, 22 (all 44 GPU tests at 6f5d600); in the
# twenty-third: 27, 25, 26 at M 32, 28; in the twenty-second: 25, 26 at M 768
# and 1280, 23 with split K; in the twenty-first: 23 without split-K; in the twentieth: 21 and
# 22; in the nineteenth: 21 at its earlier form; in the eighteenth: 20 and stage 14's GPU test.
# Done in the fortieth: 61 (its prefix FP8 rows untimed); in the forty-second, on an H100: 22
# (all 65 GPU tests pass at 9b30afb) and 62's batch 1 with the cut on; in the forty-third, on
# an H100 after about 960 s of failed starts: the Mosaic GPU kernels' GPU tests at jax 0.11's
# API (25 pass) and 60 (no pairs at 4,608 rows either: never); in the forty-fourth, on an
# H100 after about 480 s: 63 (1,536 and 2,048 rows without device time: 65), the SwiGLU
# sweep at 768 rows (3 stages restarted: 64), 22's PART 2 and the Mosaic GPU tests in part
# (48 of 53 ran before their boxes ended, none failed); in the forty-fifth, on an H100 at the
# first try: 66 (the split last wave level in the step: off), 64 (3 restarted stages faster
# at 768 rows), 65, 67 (and at 1,536: on below 4,608 rows) and batch 1's headline at P 512;
# in the forty-sixth, on an H100 after about 460 s: 69 (the split last wave in half tiles
# faster: on), 68 (run with `timeout 285`: the FFN and the headline both came back), the FP8
# kernels' GPU tests with the tail on, the tail alternated at P 1,024; in the forty-seventh,
# on an H100 after about 650 s: 70 (no saving goes missing within one run), 71 (whole-row
# RMSNorm at 768 rows: the step unchanged, off), 22's PART 2 in part (13 passed, none failed);
# in the forty-eighth, on an H100 after about 1,350 s: 73 (the residual add in the FFN's
# RMSNorm kernel correct and no faster: removed by 042c19d; 72 and 73 run at 4d8c803); the
# forty-ninth, on an H100 after about 830 s: 22 (all 62 GPU tests pass at 1714255) and batch
# 1's headline at P 512 and 1,024 (1.287x, 1.282x).
# the fiftieth, on an H100 after about 700 s: 74 (swap's GPU test, then its sweep: faster
# than the Triton tiles at 32 rows) and 75 (the FFN and the dual step faster with it: on to
# 32 rows).
# Left, in priority order: 22 (all GPU tests with swap on at 32 rows; its own and the scales
# test passed), 76 (swap's w scales as one row a CTA: built after the fiftieth's calls), 62
# (the flash step with the last layer on the window's rows), 25 with PROMPT=1024 (batch 1's
# exact + FP8 step's kernels where its 1.3x is furthest), 26 at M 6144 (batch 8's tiles) and
# at M 768 with whole rows over 8 warps (QUANT_MS=768
# QUANT_TILES=16x1x4,1x32x8,2x32x8), 24, 3, 5; 39 for down alone (SEARCH=down:6144); 40's other
# axes (stages 1, 8 warps); 44 once it has a PTX source (benchmarks/triton_ptx.py compiles with
# Triton 3.9 on the CPU instead); 22 again after a kernel change (PART 2 ran 402 s at 1714255).
# 45-48 time tile options removed by 880fb66 (40 swept prefetch too): run them at d4e0970:
#  73  issue 23: 72 in a short call: GPU test, the headline's two configurations off / on
#      (72 and 73: run them at 4d8c803, the switch removed since)
#  72  issue 23: the residual add in the FP8 FFN's RMSNorm kernel: GPU test, batch 1's step
#  71  issue 23: RMSNorm + quantisation over whole rows at 768 rows: the FFN, batch 1's step
#  70  issue 23: batch 1's step kernels, bf16 and FP8, beside the FFN alone at 768 rows
#  69  issue 23: the split-off last wave in half tiles with both warpgroups busy: GPU tests,
#      the FFN and the SwiGLU sweep at 768 rows, batch 1's exact + FP8 step
#  68  issue 23: the FFN at 1,024-4,608 rows as shipped (3 restarted stages below 4,608),
#      batch 1's headline at prompts 512 and 1,024
#  67  issue 23: 3 restarted stages and 16-wide snake bands in the FFN at 1,536 and 4,608 rows
#  66  issue 23: the fused SwiGLU kernel's last wave split off (SWIGLU_TAIL): GPU tests,
#      the FFN at 768 and 1,280 rows, batch 1's exact + FP8 step
#  65  issue 23: the FFN at 1,536 and 2,048 rows by device time; the fused SwiGLU kernel's
#      knobs at 1,536 rows
#  64  issue 23: the fused SwiGLU kernel's 3 stages restarted each tile against 4 steady:
#      the FFN at 768 rows, batch 1's exact + FP8 step
#  63  issue 23: the FFN as shipped at 1,024-2,048 rows (the FFN goal's rows)
#  62  issue 17: the last layer on the window's rows off / on: the flash step at batch 32
#  61  issues 23, 20: the last layer on the block's rows off / on: batch 1's steps
#  60  issue 23: SwiGLU pairs off / on at batch 8's rows: FFN at 4,608, step
#  59  issue 23: SwiGLU pairs off / on at batch 1's 1,280 rows; batch 1's headline
#  58  issue 23: SwiGLU pairs off / on at batch 1's 768 rows: step, the sweep's second round
#  57  issues 23, 20: cuDNN's attention without a key mask: GPU tests, batch 8's exact step
#  56  issue 23: the Mosaic GPU kernels with the w scales as stored: GPU test, step, sweep
#      (the knob removed since: run it at bbe8545)
#  55  issue 23: the Mosaic GPU GEMM at the wave-filling tile (256 x 96 at the down GEMM's
#      768 rows): GPU tests, the down GEMM against cuBLASLt, batch 1's exact + FP8 step
#  54  issue 23: the fused SwiGLU kernel's knobs at batch 8's rows
#  53  issue 23: the fused SwiGLU epilogue off / on at batch 1's 768 rows: FFN, step
#  52  issue 23: 51's switch in batch 8's exact + FP8 step
#  51  issue 23: gate/up with SwiGLU + quantisation in the Mosaic GPU kernel's epilogue: GPU
#      tests, the FFN at 4,608 rows
#  50  issue 20: batch 8's dual step with one key share in the split-keys attention
#  49  issues 20, 23: the FP8 dots' maxNumImpreciseAcc (IMPRECISE_ACC=32: Hopper's FP8 wgmma
#      instead of f16 mma.sync): GPU test, the FFN at 32 rows, the batch-1 dual step
#  48  issues 20, 23: 47's switch in the batch-1 dual step (FP8)
#  47  issues 20, 23: the FP8 decode tiles with their scales loaded before the K loop
#      (TritonTiles.scales_ahead): GPU test, the GEMMs at 32 rows, the FFN
#  46  issues 20, 23: 45's best persistent setting (PSETS) in the FFN at 32 rows and in the
#      batch-1 dual step (FP8), against the tiles as now, alternated
#  45  issues 20, 23: the FP8 GEMM at 32 rows over persistent programs (TritonTiles.programs):
#      GPU test, then by device time against a program per tile and split
#  44  issue 20: the FP8 FFN's kernels at 32 rows in PTX: what their K loops load and wait on
#  43  issues 20, 23: 41's settings in the batch-1 dual step
#  42  issue 20: the split-keys attention's merge in the kernel: GPU tests, kernel, dual step
#  41  issues 20, 23: the fused gate/up + SwiGLU kernel and the in-kernel split-K sum at 32
#      rows: GPU tests, the FFN (41 and 43: the kernels removed since: run them at a5b878e)
#  40  issues 20, 23: the Triton FP8 decode tiles at 32 rows by device time, the K groups
#      loaded ahead (TritonTiles.prefetch) among them; the Mosaic GPU ones
#  39  issue 23: cuBLASLt's configurations searched at the power limit's clocks (batch 8)
#  38  issue 20: the split-keys kernel's shares at 128-256 rows and batch 8's 32
#  37  issue 20: the split-keys kernel's shares filling one wave at the prefix step's row
#      tiles, and the prefix step with it on every block against cuDNN
#  36  issue 23: the SM clock, power and throttle reasons through batch 8's bf16 and FP8
#      steps (is the FP8 GEMMs' in-step 1,107 TFLOP/s the clocks?), the GEMMs alone at 4608
#      rows in short and long bursts
#  35  issue 20: the split-keys attention in 64-row tiles at 96-256 query rows against
#      cuDNN, its GPU tests, the prefix step with it taking up to 256 rows against 64
#  34  issue 23: the same at a 756-row canvas (prompt 500, no DPad); the down and gate/up
#      GEMMs' column split at 672 rows (whether SPLITS' 768-row entries fit every row count
#      of six 128-row tiles, as DPad's compact canvases are)
#  33  issue 23: exact + FP8 on DPad's compact canvas, the FFN's rows padded once (as now)
#      against each kernel padding its own (quant.ROW_ALIGN = 1: the code before 9b88de3)
#  32  issue 20: the prefix step kernel by kernel (bf16 and FP8 FFN)
#  31  issue 23: exact's step on the GPU kernels (GPU test), batch 8's step kernel by kernel,
#      the launches (memsets included) of one cuBLASLt split call, batch 8's FFN rows alone
#  30  issue 20: the dual step under XLA's command buffers: as is, off, widened
#  29  issue 23: the paper-style table (fp8_e2e --paper), one run
#  28  issue 20: the dual step's block attention by the split-keys kernel against cuDNN
#  27  issue 23: the down GEMM's columns split between two cuBLASLt calls (GPU test, timing)
#  26  issue 23: the FP8 GPU tests, the quantisation tiles by device time (768, 1280, 6144)
#  25  issue 23: where a full-canvas step's time goes, kernel by kernel, none and exact,
#      bf16 and FP8 FFN (generate --trace --trace-top 40)
#  24  issue 23: the FFN bf16 against FP8 by the device's own time per call (fp8_ffn
#      --trace) beside the chained wall time, at the full canvas's rows and the goal's
#  23  issue 23: cuBLASLt's block-scaled configurations searched at the FFN shapes (SEARCH:
#      SHAPE:M,...; K split up to MAX_SPLIT ways), the fastest timed again in jit beside
#      XLA's per-tensor FP8; GPU tests
#  22  the GPU test suite in two calls (PART=1, PART=2)
#  21  issue 17: the fused update's GPU tests, its tiles (TILES: the heads' work over 132
#      programs, 64-row tiles) round by round beside the unfused ops and the GEMM
#  20  issue 20: FACache's Mosaic GPU kernel: GPU test, beside cuDNN / Triton / jax's FA3
#      (MGPU=block_kv:stages[:probe],... KERNELS=triton,mgpu,fa3), the demo's exact cache
#   3  issues 15, 18: the accuracy table and the cumprod γ sweep on a chain model (CHAIN_HF,
#      default chain_model/), the sweep over 2,000 problems with the paired interval
#   5  issue 20: the batch-1 table (dual, prefix; FP8; DPad) against the floor, one box a cache
#      (sixteenth: as in the fifteenth; repeat when a step changes)
#  16  issue 20 (done, seventeenth): down's decode tiles side by side over rounds, then the
#      quantisation kernels at decode rows (whole rows: one launch instead of two)
#  19  issue 18 (done, seventeenth): the γ sweep at the draft threshold ε 0.95 (both rules)
#  18  issue 20 (done, sixteenth): gate/up's decode tiles (the default 1.05x the best)
#  17  issue 20 (done, sixteenth): stage 5's FP8 prefix rows (with and without DPad), apart
#   4  issue 23 (sixteenth: the default stays): the quantisation kernels' tiles at M 768
#      and 1024 (4096 never reached in its box)
#  14  issues 20, 23: the FP8 FFN at the decode rows against bf16 and its read floor
#  15  issue 18: Flash-Verify's decode six times (as is, deterministic ops, no autotuning)
#   6  issues 17, 18: the fused cache update's tiles against the unfused ops; the verify pass
#   1  issue 15 (done): train a chain model again (VARIANTS, MINUTES, EVAL_N)
#   8  issue 15: go on training a model (CHAIN_INIT=<its HF directory, carried in>,
#      TASK=<its task, default chain-d2m>) for 8 more minutes (fresh optimizer and schedule)
#   2  the chain model's (CHAIN_HF, default the shipped chain_model/) error kinds (bf16, 200
#      held-out problems) and exact caching in fp32 against the fixed schedule
#   7  issue 23, route (b): the knob sweep (twelfth session: done at both shapes, SWEEP_S=140)
#   9  issue 23: the GPU tests of route (b)'s knobs and the FP8 kernels (thirteenth: passed)
#  10  issues 17, 20 (done): the dual cache's later steps through the fused update vs XLA's
#  11  issue 18 (done): the agree rule's γ sweep and cumprod at 0.95 on chain_model/
#  12  issue 20 (done): FP8 Triton against cuBLASLt at M 32-136, the dispatch at 121 / 133,
#      Triton's tiles at M 32 with and without `swap`; GPU tests of those paths
#  13  issue 18 (done): the error kinds of threshold 0.9, flash and flash + verify (200)
# Logs and JSON land in $OUT (at most 8 files come back: copy no extra files there).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v -i "warn" | cut -c1-400; }
# Module switches timed both ways in one process (the benchmarks' --settings SPEC ...,
# module:NAME=int[,...], jax's caches cleared between): the FFN's row padding
# (lacache_jax.quant:ROW_ALIGN=1, each kernel padding its own: the code before 9b88de3), the
# split-keys attention's rows (kernels.short_attention:MAX_ROWS), the attention's merge in the
# split-keys kernel (kernels.short_attention:MERGE_IN_KERNEL)
# fp8_ffn's printed rows, the device times only
FFN_ROW="import ast, sys; [print({k: r.get(k) for k in ('M', 'settings', 'ffn_bf16_device_ms', \
'ffn_fp8_device_ms', 'fp8_speedup_device', 'ffn_fp8_ms')}) for r in (ast.literal_eval( \
line.replace('nan', 'None')) for line in sys.stdin)]"
# fp8_ffn at FFN_ROWS rows (32) by device time in each module setting ($3...: one process,
# jax's caches cleared between), its log $OUT/$1, its box FFN_S or $2 seconds
ffn_settings() {
  local log=$1 box=$2; shift 2
  timeout -k 5 ${FFN_S:-$box} python3 -m benchmarks.fp8_ffn --ms ${FFN_ROWS:-32} \
    --ablation-layers 0 --trace --settings "$@" 2>&1 | tee "$OUT/$log" | grep "^{'M'" \
    | python3 -c "$FFN_ROW"
}
# benchmarks.generate's step (its arguments $3) in each module setting ($4...), as
# ffn_settings: its log $OUT/$1, its box GEN_S or $2 seconds
step_settings() {
  local log=$1 box=$2 args=$3; shift 3
  timeout -k 5 ${GEN_S:-$box} python3 -m benchmarks.generate $args --iters ${ITERS:-2} \
    --settings "$@" 2>&1 | tee "$OUT/$log" | quiet | grep "^B=\|ceilings"
}
# The batch-1 dual step (FP8 FFN, threshold) in each module setting
dual_settings() {
  local log=$1 box=$2; shift 2
  step_settings $log $box "--batch 1 --prompt 512 --modes dual --decoding threshold \
--fp8-ffn on" "$@"
}
# The module switch $1 (module:NAME) at $2 and $3, alternated twice
alternated() { echo "$1=$2 $1=$3 $1=$2 $1=$3"; }
# fp8_tiles' Pallas decode tiles at 32 rows by device time, one run a TILE_SPECS entry
# (shape:splits), each in the box TILE_S or $2 seconds, appended to $OUT/$1; $3...: the
# sweep's other axes (--block-ns, --stages, --rounds, ...)
decode_tiles() {
  local log=$1 box=$2; shift 2
  for spec in ${TILE_SPECS:-down:6,12 gate_up:2,4}; do
    timeout -k 5 ${TILE_S:-$box} python3 -m benchmarks.fp8_tiles --ms 32 --kernels pallas \
      --shapes ${spec%%:*} --splits ${spec#*:} --device-time "$@" 2>&1 \
      | tee -a "$OUT/$log" | quiet | grep "^best\|xla\|error"
  done
}
# After a GPU test run written to $1 (its status in $?): the lines matching $2; false, with a
# line saying so, where a test failed (new code's stages then time nothing)
tests_passed() {
  local rc=$?
  grep -v -i warn "$1" | grep "$2" | tail -12
  [[ $rc == 0 ]] || { echo "GPU tests failed (rc $rc): nothing timed"; return 1; }
}
case "${1:-1}" in
76)
  # issues 20, 23: swap's w scales as one row a CTA, copied before its pipeline
  # (MgpuConfig.scale_row; kernels.fp8_matmul_mgpu:DECODE_SCALE_ROW, 0 as shipped) instead of
  # XLA's 32 copies a block each call: the FP8 GPU tests (its settings among them), the FFN
  # at 32 rows by device time off / on, the batch-1 dual step (FP8, threshold) alternated
  timeout -k 5 ${TEST_S:-200} python3 -m pytest -q -m gpu tests/test_gpu.py -k \
    "llada_widths or scales_written" -s -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_fp8_scale_row_gpu.log" >/dev/null
  tests_passed "$OUT/pytest_fp8_scale_row_gpu.log" "mgpu swap\|passed\|failed\|Error" \
    || exit 1
  q=kernels.fp8_matmul_mgpu:DECODE_SCALE_ROW
  ffn_settings fp8_ffn_scale_row_32.log ${FFN_BOX:-100} "$q=0" "$q=1"
  dual_settings generate_dual_scale_row.log ${DUAL_BOX:-170} $(alternated $q 0 1)
  ls -t benchmarks/results/fp8_ffn-*.json | head -1 | xargs -I{} cp {} "$OUT"/
  ls -t benchmarks/results/generate-*.json | head -1 | xargs -I{} cp {} "$OUT"/ ;;
75)
  # issues 20, 23: stage 74's kernel in the FFN and the step (kernels.fp8_matmul:
  # MGPU_SWAP_MAX_M, 0 when this ran, 32 since; the pipeline's DECODE_* in
  # kernels.fp8_matmul_mgpu): the FFN at 32 rows by device time, the batch-1 dual step (FP8,
  # threshold) alternated off / on, then threshold + dual bf16 against FP8 at batches 1 and
  # 8 with it on to 64 rows
  q=kernels.fp8_matmul:MGPU_SWAP_MAX_M
  ffn_settings fp8_ffn_swap_32.log ${FFN_BOX:-120} "$q=0" "$q=64" ${MORE_FFN:-}
  dual_settings generate_dual_swap.log ${DUAL_BOX:-200} $(alternated $q 0 64)
  step_settings generate_dual_swap_ratio.log ${RATIO_BOX:-240} "--batch 1,8 --prompt 512 \
--modes dual --decoding threshold --fp8-ffn both" "$q=${SWAP_M:-64}"
  ls -t benchmarks/results/fp8_ffn-*.json | head -1 | xargs -I{} cp {} "$OUT"/
  ls -t benchmarks/results/generate-*.json | head -2 | xargs -I{} cp {} "$OUT"/ ;;
74)
  # issues 20, 23: the Mosaic GPU FP8 GEMM at decode rows with the weights on wgmma's M side
  # (MgpuConfig.swap: TMA streams 64- or 128-row weight tiles up to 8 steps deep, x's 32
  # rows the wgmma's N) against the Triton tiles `fp8_matmul` dispatched at 32 rows (reads
  # at 1.4-2.1 TB/s), by the device's span per call: its GPU test, then both GEMMs
  timeout -k 5 ${TEST_S:-150} python3 -m pytest -q -m gpu tests/test_gpu.py -k llada_widths \
    -s -p no:cacheprovider 2>&1 | tee "$OUT/pytest_fp8_swap_gpu.log" >/dev/null
  tests_passed "$OUT/pytest_fp8_swap_gpu.log" "mgpu swap\|passed\|failed\|Error" || exit 1
  for shape in gate_up down; do
    timeout -k 5 ${TILE_S:-170} python3 -m benchmarks.fp8_tiles --ms 32 --shapes $shape \
      --kernels pallas_default,mgpu_swap --rounds ${ROUNDS:-2} --device-time 2>&1 \
      | tee -a "$OUT/fp8_tiles_swap.log" | quiet | grep "^best\|xla\|error\|->"
  done
  # the two sweeps' JSON only (a call returns at most eight files)
  ls -t benchmarks/results/fp8_tiles-*.json | head -2 | xargs -I{} cp {} "$OUT"/ ;;
73)
  # issue 23: stage 72 in a short call (its budget's last minutes): the fused kernel's GPU
  # test, then in one run the headline's two configurations (none bf16, exact + FP8) with the
  # residual add off and on, prompt 1,024 first (its 1.3x the further off)
  echo "stage 73's kernel removed by 042c19d; run it at commit 4d8c803"; exit 1 ;;
72)
  # issue 23: the attention's residual add taken into the FP8 FFN's RMSNorm + quantisation
  # kernel (lacache_jax.quant:RESIDUAL_IN_NORM; stage 70 at 768 rows: XLA's add 7.4 us a
  # layer with the tiled norm's sum of squares, its rsqrt and broadcast 3.0 more, beside the
  # 4.6 us kernel): the fused kernel's GPU test, batch 1's exact + FP8 step alternated off /
  # on, the headline with it on at prompts 512 and 1,024 in one run, then both settings
  # traced (top 40: which fusions go; last, as the call's box may end it)
  echo "stage 72's kernel removed by 042c19d; run it at commit 4d8c803"; exit 1 ;;
71)
  # issue 23: RMSNorm + quantisation over whole rows at the full canvas's rows (stage 70: the
  # tiled form's statistics pass leaves XLA an rsqrt and a broadcast fusion a layer, 0.09 ms
  # a step at 768 rows): the FFN at 768 rows by device time with WHOLE_ROWS_M 32 / 2,048,
  # batch 1's exact + FP8 step alternated, then the headline at prompts 512 and 1,024 with
  # whole rows in one run
  q=kernels.fused_quant:WHOLE_ROWS_M
  FFN_ROWS=768 ffn_settings fp8_ffn_whole_rows_768.log 150 "$q=32" "$q=2048"
  ITERS=1 step_settings generate_b1_whole_rows.log 130 "--batch 1 --prompt 512 --modes exact \
--decoding fixed --fp8-ffn on" $(alternated $q 32 2048)
  ITERS=1 step_settings generate_b1_headline_whole_rows.log 240 "--batch 1 --prompt \
512,1024 --modes none,exact --decoding fixed --fp8-ffn both" "$q=2048" ;;
70)
  # issue 23: where batch 1's FP8 step loses 0.2-0.3 ms of the FFN's isolated saving
  # (forty-sixth session's arithmetic): the FFN at 768 rows by device time, then the
  # full-canvas step's 40 largest kernels, none and exact, bf16 and FP8 (stage 25's trace),
  # in one run: the step's FFN kernels (rmsnorm_quant, the SwiGLU GEMM's two launches, down)
  # against the FFN alone, and the kernels only one of the two steps runs
  FFN_ROWS=768 ffn_settings fp8_ffn_768.log 120 ""
  timeout -k 5 ${GEN_S:-330} python3 -m benchmarks.generate --batch 1 --prompt 512 --modes \
    none,exact --decoding fixed --fp8-ffn both --iters 2 --trace --trace-top 40 2>&1 \
    | tee "$OUT/generate_trace_b1.log" | quiet | grep "^B=\|trace" ;;
69)
  # issue 23: the split-off last wave in half tiles with both warpgroups busy (one on gate,
  # one on up, the up sum handed over in shared memory: SWIGLU_TAIL_SPLIT, the tail's kind
  # since the forty-fifth session; the one-consumer kind took about 0.9 of a tile): its GPU
  # tests, the FFN at 768 rows by device time with the tail off / on, the SwiGLU sweep at 768
  # rows (its split_parts row: the whole kernel in half tiles), then batch 1's exact + FP8
  # step alternated (PART=2)
  m=kernels.fp8_matmul_mgpu_ws
  if [[ ${PART:-1} == 1 ]]; then
    timeout -k 5 ${TESTS_S:-150} python3 -m pytest -q -m gpu tests/test_fp8_mgpu_ws.py -k \
      "tail or half_tiles" -p no:cacheprovider > "$OUT/pytest_half_tiles_gpu.log" 2>&1
    tests_passed "$OUT/pytest_half_tiles_gpu.log" "passed\|failed\|Error" || exit 1
    FFN_ROWS=768 ffn_settings fp8_ffn_half_tiles.log 170 "$m:SWIGLU_TAIL=0" "$m:SWIGLU_TAIL=1"
    timeout -k 5 ${SWEEP_S:-200} python3 -m benchmarks.fp8_gemm --mgpu-ws-sweep swiglu:768 \
      2>&1 | tee "$OUT/ws_sweep_swiglu_768.log" | grep "^{" | python3 -c "import ast, sys; \
[print(round(r['ms'] * 1e3, 1), r['kernel']) for r in map(ast.literal_eval, sys.stdin)]"
    exit
  fi
  step_settings generate_b1_half_tiles.log 300 "--batch 1 --prompt 512 --modes exact \
--decoding fixed --fp8-ffn on" $(alternated $m:SWIGLU_TAIL 0 1) ;;
68)
  # issue 23: as shipped since the forty-fifth session (3 stages restarted each tile below
  # 4,608 rows): the FFN at 1,024, 2,048 and 4,608 rows by device time (the profiled programs
  # now take the weights as arguments: each row count's profile should come back), then
  # batch 1's headline (none and exact, with and without FP8) at prompts 512 and 1,024
  FFN_ROWS=1024,2048,4608 ffn_settings fp8_ffn_rows_shipped.log 260 ""
  step_settings generate_b1_headline.log 320 "--batch 1 --prompt 512,1024 --modes none,exact \
--decoding fixed --fp8-ffn both" "" ;;
67)
  # issue 23: the fused SwiGLU kernel with 3 stages restarted each tile (faster at 768 rows in
  # stage 64: the FFN 2.1%, batch 1's step 1.1%) and with snake bands 16 wide (the first
  # place in stage 65's one-round sweep at 1,536 rows) at batch 8's and the goal's rows: the
  # FFN at 1,536 and 4,608 rows by device time in each setting
  m=kernels.fp8_matmul_mgpu_ws
  three="$m:SWIGLU_STAGES=3,$m:SWIGLU_STEADY=0" four="$m:SWIGLU_STAGES=4"
  FFN_ROWS=1536,4608 ffn_settings fp8_ffn_swiglu_stages_rows.log 420 "$four" "$three" \
    "$three,$m:SWIGLU_SNAKE_WIDTH=16" ;;
66)
  # issue 23: the fused SwiGLU kernel's last partial wave split off (SWIGLU_TAIL: 4 waves of
  # 128-row tiles, then 96 tiles of 64 rows at batch 1's 768 rows, the fifth wave's idle SMs
  # the 0.68 ms a step the 1.3x lacks): its GPU tests, the FFN at 768 and 1,280 rows by device
  # time (PART=1, about 450 s), then batch 1's exact + FP8 step, alternated (PART=2; tokens
  # compared by the benchmark)
  m=kernels.fp8_matmul_mgpu_ws
  if [[ ${PART:-1} == 1 ]]; then
    timeout -k 5 ${TESTS_S:-150} python3 -m pytest -q -m gpu tests/test_fp8_mgpu_ws.py -k \
      tail -p no:cacheprovider > "$OUT/pytest_swiglu_tail_gpu.log" 2>&1
    tests_passed "$OUT/pytest_swiglu_tail_gpu.log" "passed\|failed\|Error" || exit 1
    FFN_ROWS=768,1280 ffn_settings fp8_ffn_swiglu_tail.log 320 "$m:SWIGLU_TAIL=0" \
      "$m:SWIGLU_TAIL=1"
    exit
  fi
  step_settings generate_b1_swiglu_tail.log 300 "--batch 1 --prompt 512 --modes exact \
--decoding fixed --fp8-ffn on" $(alternated $m:SWIGLU_TAIL 0 1) ;;
65)
  # issue 23: the FFN at 1,536 and 2,048 rows by device time (the forty-fourth session's
  # traces passed protobuf's 2 GB there: fp8_ffn now profiles 5 calls above 1,024 rows;
  # 1.55x and 1.67x bf16 by wall time), then the fused SwiGLU kernel's knobs at 1,536 rows,
  # where its rate fell (about 990 TFLOP/s against 1,110-1,130 at 1,024 and 2,048; snake
  # bands of 8 row tiles split 12 into 8 + 4: width 16 is one band)
  FFN_ROWS=1536,2048 ffn_settings fp8_ffn_rows_1536.log 300 ""
  timeout -k 5 ${SWEEP_S:-200} python3 -m benchmarks.fp8_gemm --mgpu-ws-sweep swiglu:1536 2>&1 \
    | tee "$OUT/ws_sweep_swiglu_1536.log" | grep "^{" | python3 -c "import ast, sys; \
[print(round(r['ms'] * 1e3, 1), r['kernel']) for r in map(ast.literal_eval, sys.stdin)]" ;;
64)
  # issue 23: the fused SwiGLU kernel with 3 stages restarted each tile against the shipped 4
  # steady ones (the sweep's kernel 3.3% faster at 768 rows in the forty-fourth session):
  # the FFN at 768 rows by device time, then batch 1's exact + FP8 step, alternated
  m=kernels.fp8_matmul_mgpu_ws
  three="$m:SWIGLU_STAGES=3,$m:SWIGLU_STEADY=0" four="$m:SWIGLU_STAGES=4"
  FFN_ROWS=768 ffn_settings fp8_ffn_swiglu_stages_768.log 150 "$four" "$three"
  step_settings generate_b1_swiglu_stages.log 300 "--batch 1 --prompt 512 --modes exact \
--decoding fixed --fp8-ffn on" "$four" "$three" "$four" "$three" ;;
63)
  # issue 23: the FFN goal's rows below batch 8's (FP8 >= 1.6x bf16 from 1,024 rows; 1.61x at
  # 4,608 in the forty-third session; 1,024-3,072 untimed since the fused SwiGLU kernel): the
  # FFN as shipped at 1,024, 1,536 and 2,048 rows (about 100-140 s a row count; the profile
  # of 3,072 rows passed protobuf's 2 GB in the thirty-fifth session)
  FFN_ROWS=${FFN_ROWS:-1024,1536,2048} ffn_settings fp8_ffn_rows.log 450 "" ;;
62)
  # issue 17: the Flash-dLLM step at batch 32 with the last layer on the window's rows
  # (cache.HEAD_ROWS_ONLY) on / off, each in its own process (the floor counts the setting);
  # batch 1 with it on (the README's figure, which predates the cut)
  for on in 1 0; do
    timeout -k 5 ${FLASH_S:-240} python3 -m benchmarks.flash --parts step \
      --batch $([[ $on == 1 ]] && echo 1,32 || echo 32) \
      --settings lacache_jax.cache:HEAD_ROWS_ONLY=$on 2>&1 \
      | tee "$OUT/flash_b32_head_rows_$on.log" | quiet | grep "^flash\|->"
  done ;;
61)
  # issues 23, 20: the last layer's attention, projection and MLP on the block's rows only
  # (cache.HEAD_ROWS_ONLY), alternated on / off: batch 1, prompt 512, none and exact with and
  # without the FP8 FFN (the headline ratio in each setting), then prefix
  ITERS=${ITERS:-1} step_settings generate_b1_head_rows.log 360 "--batch 1 --prompt 512 \
--modes none,exact --decoding fixed --fp8-ffn both" $(alternated lacache_jax.cache:HEAD_ROWS_ONLY \
    1 0)
  ITERS=1 step_settings generate_b1_prefix_head_rows.log 120 "--batch 1 --prompt 512 --modes \
prefix --decoding fixed --fp8-ffn both" $(alternated lacache_jax.cache:HEAD_ROWS_ONLY 1 0) ;;
60)
  # issue 23: the fused SwiGLU kernel's pairs at batch 8's rows too: without them it ran 1.4%
  # faster in batch 1's step (thirty-ninth session), and the thirty-sixth's sweep had one CTA
  # a cluster 1.3% / 2.5% faster at 4,608 / 6,144 rows, within its spread. The FFN at 4,608
  # rows (goal 1.6x bf16; 1.59x with pairs) off / on, then batch 8's exact + FP8 step
  # alternated (pairs from 4,608 rows as shipped / never)
  FFN_ROWS=${FFN_ROWS:-4608} ffn_settings fp8_ffn_swiglu_pairs_4608.log 300 \
    kernels.fp8_matmul_mgpu_ws:SWIGLU_PAIRS_MIN_M=4608 \
    kernels.fp8_matmul_mgpu_ws:SWIGLU_PAIRS_MIN_M=1000000
  step_settings generate_b8_swiglu_pairs.log 280 "--batch 8 --prompt 512 --modes exact \
--decoding fixed --fp8-ffn on" $(alternated kernels.fp8_matmul_mgpu_ws:SWIGLU_PAIRS_MIN_M 4608 \
    1000000) ;;
59)
  # issue 23: the fused SwiGLU kernel's pairs at batch 1's 1,280 rows (P 1024) off / on
  # (SWIGLU_PAIRS_MIN_M 0: pairs everywhere, as before the thirty-ninth session), then batch
  # 1's none and exact rows at P 512 with and without FP8 (the headline ratio, same run)
  step_settings generate_b1_p1024_swiglu_pairs.log 200 "--batch 1 --prompt 1024 --modes \
exact --decoding fixed --fp8-ffn on" \
    $(alternated kernels.fp8_matmul_mgpu_ws:SWIGLU_PAIRS_MIN_M 0 4608)
  step_settings generate_b1_headline.log 200 "--batch 1 --prompt 512 --modes none,exact \
--decoding fixed --fp8-ffn both" "" ;;
58)
  # issue 23: the fused SwiGLU kernel without clusters at batch 1's 768 rows (its sweep's
  # cluster-1 row 4% faster in the thirty-eighth session's one round): batch 1's exact + FP8
  # step alternated (goal 1.3x of none: 0.5 ms a step less), then the sweep's second round
  step_settings generate_b1_swiglu_cluster.log 220 "--batch 1 --prompt 512 --modes exact \
--decoding fixed --fp8-ffn on" $(alternated kernels.fp8_matmul_mgpu_ws:SWIGLU_PAIRS_MIN_M 0 4608)
  timeout -k 5 ${SWEEP_S:-200} python3 -m benchmarks.fp8_gemm --mgpu-ws-sweep swiglu:768 \
    2>&1 | tee "$OUT/ws_sweep_swiglu_768.log" | quiet | grep "tflops\|error" | cut -c1-200 ;;
57)
  # issues 23, 20: the GPU tests of cuDNN's attention with and without a key mask (an
  # unpadded batch's layers take none since the thirty-eighth session), then the exact rows
  # of batch 8's step that call 4 of that session's box cut off, mask off / on
  timeout -k 5 ${TEST_S:-120} python3 -m pytest -q -m gpu tests/test_gpu.py -k \
    "cudnn_attention or bf16_forward" -p no:cacheprovider > "$OUT/pytest_unmasked_gpu.log" 2>&1
  tests_passed "$OUT/pytest_unmasked_gpu.log" "passed\|failed\|Error" || exit 1
  step_settings generate_b8_exact_unmasked.log 330 "--batch 8 --prompt 512 --modes exact \
--decoding fixed --fp8-ffn on" lacache_jax.canvas:UNMASKED=0 lacache_jax.canvas:UNMASKED=1 ;;
56)
  # issue 23: the Mosaic GPU kernels reading the w scales as stored (WsConfig.stored_scales,
  # slower in the step in the thirty-eighth session): its GPU test, batch 1's exact + FP8
  # step off / on alternated, the SwiGLU kernel's sweep at 768 rows
  echo "stage 56's knob removed in the forty-ninth session; run it at commit bbe8545"
  exit 1 ;;
55)
  # issue 23: batch 1's down GEMM at 768 rows runs 907 TFLOP/s in cuBLASLt's 128 x 128 tiles
  # (192 tiles on 132 SMs: two waves, the second 45% full; gate/up 1,134, twenty-second
  # session); WsConfig.get_wave_filling's 256 x 96 tiles make one wave of 129. GPU tests
  # (column scales, the overlapping last tile), the sweep at 768 rows (cuBLASLt, the default
  # tile, the wave-filling tile, then the knobs: `same_as_default` checks each), the step
  # with fp8_matmul.WAVE_FILL_MAX_M off / on alternated (goal 1.3x of none: 0.6 ms a step
  # less, about 19 us a layer of the down GEMM's 85), then the sweep at 1,280 rows (cut
  # short by its box if the rest ran long: the boxes add up to 590 s)
  timeout -k 5 ${TEST_S:-140} python3 -m pytest -q -s -m gpu tests/test_fp8_mgpu_ws.py -k \
    "wave_filling or block_n" -p no:cacheprovider > "$OUT/pytest_wave_filling_gpu.log" 2>&1
  tests_passed "$OUT/pytest_wave_filling_gpu.log" "passed\|failed\|Error\|wave filling" \
    || exit 1
  timeout -k 5 ${SWEEP_S:-150} python3 -m benchmarks.fp8_gemm --mgpu-ws-sweep down:768 2>&1 \
    | tee "$OUT/ws_sweep_down_768.log" | quiet | grep "tflops\|error" | cut -c1-200
  step_settings generate_b1_wave_fill.log 180 "--batch 1 --prompt 512 --modes exact \
--decoding fixed --fp8-ffn on" $(alternated kernels.fp8_matmul:WAVE_FILL_MAX_M 0 1280)
  timeout -k 5 ${SWEEP_S:-120} python3 -m benchmarks.fp8_gemm --mgpu-ws-sweep down:1280 2>&1 \
    | tee "$OUT/ws_sweep_down_1280.log" | quiet | grep "tflops\|error" | cut -c1-200 ;;
52)
  # issue 23: 51's switch in batch 8's exact + FP8 step (prompt 512, gen 64: 4,608 canvas
  # rows, the twenty-seventh session's traced step: 86.9 ms, 3.1 of them the SwiGLU kernel),
  # off / on alternated in one process
  step_settings generate_b8_swiglu_mgpu.log 300 "--batch 8 --prompt 512 --gen 64 --modes \
exact --decoding fixed --fp8-ffn on" $(alternated kernels.gate_up_swiglu:MGPU_MIN_M 0 128) ;;
51)
  # issue 23: gate/up with SwiGLU + quantisation in the Mosaic GPU kernel's epilogue
  # (fp8_matmul_mgpu_ws.gate_up_swiglu_mgpu_ws, dispatched from gate_up_swiglu.MGPU_MIN_M
  # rows; thirty-fourth session, CPU: lowers, interpreted it is the unfused path): its GPU
  # tests, then the FFN at batch 8's 4,608 rows by device time, off / on (52: the step)
  timeout -k 5 ${TEST_S:-200} python3 -m pytest -q -s -m gpu tests/test_fp8_mgpu_ws.py -k \
    swiglu -p no:cacheprovider > "$OUT/pytest_swiglu_mgpu_gpu.log" 2>&1
  tests_passed "$OUT/pytest_swiglu_mgpu_gpu.log" "passed\|failed\|Error\|swiglu mgpu_ws" || exit 1
  # ptxas' registers and spills (the epilogue holds both sums and the SwiGLU's temporaries)
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/swd timeout -k 5 60 python3 -c "from \
tests.test_fp8_mgpu_ws import operands; from kernels.fp8_matmul_mgpu_ws import \
gate_up_swiglu_mgpu_ws as f; print(f(*operands(4608, 4096, 24576))[0].shape)" \
    > "$OUT/swiglu_ptxas_run.log" 2>&1
  cat /tmp/swd/*.ptxas > "$OUT/swiglu_ptxas.txt" 2>&1
  grep -i "registers\|spill" "$OUT/swiglu_ptxas.txt" | head -4
  FFN_ROWS=${FFN_ROWS:-4608} ffn_settings fp8_ffn_swiglu_mgpu.log 280 \
    kernels.gate_up_swiglu:MGPU_MIN_M=0 kernels.gate_up_swiglu:MGPU_MIN_M=128 ;;
54)
  # issue 23: the fused SwiGLU kernel's knobs (fp8_gemm.SWIGLU_SWEEP: the pair sharing w,
  # snake order and bands, no cluster, per-tile pipelines) beside the GEMM + SwiGLU kernel
  # it replaces, at batch 8's 4,608 and 6,144 rows: its GEMM ran 8% longer than cuBLASLt's
  # in the step (thirty-fifth session); `same_as_default` flags a knob that breaks it
  for m in ${SWIGLU_MS:-4608 6144}; do
    timeout -k 5 ${SWEEP_S:-250} python3 -m benchmarks.fp8_gemm --mgpu-ws-sweep swiglu:$m \
      2>&1 | tee "$OUT/ws_sweep_swiglu_$m.log" | quiet | grep "tflops\|error" | cut -c1-200
  done ;;
53)
  # issue 23: whether the fused SwiGLU epilogue (gate_up_swiglu.MGPU_MIN_M, 4,608 as shipped
  # from the thirty-fifth session: faster there and in batch 8's step at 6,144 rows) pays at
  # batch 1's full canvas too (768 rows: 4.4 waves of its 576 tiles; the SwiGLU kernel it
  # saves took 19 us a layer there, twenty-second session): the FFN off / on (one row count
  # and setting about 100-140 s), then batch 1's exact + FP8 step alternated (goal 1.3x of
  # none: 0.5 ms a step less)
  FFN_ROWS=${FFN_ROWS:-768} ffn_settings fp8_ffn_swiglu_mgpu_rows.log 300 \
    kernels.gate_up_swiglu:MGPU_MIN_M=0 kernels.gate_up_swiglu:MGPU_MIN_M=128
  step_settings generate_b1_swiglu_mgpu.log 240 "--batch 1 --prompt 512 --modes exact \
--decoding fixed --fp8-ffn on" $(alternated kernels.gate_up_swiglu:MGPU_MIN_M 4608 768) ;;
50)
  # issue 20: batch 8's dual step with one key share a (batch, head) in the split-keys
  # attention (short_attention.PROGRAMS 256: cdiv(256, 8 x 32) = 1, no merge) against two
  # (264, as now): one share ran 39.8 us a call against 43.4 (thirty-fourth session, H200).
  # Batch 1's shares stay the same at 768 keys (the dual step: 6 shares of 2 key tiles either
  # way; the prefix's 2, 3, 4 row tiles: 4, 2, 2). Alternated in one process, FP8 FFN
  step_settings generate_b8_shares.log 300 "--batch 8 --prompt 512 --modes dual --decoding \
threshold --fp8-ffn ${FP8:-on}" $(alternated kernels.short_attention:PROGRAMS 264 256) ;;
49)
  # issues 20, 23: Pallas lowers the FP8 dot without maxNumImpreciseAcc, so Triton (3.9, at
  # least) refuses wgmma and upcasts to f16 for mma.sync; IMPRECISE_ACC=32 sets it (thirty-
  # third session, CPU: the down GEMM's K loop 282 instructions with 8 wgmma against 505
  # with 64 mma.sync). GPU test (numerics; whether XLA's Triton changed the bits), then the
  # FFN at 32 rows and the batch-1 dual step (FP8, threshold) with it off / on, alternated
  timeout -k 5 ${TEST_S:-100} python3 -m pytest -q -s -m gpu tests/test_gpu.py -k \
    imprecise_acc -p no:cacheprovider > "$OUT/pytest_imprecise_acc_gpu.log" 2>&1
  tests_passed "$OUT/pytest_imprecise_acc_gpu.log" "passed\|failed\|Error\|imprecise" || exit 1
  ISETS=$(alternated kernels.fp8_matmul_triton:IMPRECISE_ACC 0 32)
  ffn_settings fp8_ffn_imprecise_acc.log 240 $ISETS
  dual_settings generate_dual_imprecise_acc.log 300 $ISETS ;;
47)
  # issues 20, 23: in PTX of the down GEMM at 32 rows (Triton 3.9's compile of the lowered
  # module, CPU, thirty-third session) the K loop waits each group on 5 global loads, the
  # per-group scales, which Triton's pipeline does not issue ahead; with a program's scales
  # loaded before the loop (TritonTiles.scales_ahead) it waits on none. GPU test (the same
  # bits), the GEMMs by device time, then the FFN with the module switch off / on,
  # alternated (48: the dual step)
  echo "stage 47 timed options removed by 880fb66; run it at" \
    "commit d4e0970"; exit 1 ;;
48)
  # issues 20, 23: 47's switch in the batch-1 dual step (FP8, threshold), off / on alternated
  echo "stage 48 timed options removed by 880fb66; run it at" \
    "commit d4e0970"; exit 1 ;;
46)
  # issues 20, 23: the default decode tiles as now against persistent programs (PSETS: the
  # module switches kernels.fp8_matmul_triton:PROGRAMS / PREFETCH), the FFN at 32 rows by
  # device time, then the batch-1 dual step (FP8, threshold), the settings alternated
  echo "stage 46 timed options removed by 880fb66; run it at" \
    "commit d4e0970"; exit 1 ;;
45)
  # issues 20, 23: the Triton FP8 GEMM at 32 rows with its (column tile, K split) items cut
  # into persistent programs' ranges, each one flat K loop (TritonTiles.programs): the
  # pipeline fills once a program, not once a tile (the gate/up and down GEMMs' excess over
  # their read floor, 1.21x and 1.40x on the H200, fits one fixed cost of ~3 K groups' reads
  # a program); with the next K group loaded ahead in registers (prefetch 1) or not, should
  # Triton's pipeline not take the flat loop. Its GPU test first (the same bits)
  echo "stage 45 timed options removed by 880fb66; run it at" \
    "commit d4e0970"; exit 1 ;;
44)
  # issue 20: the FP8 GEMM at 32 rows reads its weights at 1.4-2.1 TB/s, the bf16 FFN at 2.7
  # (thirty-second session: the FP8 FFN's excess over its read floor is most of the FP8 dual
  # step's). Its kernels' PTX from XLA's dump of the FFN at 32 rows: which loads the K loop
  # issues ahead (cp.async, TMA) and which it waits on (ld.global: the per-group scales?)
  rm -rf /tmp/dump44
  XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/dump44" timeout -k 5 ${FFN_S:-200} python3 -m \
    benchmarks.fp8_ffn --ms 32 --ablation-layers 0 > "$OUT/fp8_ffn_dumped.log" 2>&1
  echo "PTX files: $(find /tmp/dump44 -name "*.ptx" | wc -l)"
  python3 -m benchmarks.ptx_loops /tmp/dump44 --kernel "" --top 0 | awk '{print $2}' \
    | sort | uniq -c | sort -rn | head -60 > "$OUT/ptx_kernel_names.log"
  python3 -m benchmarks.ptx_loops /tmp/dump44 --kernel ${KERNEL:-fp8} --top 4 --save "$OUT" \
    --most 2 > "$OUT/ptx_loops_fp8.log" 2>&1
  cut -c1-300 "$OUT/ptx_loops_fp8.log" | head -40 ;;
42)
  # issue 20: the split-keys attention with the key shares' states merged in the kernel by
  # the last share (short_attention.MERGE_IN_KERNEL): GPU tests; the kernel alone, both
  # merges; the dual step (batch 1, or BATCHES; bf16 and FP8) with each
  timeout -k 5 ${TEST_S:-150} python3 -m pytest -q -m gpu tests/test_gpu.py -k \
    "short_attention" -p no:cacheprovider > "$OUT/pytest_short_merged_gpu.log" 2>&1
  tests_passed "$OUT/pytest_short_merged_gpu.log" "passed\|failed" || exit 1
  timeout -k 5 ${ATT_S:-120} python3 -m benchmarks.short_attention --shapes \
    1:32:768,8:32:768,1:256:768 --splits 6 2>&1 | tee "$OUT/short_attention_merged.log" \
    | quiet | tail -20
  timeout -k 5 ${GEN_S:-240} python3 -m benchmarks.generate --batch ${BATCHES:-1} \
    --prompt 512 --modes dual --decoding threshold --fp8-ffn both --iters 2 --settings \
    kernels.short_attention:MERGE_IN_KERNEL=0 kernels.short_attention:MERGE_IN_KERNEL=1 2>&1 \
    | tee "$OUT/generate_dual_merged.log" | quiet | grep "^B=\|ceilings" ;;
41)
  # issues 20, 23: the gate/up GEMM with SwiGLU + quantisation in its epilogue at decode rows
  # (kernels/gate_up_swiglu.py) and the Triton GEMM's split-K sum in the kernel
  # (TritonTiles.sum_in_kernel): their GPU tests; the FFN at 32 rows by device time as now
  # (unfused, XLA's sums), fused, and fused with the sums in the kernel (43: the dual step in
  # the same three settings)
  echo "stage 41's kernels removed in the forty-ninth session; run it at commit a5b878e"
  exit 1 ;;
43)
  # issues 20, 23: the batch-1 dual step (FP8 FFN) in 41's three settings
  echo "stage 43's kernels removed in the forty-ninth session; run it at commit a5b878e"
  exit 1 ;;
40)
  # issues 20, 23: the Triton FP8 kernel's decode tiles at 32 rows by the device's own span
  # per call (the split-K partials' sum included; the sweeps before timed chained wall time):
  # K splits x Triton's pipeline stages (1: none; 3 and 4 timed alike before) x the K groups
  # loaded ahead in registers (TritonTiles.prefetch) x 4 or 8 warps, at the 128-column tile
  # (BLOCK_NS; the narrow tiles ran in the sixteenth and seventeenth sessions, the split-K sum
  # in the kernel lost in the thirty-second): does loading ahead lift the weight reads from
  # 1.4-2.1 TB/s? Its GPU test first (the same bits as without). TritonTiles.prefetch (and
  # its GPU test) removed by 880fb66: at d4e0970 this stage swept it too
  decode_tiles fp8_tiles_decode_device.log 170 --block-ns ${BLOCK_NS:-128} --stages \
    ${STAGES:-1,3} --warps ${WARPS:-4,8} --rounds ${ROUNDS:-2}
  # the Mosaic GPU kernel's decode pipelines (TMA; stages, K groups a step, K splits) by the
  # same measure: does TMA streaming beat Triton's loads at 32 rows?
  timeout -k 5 ${MGPU_S:-120} python3 -m benchmarks.fp8_tiles --ms 32 --kernels mgpu \
    --rounds ${ROUNDS:-2} --device-time 2>&1 | tee -a "$OUT/fp8_tiles_decode_device.log" \
    | quiet | grep "^best" ;;
39)
  # issue 23: cuBLASLt's block-scaled configurations ranked at the power limit's clocks
  # (bursts of SEARCH_REPS calls each; the twenty-first session's search ran bursts of 5, a
  # cool GPU's clocks), at batch 8's rows (prompt 512 + gen 256: 6,144); the fastest again
  # in jit, CHAIN calls a program, beside the heuristic's; SM clock and power sampled
  why=clocks_throttle_reasons.active
  nvidia-smi --help-query-gpu | grep -q clocks_event_reasons.active \
    && why=clocks_event_reasons.active
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu,$why \
    --format=csv -lms 200 > "$OUT/clocks_search.csv" 2>&1 &
  smi=$!
  timeout -k 5 ${SEARCH_S:-420} python3 -m benchmarks.fp8_gemm --cublaslt-search \
    ${SEARCH:-gate_up:6144,down:6144} --search-reps ${SEARCH_REPS:-150} --top ${TOP:-5} \
    --rounds ${ROUNDS:-4} --chain ${CHAIN:-100} 2>&1 | tee "$OUT/fp8_gemm_search_capped.log" \
    | quiet | grep -v "'kind': 'search'" | tail -24
  kill $smi ;;
38)
  # issue 20: the split-keys kernel's shares at every prefix block size (4 shares beat the
  # one-wave default at 160 rows on both cards, 3 lost at 160 and 256: which programs count
  # is a wave?), and batch 8's dual block at 1 and 2 shares (37's box ended there)
  timeout -k 5 ${ATT_S:-300} python3 -m benchmarks.short_attention --shapes \
    8:32:768,1:128:768,1:160:768,1:192:768,1:224:768,1:256:768 --splits 1,2,3,4,6 2>&1 \
    | tee "$OUT/short_attention_shares.log" | quiet | tail -40 ;;
37)
  # issue 20: the split-keys kernel's default shares filling one wave of programs (a prefix
  # block of 160-256 rows: 2 shares, not 3; batch 8's 32 rows: 1, not 2), and it taking the
  # prefix step's blocks up to 256 rows at batch 1: its GPU test; the kernel at the default
  # against forced shares; the prefix step with it against cuDNN in one process
  timeout -k 5 ${TEST_S:-100} python3 -m pytest -q -m gpu tests/test_gpu.py -k \
    "short_attention" -p no:cacheprovider 2>&1 | tee "$OUT/pytest_short_wave_gpu.log" \
    | grep -v -i warn | tail -3
  timeout -k 5 ${ATT_S:-150} python3 -m benchmarks.short_attention --shapes \
    1:32:768,1:96:768,1:160:768,1:256:768,8:32:768 --splits 1,2,3,4 2>&1 \
    | tee "$OUT/short_attention_wave.log" | quiet | tail -30
  timeout -k 5 ${GEN_S:-300} python3 -m benchmarks.generate --batch 1 --prompt 512 --modes \
    prefix --decoding fixed --fp8-ffn both --iters 2 --short-attention split,cudnn 2>&1 \
    | tee "$OUT/generate_prefix_wave.log" | quiet | grep "^B=\|ceilings" ;;
36)
  # issue 23: whether the FP8 GEMMs run slower inside batch 8's step (1,107 TFLOP/s) than in
  # the harness (1,284-1,333) because the clocks drop under FP8's power: SM clock, power and
  # throttle reasons sampled every 100 ms through the bf16 and the FP8 step
  why=clocks_throttle_reasons.active  # renamed in newer drivers
  nvidia-smi --help-query-gpu | grep -q clocks_event_reasons.active \
    && why=clocks_event_reasons.active
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu,$why \
    --format=csv -lms 100 > "$OUT/clocks_b8.csv" 2>&1 &
  smi=$!
  timeout -k 5 ${GEN_S:-240} python3 -m benchmarks.generate --batch 8 --prompt 512 --gen 64 \
    --modes ${MODES:-exact} --decoding fixed --fp8-ffn both --iters 2 2>&1 \
    | tee "$OUT/generate_b8_clocks.log" | quiet | grep "^B=\|ceilings"
  kill $smi
  # the GEMMs alone at batch 8's rows in cuBLASLt's own harness: bursts of 5 calls (a cool
  # GPU's clocks) against 500 (its power limit's)
  timeout -k 5 ${GEMM_S:-150} python3 -m benchmarks.fp8_gemm --cublaslt-harness \
    gate_up:4608,down:4608 --reps 5,500 --rounds 3 2>&1 | tee "$OUT/fp8_gemm_4608.log" \
    | quiet | tail -12 ;;
35)
  # issue 20: the split-keys attention with 64-row tiles at the prefix step's 96-256 rows
  # against cuDNN (27 us a call there, twenty-seventh session), GPU tests; then the prefix step
  # with the kernel taking up to 256 rows (short_attention.MAX_ROWS) against 64 (as now)
  timeout -k 5 ${TEST_S:-100} python3 -m pytest -q -m gpu tests/test_gpu.py -k \
    "short_attention" -p no:cacheprovider 2>&1 | tee "$OUT/pytest_short_rows_gpu.log" \
    | grep -v -i warn | tail -3
  timeout -k 5 ${ATT_S:-150} python3 -m benchmarks.short_attention --shapes \
    1:32:768,1:96:768,1:160:768,1:256:768,8:256:768 --splits 2,4 2>&1 \
    | tee "$OUT/short_attention_rows.log" | quiet | tail -30
  timeout -k 5 ${GEN_S:-300} python3 -m benchmarks.generate --batch 1 --prompt 512 --modes \
    prefix --decoding fixed --fp8-ffn both --iters 2 --settings \
    kernels.short_attention:MAX_ROWS=64 kernels.short_attention:MAX_ROWS=256 2>&1 \
    | tee "$OUT/generate_prefix_rows.log" | quiet | grep "^B=\|ceilings" ;;
34)
  # issue 23: a canvas of 756 rows (prompt 500 + gen 256), exact + FP8 both ways, none (bf16:
  # no FP8 kernel, the same either way) with the second; then the column split at 672 rows
  # (the compact canvas of 665 columns, padded)
  for align in 1 16; do
    modes=exact fp8=on; [ $align = 16 ] && modes=none,exact fp8=both
    echo "ROW_ALIGN=$align" | tee -a "$OUT/generate_row_align_p500.log"
    timeout -k 5 ${GEN_S:-150} python3 -m benchmarks.generate --settings \
      lacache_jax.quant:ROW_ALIGN=$align --batch 1 --prompt 500 --modes $modes --decoding \
      fixed --fp8-ffn $fp8 --iters 1 2>&1 \
      | tee -a "$OUT/generate_row_align_p500.log" | quiet | grep "^B=\|ceilings"
  done
  timeout -k 5 ${SPLIT_S:-200} python3 -m benchmarks.fp8_gemm --cublaslt-split \
    down:672:2816,gate_up:672:22528 --top 2 --rounds 3 2>&1 \
    | tee "$OUT/fp8_gemm_split_672.log" | quiet | tail -8 ;;
33)
  # issue 23: exact + FP8 on DPad's compact canvas (633-768 columns at prompt 512): the
  # FFN's rows padded once to 16 (9b88de3) against each kernel padding its own (the paper
  # table's + DPad + LaCache: 16.19 ms against 15.57 without DPad, twenty-seventh session);
  # padded once, also without DPad in the same process (DPAD_16=both)
  for align in 1 16; do
    dpad=on; [ $align = 16 ] && dpad=${DPAD_16:-on}
    echo "ROW_ALIGN=$align" | tee -a "$OUT/generate_row_align_dpad.log"
    timeout -k 5 ${GEN_S:-270} python3 -m benchmarks.generate --settings \
      lacache_jax.quant:ROW_ALIGN=$align --batch 1 --prompt 512 --modes exact --decoding \
      fixed --fp8-ffn on --dpad $dpad --iters 1 2>&1 \
      | tee -a "$OUT/generate_row_align_dpad.log" | quiet | grep "^B=\|ceilings"
  done ;;
32)
  # issue 20: the prefix step kernel by kernel (never traced; 1.40x its floor against the
  # goal's 1.20x): how much is the projection GEMMs at 32-256 rows, where a GEMM takes about
  # its read time plus its FLOP time (the fused cache update's 128-row projection: 48 us
  # against 29 + 20), and how much the rest
  timeout -k 5 ${GEN_S:-300} python3 -m benchmarks.generate --batch 1 --prompt 512 --modes \
    prefix --decoding fixed --fp8-ffn both --iters 1 --trace --trace-top 40 2>&1 \
    | tee "$OUT/generate_trace_prefix.log" | quiet | grep "^B=\|trace\|ceilings" ;;
31)
  # issue 23: the GPU test of exact's step on the compact canvas; batch 8's full-canvas step
  # kernel by kernel (gen 64: the trace's step is the same); the launches (memsets) of one
  # cuBLASLt split call
  timeout -k 5 ${TEST_S:-150} python3 -m pytest -q -m gpu tests/test_gpu.py -k \
    "exact_step or column_split" -p no:cacheprovider 2>&1 | tee "$OUT/pytest_exact_gpu.log" \
    | grep -v -i warn | tail -4
  timeout -k 5 ${GEN_S:-220} python3 -m benchmarks.generate --batch 8 --prompt 512 --gen 64 \
    --modes none,exact --decoding fixed --fp8-ffn both --iters 1 --trace --trace-top 40 2>&1 \
    | tee "$OUT/generate_trace_b8.log" | quiet | grep "^B=\|trace"
  timeout -k 5 ${SPLIT_S:-80} python3 -m benchmarks.fp8_gemm --cublaslt-split \
    down:768:2816,gate_up:768:22528 --top 1 --rounds 1 2>&1 \
    | tee "$OUT/fp8_gemm_launches.log" | quiet | tail -8
  # batch 8's FFN rows alone, bf16 against FP8 by device time (the step's 1.27x there is
  # below what the GEMM rates predict, about 1.37x)
  timeout -k 5 ${FFN_S:-80} python3 -m benchmarks.fp8_ffn --ms 6144 --ablation-layers 0 \
    --trace 2>&1 | tee "$OUT/fp8_ffn_b8.log" | quiet | tail -6 ;;
30)
  # issue 20: the dual step's idle time between kernels under XLA's command buffers (CUDA
  # graphs): as is, with them off, and widened to loops, conditionals and every custom call
  # (FLAGS_1..3 replace them; each a fresh process)
  variants=("" "--xla_gpu_enable_command_buffer=" "--xla_gpu_enable_command_buffer=FUSION,\
CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1")
  for n in 1 2 3; do
    var=FLAGS_$n
    flags=${!var-${variants[n-1]}}
    echo "XLA_FLAGS=$flags" | tee -a "$OUT/generate_graphs.log"
    XLA_FLAGS="$flags" timeout -k 5 ${GEN_S:-110} python3 -m benchmarks.generate --batch \
      ${BATCH:-1} --prompt 512 --modes dual --decoding threshold --fp8-ffn both --iters 2 \
      --trace --trace-top 8 2>&1 | tee -a "$OUT/generate_graphs.log" | quiet \
      | grep "^B=\|trace per step\|rror" | cut -c1-220
  done ;;
29)
  # issue 23: the paper's combinations (vanilla, + LaCache, + Parallel, + Parallel + LaCache,
  # each with DPad; threshold + dual with and without FP8) in one run, and their table
  timeout -k 5 ${PAPER_S:-540} python3 -m benchmarks.fp8_e2e --paper --iters 1 2>&1 \
    | tee "$OUT/fp8_e2e_paper.log" | quiet | grep "^B=\|^| [a-zA-Z+]\|ceilings" ;;
28)
  # issue 20: the dual step's block attention (32 rows over the canvas) by the split-keys
  # kernel against cuDNN: GPU tests, the kernels alone, then the dual step with each
  timeout -k 5 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k \
    "short_attention or facache_kernel" -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_short_gpu.log" | grep -v -i warn | tail -4
  timeout -k 5 ${SHORT_S:-120} python3 -m benchmarks.short_attention 2>&1 \
    | tee "$OUT/short_attention.log" | quiet | tail -20
  timeout -k 5 ${GEN_S:-300} python3 -m benchmarks.generate --batch ${BATCH:-1,8} --prompt \
    ${PROMPT:-512} --modes dual --decoding threshold --fp8-ffn both --iters 2 \
    --short-attention split,cudnn 2>&1 | tee "$OUT/generate_short.log" | quiet \
    | grep "^B=\|ceilings" ;;
1)
  VARIANTS=${VARIANTS:-chain-d2m} MINUTES=${MINUTES:-8.0} EVAL_N=${EVAL_N:-400} \
    bash benchmarks/device_chain.sh ;;
8)
  : "${CHAIN_INIT:?the HF directory of the model to go on training, carried in}"
  VARIANTS=${TASK:-chain-d2m} INIT=$CHAIN_INIT SEED=${SEED:-1} LR=${LR:-5e-4} \
    MINUTES=${MINUTES:-8.0} EVAL_N=${EVAL_N:-400} bash benchmarks/device_chain.sh ;;
2)
  # a chain model: where it fails, then exact caching in fp32 (highest matmul precision)
  # against the fixed schedule: token identity where bf16 gave 84% of rows on d2m
  CHAIN_HF=${CHAIN_HF:-chain_model}
  # where the model fails (bf16, 200 held-out problems): which difficulty to train next
  python3 -m convert "$CHAIN_HF" /tmp/ck16 --force --quiet \
    && timeout 120 python3 -m benchmarks.chain_errors --checkpoint /tmp/ck16 \
    --task "${TASK:-chain-d2m}" --n 200 --slots 200 2>&1 | tee "$OUT/chain_errors.log" \
    | quiet | tail -3
  python3 -m convert "$CHAIN_HF" /tmp/ck32 --dtype float32 --force --quiet \
    && JAX_DEFAULT_MATMUL_PRECISION=highest timeout 180 python3 -m benchmarks.accuracy \
    --task "${TASK:-chain-d2m}" --checkpoint /tmp/ck32 --n ${FP32_N:-100} --no-plot \
    --modes fixed,exact 2>&1 \
    | tee "$OUT/accuracy_chain_fp32.log" | quiet | tail -4
  ;;
3)
  CHAIN_HF=${CHAIN_HF:-chain_model}
  python3 -m convert "$CHAIN_HF" /tmp/chain_ck --force --quiet || exit 1
  CHAIN=/tmp/chain_ck
  # the look-ahead of FlashConfig's default (48), as the accuracy table's flash modes use
  timeout 200 python3 -m benchmarks.flash --parts gamma --layers 1 --checkpoint "$CHAIN" \
    --task "${TASK:-chain-d2m}" --n 2000 --gammas 0.7,0.8,0.9 2>&1 \
    | tee "$OUT/flash_gamma_chain.log" | quiet | tail -6
  timeout 350 python3 -m benchmarks.accuracy --task "${TASK:-chain-d2m}" --checkpoint "$CHAIN" \
    --n 200 2>&1 | tee "$OUT/accuracy_chain.log" | quiet | tail -30 ;;
4)
  timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k fp8_kernels -p no:cacheprovider \
    2>&1 | tee "$OUT/pytest_fp8_gpu.log" | tail -3
  timeout 300 python3 -m benchmarks.fp8_ffn --ms 768,1024 --ablation-layers 0 --quant-ms \
    768,1024,4096 --quant-tiles 16x1,16x1x2,16x2x4,1x32x1,2x32x1,2x32x2,4x32x4,8x32x4,16x32x8 \
    2>&1 | tee "$OUT/fp8_ffn_quant.log" | quiet | tail -32 ;;
5)
  # one box a cache, bf16 prefix only: the prefix + DPad programs compile for 112-136 s
  # (fifteenth session: one 400 s box for everything ended before the last row), so the FP8
  # prefix rows are stage 17
  for mode in dual prefix; do
    fp8=$([[ $mode == dual ]] && echo both || echo off)
    timeout -k 5 $([[ $mode == dual ]] && echo 170 || echo 240) python3 -m benchmarks.generate \
      --batch 1 --prompt 512 --modes $mode --decoding fixed --fp8-ffn $fp8 --dpad both \
      --iters 2 2>&1 | tee "$OUT/generate_floor_$mode.log" | quiet | grep "^|\|ceilings" | tail -8
  done ;;
17)
  timeout -k 5 300 python3 -m benchmarks.generate --batch 1 --prompt 512 --modes prefix \
    --decoding fixed --fp8-ffn on --dpad both --iters 2 2>&1 \
    | tee "$OUT/generate_floor_prefix_fp8.log" | quiet | grep "^|\|ceilings" | tail -8 ;;
6)
  timeout -k 5 400 python3 -m benchmarks.flash --parts update,verify --batch 1,32 --iters 30 \
    --update-blocks 128:64:8:4,128:128:8:3:2,128:64:8:4:2,128:128:4:3:2 2>&1 \
    | tee "$OUT/flash_update_verify.log" | quiet | grep -v "^$" | tail -20
  # 32 query rows at batch 1: the dual cache's block rows, where the issue asks whether the
  # fused update would pay too (its write is a contiguous block there)
  timeout -k 5 100 python3 -m benchmarks.flash --parts update --batch 1 --iters 30 \
    --window 16 --lookahead 8 --track 8 --update-blocks 32:128:4:3,32:128:4:3:2 2>&1 \
    | tee "$OUT/flash_update_r32.log" | quiet | grep "^update" ;;
7)
  # issue 23, route (b): the knob sweep (fp8_gemm.WS_SWEEP: the default, the carry_acc probe
  # and step_groups first) beside cuBLASLt's block-scaled GEMM at both shapes. `-k`: a hung
  # kernel ignores SIGTERM (the tenth session's `memory_registers=32`). ptxas' report of the
  # default is in the sixth and tenth sessions' logs (the same both times).
  # SWEEP_S: each shape's box (the sweep's order puts the default, the probe and step_groups
  # first, so a short box still measures those)
  timeout -k 5 ${SWEEP_S:-300} python3 -m benchmarks.fp8_gemm --mgpu-ws-sweep gate_up:4096 2>&1 \
    | tee "$OUT/ws_sweep_gate_up.log" | quiet | grep "tflops\|error" | cut -c1-160
  timeout -k 5 ${SWEEP_S:-250} python3 -m benchmarks.fp8_gemm --mgpu-ws-sweep down:4096 2>&1 \
    | tee "$OUT/ws_sweep_down.log" | quiet | grep "tflops\|error" | cut -c1-160 ;;
9)
  timeout -k 5 400 python3 -m pytest -q -m gpu tests/test_fp8_mgpu_ws.py tests/test_gpu.py \
    -k "knobs or llada_shapes or fp8" -p no:cacheprovider 2>&1 | tee "$OUT/pytest_fp8_gpu.log" \
    | tail -4 ;;
10)
  # the later steps' K/V write through XLA's ops and through the fused kernel, side by side
  # (each configuration compiled afresh: the choice is read while tracing)
  timeout -k 5 420 python3 -m benchmarks.generate --batch 1,8 --prompt 512 --modes dual \
    --decoding fixed --fp8-ffn both --dual-update xla,fused --iters 3 2>&1 \
    | tee "$OUT/generate_dual_update.log" | quiet | grep "^|\|ceilings\|same tokens" | tail -14
  timeout -k 5 120 python3 -m pytest -q -m gpu tests/test_flash_cache.py -p no:cacheprovider \
    2>&1 | tee "$OUT/pytest_flash_cache_gpu.log" | tail -2 ;;
12)
  timeout -k 5 200 python3 -m benchmarks.fp8_gemm --ms 32,48,64,80,96,112,128,136 \
    --kernels triton,cublaslt 2>&1 | tee "$OUT/fp8_gemm_crossover.log" | quiet \
    | grep "^|" | tail -14
  timeout -k 5 150 python3 -m benchmarks.fp8_gemm --ms 121,133 --kernels triton,mgpu,dispatch \
    2>&1 | tee "$OUT/fp8_gemm_padded.log" | quiet | grep "^|" | tail -6
  # the Triton kernel's tiles at the decode rows, each tile also transposed (`swap`: the
  # weights on the MMA's 64-row side), against the FP8 read floor of this run
  timeout -k 5 200 python3 -m benchmarks.fp8_tiles --kernels pallas --ms 32 \
    --shapes gate_up,down 2>&1 | tee "$OUT/fp8_tiles_swap.log" | quiet | grep "^best\|ceil"
  timeout -k 5 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "cublaslt or llada_widths" \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cublaslt_gpu.log" | tail -2 ;;
11)
  python3 -m convert "${CHAIN_HF:-chain_model}" /tmp/chain_ck --force --quiet || exit 1
  timeout -k 5 260 python3 -m benchmarks.flash --parts gamma --layers 1 --checkpoint \
    /tmp/chain_ck --task chain-d2m --n 2000 --gammas 0.5,0.7,0.8,0.9 --accept agree 2>&1 \
    | tee "$OUT/flash_gamma_agree.log" | quiet | tail -6
  timeout -k 5 200 python3 -m benchmarks.flash --parts gamma --layers 1 --checkpoint \
    /tmp/chain_ck --task chain-d2m --n 2000 --gammas 0.95 2>&1 \
    | tee "$OUT/flash_gamma_095.log" | quiet | tail -3 ;;
16)
  # two pipeline depths of one tile, timed once each, differed 1.7x in the sixteenth session:
  # 5 rounds, round by round (M 32 first: the decode rows of a dual-cache block)
  timeout -k 5 240 python3 -m benchmarks.fp8_tiles --kernels pallas --ms 32,16 --shapes down \
    --block-ns 64,128 --splits 6,12 --rounds 5 2>&1 | tee "$OUT/fp8_tiles_down_rounds.log" \
    | quiet | grep "^best\|ceil"
  timeout -k 5 240 python3 -m benchmarks.fp8_ffn --ms 16,32 --ablation-layers 0 --quant-ms \
    16,32,768 --quant-tiles 16x1,1x32x1,1x32x4,2x32x4,4x32x4 2>&1 \
    | tee "$OUT/fp8_ffn_quant_decode.log" | quiet | tail -20 ;;
18)
  timeout -k 5 300 python3 -m benchmarks.fp8_tiles --kernels pallas --ms 32 --shapes gate_up \
    --block-ns 32,64,128 --splits 1,2,4,8 2>&1 | tee "$OUT/fp8_tiles_narrow_gate_up.log" \
    | quiet | grep "^best\|ceil" ;;
19)
  python3 -m convert "${CHAIN_HF:-chain_model}" /tmp/chain_ck --force --quiet || exit 1
  timeout -k 5 250 python3 -m benchmarks.flash --parts gamma --layers 1 --checkpoint \
    /tmp/chain_ck --task chain-d2m --n 2000 --gammas 0.7,0.8,0.9 --epsilon 0.95 2>&1 \
    | tee "$OUT/flash_gamma_eps095.log" | quiet | tail -5
  timeout -k 5 250 python3 -m benchmarks.flash --parts gamma --layers 1 --checkpoint \
    /tmp/chain_ck --task chain-d2m --n 2000 --gammas 0.8,0.85,0.9 --accept agree \
    --epsilon 0.95 2>&1 | tee "$OUT/flash_gamma_eps095_agree.log" | quiet | tail -5 ;;
13)
  python3 -m convert "${CHAIN_HF:-chain_model}" /tmp/chain_ck --force --quiet || exit 1
  for mode in threshold flash flash+verify; do  # (a `+` in a name does not come back)
    timeout -k 5 150 python3 -m benchmarks.chain_errors --checkpoint /tmp/chain_ck \
      --task chain-d2m --n 200 --slots 200 --mode "$mode" 2>&1 \
      | tee "$OUT/chain_errors_${mode/+/_}.log" | quiet | tail -1
  done ;;
14)
  # first the GPU test of the new default tiles (transposed 16- and 32-row tiles), then the FFN
  timeout -k 5 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k llada_widths \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest_fp8_widths_gpu.log" | tail -2
  timeout -k 5 300 python3 -m benchmarks.fp8_ffn --ms 32,48,121,256,1024 --ablation-layers 0 \
    2>&1 | tee "$OUT/fp8_ffn_decode.log" | quiet | tail -12 ;;
20)
  # issue 20: FACache's Mosaic GPU kernel (full / fill): its GPU test (TESTS="facache or
  # llada_widths" adds stage 14's first line), then beside cuDNN, the Triton kernel and jax's
  # FA3, then the exact cache end to end on the demo model
  timeout -k 5 240 python3 -m pytest -q -m gpu tests/test_gpu.py -k "${TESTS:-facache} " \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest_facache_gpu.log" | tail -3
  timeout -k 5 300 python3 -m benchmarks.cached_attention --tiles 64 \
    --mgpu ${MGPU:-128:2,64:3,128:2:no_bias} --kernels ${KERNELS:-triton,mgpu,fa3} 2>&1 \
    | tee "$OUT/cached_attention_mgpu.log" | quiet | grep -v "^$" | tail -8
  # generate's exact cache through the new fill dispatch (demo head dim 64): tokens as uncached
  python3 -m convert demo_model /tmp/demo_ck --force --quiet && timeout -k 5 150 python3 -m \
    benchmarks.accuracy --checkpoint /tmp/demo_ck --n 500 --no-plot \
    --modes fixed,exact,threshold,threshold+exact 2>&1 | tee "$OUT/accuracy_demo_exact.log" \
    | quiet | tail -6 ;;
21)
  # issue 17: the fused cache update: the GPU tests (TESTS: a -k filter), then the Triton
  # kernel at its default and at TILES (the heads' work dealt to 132 programs, 64-row
  # tiles) beside the unfused XLA ops and XLA's
  # projection GEMM alone, round by round (ROUNDS), at the flash budget's 128 rows (batch 1),
  # and the Mosaic GPU kernel with UPDATE_MGPU (e.g. default,64:3:2; not dispatched)
  timeout -k 5 300 python3 -m pytest -q -m gpu tests/test_flash_cache.py -k "${TESTS:-}" \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest_flash_cache_gpu.log" | tail -3
  mgpu=${UPDATE_MGPU:+--update-mgpu $UPDATE_MGPU}
  timeout -k 5 200 python3 -m benchmarks.flash --parts update --batch 1 --iters 10 \
    --rounds ${ROUNDS:-10} --update-gemm $mgpu \
    --update-blocks \
    ${TILES:-128:128:8:3:1:132,128:64:8:4:1:132,128:64:8:3:1:132,64:64:4:4,64:64:4:4:1:132} 2>&1 \
    | tee "$OUT/flash_update_tiles.log" | quiet | grep "^update\|failed\|Error\|: " | tail -12
  ;;
22)
  # the GPU test suite in two calls (PART=1 or 2): all 37 did not fit one 520 s box (32
  # passed in the nineteenth session's)
  files="tests/test_flash_cache.py tests/test_fp8_mgpu_ws.py"
  [[ ${PART:-1} == 2 ]] && files="tests/test_gpu.py tests/test_window_attention.py"
  timeout -k 5 ${TESTS_S:-540} python3 -m pytest -q -m gpu $files -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests_part${PART:-1}.log" | tail -3 ;;
27)
  # issue 23: the down GEMM's columns split between two cuBLASLt calls (one wave of 128 x 128
  # tiles, then the rest with the tail's own configuration): its GPU test, then timed
  timeout -k 5 120 python3 -m pytest -q -m gpu tests/test_gpu.py -k "column_split" -s \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest_split_gpu.log" | grep -v -i warn | tail -6
  timeout -k 5 ${SPLIT_S:-300} python3 -m benchmarks.fp8_gemm --cublaslt-split \
    ${SPLIT:-down:768:2816,down:1280:3328} --top ${TOP:-4} --rounds ${ROUNDS:-5} 2>&1 \
    | tee "$OUT/fp8_gemm_split.log" | quiet | tail -14 ;;
26)
  # the FP8 kernels' GPU tests (group-major scales among them), then the quantisation tiles
  # by the device's own time at the full canvas's rows (768, 1280) and batch 8's (6144)
  timeout -k 5 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "fp8" -p no:cacheprovider \
    2>&1 | tee "$OUT/pytest_fp8_gpu.log" | grep -v -i warn | tail -4
  timeout -k 5 ${QUANT_S:-330} python3 -m benchmarks.fp8_ffn --ms ${MS:-768} \
    --ablation-layers 0 --trace --quant-ms ${QUANT_MS:-768,1280,6144} --quant-tiles \
    ${QUANT_TILES:-16x1x4,16x2x4,16x4x4,32x1x4,32x2x8,8x2x4,16x8x8,64x1x8,4x4x4} 2>&1 \
    | tee "$OUT/fp8_ffn_quant_device.log" | quiet | tail -40 ;;
25)
  # the full-canvas step's 40 largest kernels (ms and launches per step)
  timeout -k 5 ${GEN_S:-300} python3 -m benchmarks.generate --batch ${BATCH:-1} --prompt \
    ${PROMPT:-512} --modes none,exact --decoding fixed --fp8-ffn both --iters 2 --trace \
    --trace-top 40 2>&1 | tee "$OUT/generate_trace.log" | quiet | grep "^B=\|trace" ;;
24)
  timeout -k 5 400 python3 -m benchmarks.fp8_ffn --ms ${MS:-768,1024,1280,4096} \
    --ablation-layers 0 --trace 2>&1 | tee "$OUT/fp8_ffn_device.log" | quiet | tail -12 ;;
23)
  timeout -k 5 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k cublaslt -s \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cublaslt_gpu.log" | grep -v -i warn | tail -12
  timeout -k 5 ${SEARCH_S:-400} python3 -m benchmarks.fp8_gemm --cublaslt-search \
    ${SEARCH:-gate_up:1024,down:1024,gate_up:4096,down:4096} --top ${TOP:-6} \
    --rounds ${ROUNDS:-5} --max-split-k ${MAX_SPLIT:-1} 2>&1 \
    | tee "$OUT/fp8_gemm_search.log" | quiet | grep -v "^{" | tail -12 ;;
15)
  python3 -m convert "${CHAIN_HF:-chain_model}" /tmp/chain_ck --force --quiet || exit 1
  # XLA may reduce with atomics (the importance sums) and autotunes GEMMs by timing: each
  # flag below removes one candidate (a run took ~20 s in the fourteenth session)
  for run in 1 2 det1 det2 noautotune1 noautotune2; do
    flags=${XLA_FLAGS:-}
    [[ $run == det* ]] && flags="$flags --xla_gpu_deterministic_ops=true"
    [[ $run == noautotune* ]] && flags="$flags --xla_gpu_autotune_level=0"
    XLA_FLAGS="$flags" timeout -k 5 80 python3 -m benchmarks.chain_errors --checkpoint \
      /tmp/chain_ck --task chain-d2m --n 200 --slots 200 --mode flash+verify 2>&1 \
      | tee "$OUT/chain_errors_verify_$run.log" | quiet | tail -1
  done ;;
esac
