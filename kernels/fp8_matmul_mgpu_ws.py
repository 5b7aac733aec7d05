"""The per-group FP8 GEMM (contract: `kernels/fp8_matmul.py::fp8_matmul_ref`) lowered through
Pallas' Mosaic GPU backend at DeepGEMM's recipe (Hopper only), with its knobs (`WsConfig`).

What it owns: `WsConfig` (tile, pipeline, cluster and tile-order settings, `get_default`,
`get_wave_filling`), `fp8_matmul_mgpu_ws` and `gate_up_swiglu_mgpu_ws` (the FFN's gate/up
GEMM with SwiGLU and the 1 x 128 quantisation in the epilogue: `_SwiGLU`; the plain store
is `_Plain`). Shapes: x
[M, K] fp8 e4m3 with x_scale [M, K/128]; w [N, K] fp8 e4m3 (K-major) with w_scale
[N/128, K/128]; out [M, N].

The recipe (DeepGEMM's sm90 FP8 GEMM, rewritten here in Pallas):
- A CTA computes a 256 x 128 (M x N) output tile: two consumer warpgroups of `wg_rows` = 128
  rows each and one producer warpgroup issuing TMA (`emit_pipeline_warp_specialized`, which
  lowers the producer to 40 registers and raises the consumers to 232 with `setmaxnreg`).
- One pipeline step is one 128-wide K group: x tile [256, 128], w tile [128, 128], the
  group's 256 x scales and its one w scale, `stages` steps in flight.
- Promotion every group, as the reference does: per 64-row wave, an FP8 wgmma sums the group
  into a fresh fp32 accumulator (64 x 128: 64 registers per thread); then the wave's row
  scale s = x_scale[m, g] * w_scale[n / 128, g] (the tile is exactly one 128-column weight
  block, so its w scale is one number per group) folds it into the running sum:
  `out += acc * s`, one FFMA per accumulator element.
- Clusters of 2 CTAs side by side along N (`cluster_dim="n"`: both read the same x tile, which
  TMA multicasts to the pair; its L2 -> SMEM traffic is halved) or along M (the w tile shared).
- Persistent: `ctas` CTAs (one per SM) walk the output tiles in a planar snake order
  (`snake_dim`, groups of `snake_width` tiles), so neighbours in time share x rows or w columns
  in L2. `steady`: the TMA pipeline runs on across a CTA's tiles (Pallas' pipeline_state
  START / STEADY; we drain it after the last tile), so the next tile's first loads overlap
  this tile's last wgmmas and its epilogue, as DeepGEMM's persistent loop does.
- Half tiles of 64 rows for the SwiGLU kernel's second launch when its last partial wave is
  split off (`SWIGLU_TAIL`, `swiglu_tail_split`): both warpgroups on one tile, one summing
  gate and one up, the up sum handed over in shared memory (`split_parts`, the kind used),
  or one consumer warpgroup a CTA (`consumers=1`).
- Epilogue: each wave's 64 x 128 fp32 sum is cast, written to swizzled SMEM in `epi_cols`-wide
  pieces (`epi_slots` slots per warpgroup, taken in turn) and stored by TMA.
- Other tile widths (`block_n`, DeepGEMM's per-shape choice, `get_wave_filling`): where few
  waves of 128-column tiles leave SMs idle in the last, e.g. 256 x 96 at the down GEMM's 768
  rows; a tile spanning two weight blocks takes each column's w scale (`column_scales`).

Registers (why 128-row warpgroups are done as two 64-row waves): a wgmma accumulator of
128 x 128 fp32 is 128 registers per thread, and the running sums of 128 rows another 128:
256 is over the 232 a consumer gets and would spill. Two waves of 64 rows share one 64-register
accumulator: 128 (sums) + 64 (accumulator) + scales and addresses, about 200, as DeepGEMM's
`final_accum[kNumMWaves]` + `accum` does. The price: within a warpgroup the second wave's wgmma
waits for the first wave's promotion; the other warpgroup's wgmmas fill that gap.
`step_groups=2` trades the other way: 64-row warpgroups (one wave: 64 sum registers) hold two
accumulators (192 in all), take two K groups per pipeline step, issue both wgmmas and promote
the first group while the second's wgmma runs (unmeasured on the GPU: the knob sweep has it).

Shared memory per stage: x 32 KiB + w 16 KiB + scales 1.25 KiB = 49.25 KiB; 4 stages = 197
KiB, so the epilogue gets one 8 KiB slot per warpgroup (64 bf16 or 32 f32 columns): 213 KiB
of Hopper's 227 (two slots: 229 KiB, refused by the lowering). `get_default` takes the deepest
pipeline that fits and divides the K groups (4 for both FFN GEMMs: 32 and 96 groups).

Measured on the H200 (2026-12-01, commit ca18418, benchmarks/RESULTS.md "third session"):
correct (`pytest -m gpu tests/test_fp8_mgpu_ws.py`: 12 passed, relative L2 1.27e-4 like
cuBLASLt's), 1004 TFLOP/s at gate/up M 1024 and 1041 at M 4096: 0.91-0.96x cuBLASLt's
block-scaled GEMM in the same run, short of the >= 1150 goal (issue 23); DeepGEMM reaches
1350+ with this structure. The knob sweep (gate/up, M 4096) showed the cluster with multicast
(+11% over none) and the two 64-row waves (+7% over `wg_rows=64`) paying, the rest (stages,
epilogue slots, snake order, cluster axis) within noise. The plain GEMM is not dispatched:
cuBLASLt stays the kernel from 128 rows; its SwiGLU variant (`gate_up_swiglu_mgpu_ws`) is,
from 768 rows (`gate_up_swiglu.MGPU_MIN_M`, thirty-fifth and thirty-sixth sessions). ptxas
on the H200 (fourth session, `device_plan.sh`'s ptxas stage at gate/up M 1024; logs lost,
numbers in RESULTS.md): 168 registers per thread at launch (the setmaxnreg split comes
after), an 80-byte stack frame, 100 bytes of spill stores and 132 of spill loads; the SASS
has 128 FFMA (the promotion is one FMA per element, as meant), 24 STL and 32 LDL. The tenth
session (RESULTS.md) timed the pipeline without the promotion (`WsConfig.probe` "carry_acc",
which also drops the zero-fill of the accumulator every group, since Mosaic's Hopper
wgmma has no overwrite flag: DeepGEMM's first wgmma of a group overwrites): 1,245 TFLOP/s
at gate/up M 4096 against 1,001 with it, in two calls 10-14 minutes apart (across calls
timings move 10-20%), so the promotion takes about a fifth of the time, more than the 15%
between the kernel and the goal; giving the consumers more registers (`memory_registers`
32) hung the GPU, so the producer keeps at least 40.
Every GPU call runs under `timeout`: a wrong barrier phase hangs rather than fails.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import fp8_matmul as fm
from kernels import hopper
from kernels.fused_quant import FP8, swiglu_quantize_tile

GROUP = fm.GROUP
WAVE = 64      # rows of one wgmma (Hopper's wgmma M)
BLOCK_N = 128  # a weight block's columns (and the default tile's: one w scale per group)
PROBES = ("", "carry_acc")
# The fewest rows from which `get_default_swiglu` pairs CTAs in clusters sharing x: never
# (a row count turns them on from there). Without pairs, tokens equal, on an H100: batch 1's
# exact + FP8 step (768 rows) 1.4% faster and the sweep's kernel 6% (thirty-ninth session);
# at batch 8's 4,608 rows the FFN 1.0% faster by device time (1.61x bf16 against 1.59x) and
# the step 1.0% (forty-third session).
SWIGLU_PAIRS_MIN_M = 2**31
# `get_default_swiglu`'s pipeline: from `SWIGLU_STEADY_MIN_M` rows the most of `SWIGLU_STAGES`
# stages that fit (down to 2), the steady pipeline (carried over a CTA's tiles) first where
# `SWIGLU_STEADY`: 4 steady at LLaDA-8B; below it 3 stages restarted each tile. On an H100,
# tokens equal: at 768 rows the FFN 2.1% faster by device time and batch 1's exact + FP8 step
# 1.1% (stage 64); at 1,536 rows the FFN 2.1% (1.63x bf16 against 1.60x); at 4,608 rows
# 0.5% slower by wall time, within its spread (stage 67; forty-fifth session). Rows between
# 1,536 and 4,608 untimed.
SWIGLU_STEADY_MIN_M = 4608
SWIGLU_STAGES = 4
SWIGLU_STEADY = 1
# `get_default_swiglu`'s snake bands (`WsConfig.snake_width`): 8 tiles as `get_default`'s. At
# 1,536 rows (12 row tiles: bands of 8 and 4) the sweep's one round had 16 (one band) 8.5%
# faster (278.0 against 303.9 us), but in the FFN, with 3 restarted stages, 0.7% (H100,
# forty-fifth session: stages 65, 67), within its spread; 768 rows' sweep had it 0.9% slower.
SWIGLU_SNAKE_WIDTH = 8
# Whether `gate_up_swiglu_mgpu_ws`'s default splits off the last partial wave of tiles
# (`swiglu_tail_split`): the column blocks that fill whole waves of 128-row tiles in one
# launch, the rest in a second launch of 64-row tiles (half a tile's work each) written into
# the first's outputs. At batch 1's 768 rows the 576 tiles are 4.36 waves run as 5; split, 4
# waves and one of 96 half tiles. Timed on an H100 (forty-sixth session, stage 69, half tiles
# with both warpgroups busy): the FFN at 768 rows 0.2233 -> 0.2177 ms by device time (1.58x
# -> 1.63x bf16), batch 1's exact + FP8 step 14.81 / 14.81 -> 14.69 / 14.70 ms alternated,
# tokens equal; so on. (With one consumer warpgroup a half tile, forty-fifth session: level.)
SWIGLU_TAIL = 1
# The split-off wave's tiles: 64 rows with both warpgroups busy, one on the gate block, one
# on the up block (`WsConfig.split_parts`), or (0) one consumer warpgroup on both (level in
# the step, forty-fifth session).
SWIGLU_TAIL_SPLIT = 1
# The most fp32 values (`WsConfig.tile_registers`) `get_wave_filling` lets a consumer thread
# hold for its tile, of the 232 registers it gets: the default 256 x 128 tile's 192 (two
# waves' sums and an accumulator), the largest known to run well (its ptxas report: a few
# spills, fourth session).
REGISTER_BUDGET = 192
# cuBLASLt's tile at the rows `get_wave_filling` is dispatched at (its heuristic's
# nvjet_sm90_qqtst_128x128 kernels in the traces) and how much less work a wave the
# wave-filling tile must give to take its place: this kernel ran 0.91-0.96x cuBLASLt's rate
# at equal tiles (third session).
CUBLASLT_TILE = (128, 128)
FILL_MARGIN = 0.9


def _waves(M: int, N: int, block_m: int, block_n: int, sm_count: int) -> tuple[int, int]:
    """(tiles, waves): the [M, N] output in block_m x block_n tiles over `sm_count` SMs."""
    tiles = -(-M // block_m) * -(-N // block_n)
    return tiles, -(-tiles // sm_count)


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """Knobs of `fp8_matmul_mgpu_ws` (hashable: a static jit argument)."""
    wg_rows: int = 128            # rows per consumer warpgroup: 64 (one wave) or 128 (two)
    # Output columns per tile, a multiple of 32 up to 256 (the plain kernel's; the SwiGLU
    # kernel's are the 128 of its quantisation groups). DeepGEMM picks it per shape to fill
    # the last wave: LLaDA-8B's down GEMM at batch 1's 768 rows has 96 tiles of 256 x 128
    # on 132 SMs (36 idle), 192 of 128 x 128 (two waves, the second 45% full), 129 of 256 x
    # 96 (one wave). A width that does not divide 128 spans two weight blocks: each column's
    # w scale then comes in the accumulator's column layout (`column_scales`), one more
    # multiply per element. N not a whole number of tiles: the last tile starts at N -
    # block_n and recomputes columns of the one before (the same products and scales; both
    # CTAs write them), so no tile reads or writes past N.
    block_n: int = BLOCK_N
    stages: int = 4               # K groups (TMA steps) in flight
    cluster: int = 2              # CTAs per cluster: 1 or 2
    cluster_dim: str = "n"        # the pair's neighbour: "n" shares (multicasts) x, "m" shares w
    snake_dim: str = "m"          # the tile order's minor dimension ("m" or "n")
    snake_width: int = 8          # tiles along `snake_dim` per band of the snake
    ctas: int | None = None       # persistent CTAs; None: the SM count (rounded to the cluster)
    epi_cols: int = 64            # output columns per epilogue TMA store (32, 64 or 128)
    epi_slots: int = 1            # SMEM slots per warpgroup for the epilogue stores (1 or 2)
    steady: bool = True           # carry the TMA pipeline over a CTA's tiles
    early_scales: bool = False    # load both waves' row scales before the first wgmma
    # K groups per pipeline step (1 or 2). With 2 (64-row warpgroups only: two accumulators
    # per wave), a wave issues both groups' wgmmas, then promotes the first while the second
    # runs: the promotion's FFMAs overlap a wgmma of their own warpgroup, not only the other
    # warpgroup's (the probe: the promotion takes about a fifth of the time).
    step_groups: int = 1
    memory_registers: int = 40    # the producer's registers (setmaxnreg); two consumers get
    #                               floor8((512 - this) / 2), at most 240 (40 -> 232), one 256
    # Consumer warpgroups a CTA (2, or 1: `swiglu_tail_split`'s second launch, a tile of
    # `wg_rows` rows, no clusters)
    consumers: int = 2
    # The SwiGLU kernel's half tile with both warpgroups busy: the two consumers share the
    # tile's 64 rows, warpgroup 0 summing the gate block, 1 the up block (a step loads both,
    # as a whole tile's), and the up sum goes to warpgroup 0 through shared memory for the
    # epilogue (64-row warpgroups, 2 consumers, no clusters, one K group a step). The
    # one-consumer half tile took about 0.9 of a whole tile's time (forty-fifth session):
    # its promotions have no second warpgroup to hide them.
    split_parts: bool = False
    # Timing probe (wrong outputs; benchmarks only, never dispatched): "carry_acc" sums every
    # K group into one wgmma accumulator per wave with no promotion (this pipeline's upper
    # bound, the scheme of a per-tensor GEMM). A probe without the epilogue ran above the
    # H200's FP8 peak (work dropped with the store), so it bounded nothing and is gone.
    probe: str = ""

    @property
    def block_m(self) -> int:
        return self.wg_rows if self.split_parts else self.consumers * self.wg_rows

    @property
    def column_scales(self) -> bool:
        """Whether a tile's columns may span two weight blocks (`block_n` does not divide
        128): per-column w scales in place of one per group."""
        return BLOCK_N % self.block_n != 0

    def n_tiles(self, N: int) -> int:
        return -(-N // self.block_n)

    def smem_bytes(self, out_dtype=jnp.bfloat16, swiglu: bool = False) -> int:
        """Shared memory the kernel asks for (pipeline buffers + epilogue slots, no
        barriers); `swiglu`: `gate_up_swiglu_mgpu_ws`'s (two weight tiles a step, an FP8
        tile and its row scales per warpgroup)."""
        parts = 2 if swiglu else 1
        per_stage = self.step_groups * (
            self.block_m * GROUP + self.block_m * 4 + parts * self.block_n * GROUP)
        w_scales = parts * self.stages * self.step_groups * 4 * (
            self.block_n if self.column_scales else WAVE)
        epilogue = self.consumers * (WAVE * (GROUP + 4) if swiglu else self.epi_slots * WAVE
                                     * self.epi_cols * jnp.dtype(out_dtype).itemsize)
        if self.split_parts:  # one warpgroup stores; the up sum's hand-over buffer
            epilogue = WAVE * (GROUP + 4) + WAVE * self.block_n * 4
        return self.stages * per_stage + w_scales + epilogue

    def fits(self, K: int, out_dtype=jnp.bfloat16, swiglu: bool = False) -> bool:
        """Whether the defaults may pick this: its shared memory within Hopper's (1 KiB
        left for the barriers) and, steady, whole pipelines a tile (`_check_config`)."""
        return (self.smem_bytes(out_dtype, swiglu) <= hopper.SMEM_BYTES - 1024
                and not (self.steady and (K // GROUP // self.step_groups) % self.stages))

    @classmethod
    def get_default(cls, M: int, N: int, K: int, sm_count: int = 132,
                    out_dtype=jnp.bfloat16) -> WsConfig:
        """DeepGEMM's choice for large M: 256 x 128 tiles, clusters of 2 sharing x where N
        allows (the FFN GEMMs: N 4096 and 24576), a snake of 8 tiles along M, the steady
        pipeline, and the deepest pipeline that fits in shared memory with the K group count
        a multiple of it (4 stages of 49.25 KiB leave room for one 8 KiB epilogue slot per
        warpgroup: 64 bf16 or 32 f32 columns). With fewer tiles than SMs at 256 rows and at
        most 128 rows, 128-row tiles (one wave per warpgroup). Swept at M 4096 on the H200
        (`benchmarks/fp8_gemm.py --mgpu-ws-sweep`, RESULTS.md twelfth session): the most
        gain from two K groups a step on 64-row warpgroups with 3 stages restarted each tile
        (1,080 / 1,099 TFLOP/s against 1,015 / 1,040 at gate/up / down), every other knob
        within 3% or slower. Not made the default: the plain kernel is dispatched only with
        `get_wave_filling`'s tile (`fp8_matmul.WAVE_FILL_MAX_M`, off)."""
        base = cls(cluster=2 if N % (2 * BLOCK_N) == 0 else 1)
        tiles, _ = _waves(M, N, base.block_m, base.block_n, sm_count)
        if tiles < sm_count and M <= WAVE * 2:
            base = dataclasses.replace(base, wg_rows=WAVE)
        return base.with_pipeline(K, out_dtype)

    def with_pipeline(self, K: int, out_dtype=jnp.bfloat16) -> WsConfig:
        """This tile with the deepest pipeline that fits in shared memory (the steady one
        where the stages divide the K groups), then two epilogue slots of 64 columns, one,
        two of 32, one (at most a 128-byte row of `out_dtype`, dividing `block_n`)."""
        item = jnp.dtype(out_dtype).itemsize
        for steady in (True, False):
            for stages in (4, 3, 2):
                for slots, cols in ((2, 64), (1, 64), (2, 32), (1, 32)):
                    c = dataclasses.replace(self, stages=stages, epi_slots=slots,
                                            epi_cols=min(cols, 128 // item), steady=steady)
                    if self.block_n % c.epi_cols == 0 and c.fits(K, out_dtype):
                        return c
        raise AssertionError("2 stages always fit")

    @classmethod
    def get_wave_filling(cls, M: int, N: int, K: int, sm_count: int = 132,
                         out_dtype=jnp.bfloat16) -> WsConfig:
        """DeepGEMM's choice of tile (its `get_best_configs`): the fewest waves of tiles
        over the SMs, then the most tiles in the last wave, then the fewest padded rows,
        then the least operand traffic (x read once a column tile, w once a row tile), then
        the taller tile, among tiles of 128 or 256 rows and 32-256 columns in steps of 32
        whose registers fit a consumer (`tile_registers` at most `REGISTER_BUDGET`).
        LLaDA-8B's down GEMM at batch 1's 768 rows: 256 x 96 (129 tiles, one wave) against
        256 x 128's 96 tiles (one wave, 36 SMs idle: each SM's tile a third larger) and
        cuBLASLt's 128 x 128 (192 tiles, two waves). Pipeline by `with_pipeline`; a cluster
        of 2 along N where the column tiles pair up. At 768 rows 5% faster than cuBLASLt
        alone, 0.2 ms slower in batch 1's step (thirty-seventh session): not dispatched."""
        best = None
        for wg_rows in (2 * WAVE, WAVE):
            for block_n in range(32, 257, 32):
                c = cls(wg_rows=wg_rows, block_n=block_n)
                if c.tile_registers() > REGISTER_BUDGET or block_n > N:
                    continue
                tiles, waves = _waves(M, N, c.block_m, block_n, sm_count)
                m_tiles, n_tiles = -(-M // c.block_m), c.n_tiles(N)
                key = (waves, -(tiles - (waves - 1) * sm_count), m_tiles * c.block_m,
                       M * n_tiles + N * m_tiles, -c.block_m)
                if best is None or key < best[0]:
                    best = (key, c)
        c = best[1]
        return dataclasses.replace(c, cluster=2 if c.n_tiles(N) % 2 == 0 else 1).with_pipeline(
            K, out_dtype)

    def fills_waves_better(self, M: int, N: int, sm_count: int = 132) -> bool:
        """Whether this tile's waves hold less work a SM than cuBLASLt's (`CUBLASLT_TILE`)
        by `FILL_MARGIN`: waves x tile area, 129 x (256 x 96) in one wave against two of
        128 x 128 at the down GEMM's 768 rows (0.75)."""
        def work(bm, bn):
            return _waves(M, N, bm, bn, sm_count)[1] * bm * bn
        return work(self.block_m, self.block_n) <= FILL_MARGIN * work(*CUBLASLT_TILE)

    def tile_registers(self) -> int:
        """A consumer thread's fp32 values for its tile: the waves' running sums, the
        wgmma accumulators (`step_groups` of them; a 64-row wave's block_n columns over 128
        threads: block_n / 2 each) and, with `column_scales`, the columns' scales (block_n /
        4 a group)."""
        per_wave = self.block_n // 2
        return ((self.wg_rows // WAVE + self.step_groups) * per_wave
                + (self.step_groups * self.block_n // 4 if self.column_scales else 0))

    @classmethod
    def get_default_swiglu(cls, M: int, F: int, K: int, sm_count: int = 132) -> WsConfig:
        """`gate_up_swiglu_mgpu_ws`'s: 128 x 128 output tiles (two 64-row warpgroups, each
        with a gate and an up sum), clusters of 2 sharing x from `SWIGLU_PAIRS_MIN_M` rows
        (never as shipped) where F allows, the pipeline by rows (`with_swiglu_pipeline`: 4
        steady stages at LLaDA-8B from 4,608 rows, 196 KiB of buffers + 16.5 KiB of
        epilogue; 3 restarted below). Reasoned from `get_default`'s;
        its knobs swept at 4,608, 6,144 and 768 rows (`benchmarks/fp8_gemm.py --mgpu-ws-sweep
        swiglu:M`): dropping the pairs paid in the step (at 768 and 4,608 rows), and 3
        restarted stages below 4,608 rows."""
        del sm_count  # one tile shape: the register budget leaves no other
        pairs = M >= SWIGLU_PAIRS_MIN_M and F % (2 * BLOCK_N) == 0
        return cls(wg_rows=WAVE, cluster=2 if pairs else 1,
                   snake_width=SWIGLU_SNAKE_WIDTH).with_swiglu_pipeline(M, K)

    @classmethod
    def get_swiglu_tail(cls, M: int, K: int) -> WsConfig:
        """The configuration of `swiglu_tail_split`'s second launch: 64-row tiles (half a
        default tile's work a CTA), no clusters, the pipeline as the default's; both
        warpgroups on a tile's two parts (`split_parts`) where `SWIGLU_TAIL_SPLIT`, else one
        consumer warpgroup."""
        kind = dict(split_parts=True) if SWIGLU_TAIL_SPLIT else dict(consumers=1)
        return cls(wg_rows=WAVE, cluster=1, **kind).with_swiglu_pipeline(M, K)

    def with_swiglu_pipeline(self, M: int, K: int) -> WsConfig:
        """This SwiGLU tile with the deepest pipeline that fits at M rows: from
        `SWIGLU_STEADY_MIN_M` rows `SWIGLU_STAGES` stages down, steady first where
        `SWIGLU_STEADY`; below, 3 stages down, restarted each tile."""
        most, steadies = ((SWIGLU_STAGES, (True, False) if SWIGLU_STEADY else (False,))
                          if M >= SWIGLU_STEADY_MIN_M else (3, (False,)))
        for steady in steadies:
            for stages in range(most, 1, -1):
                c = dataclasses.replace(self, stages=stages, steady=steady)
                if c.fits(K, swiglu=True):
                    return c
        raise AssertionError("2 stages always fit")


def swiglu_tail_split(M: int, F: int, sm_count: int) -> int | None:
    """The column blocks `gate_up_swiglu_mgpu_ws`'s first launch takes when the last wave
    is split off (`SWIGLU_TAIL`): the most whole columns of 128-row tiles within whole waves
    over `sm_count` SMs, the rest left to 64-row tiles that must fit one wave; None where the
    tiles fill their waves or the rest would not fit one. LLaDA-8B (F 12,288: 96 blocks): 88
    at 768 rows (528 tiles, 4 waves, then 96 half tiles), 92 at 1,280, 95 at 4,608, None at
    6,144 (4,608 tiles: 34.9 waves)."""
    m_tiles, blocks = -(-M // (2 * WAVE)), F // BLOCK_N
    full = m_tiles * blocks // sm_count
    main = full * sm_count // m_tiles
    if full == 0 or main >= blocks or 2 * m_tiles * (blocks - main) > sm_count:
        return None
    return main


def _check_config(c: WsConfig, N: int, K: int) -> None:
    if c.wg_rows not in (WAVE, 2 * WAVE):
        raise ValueError(f"wg_rows must be 64 or 128, got {c.wg_rows}")
    if c.cluster not in (1, 2) or c.cluster_dim not in ("m", "n"):
        raise ValueError(f"cluster must be 1 or 2 and cluster_dim 'm' or 'n', got "
                         f"{c.cluster}, {c.cluster_dim!r}")
    if c.snake_dim not in ("m", "n") or c.snake_width < 1:
        raise ValueError(f"snake_dim must be 'm' or 'n' and snake_width >= 1, got "
                         f"{c.snake_dim!r}, {c.snake_width}")
    if c.epi_cols not in (32, 64, 128) or c.epi_slots not in (1, 2):
        raise ValueError(f"epi_cols must be 32, 64 or 128 and epi_slots 1 or 2, got "
                         f"{c.epi_cols}, {c.epi_slots}")
    # 32 hung the H200 (tenth session, RESULTS.md): the producer keeps 40 or more.
    if c.memory_registers % 8 or not 40 <= c.memory_registers <= 256:
        raise ValueError(f"memory_registers must be a multiple of 8 in [40, 256], got "
                         f"{c.memory_registers}")
    if c.probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {c.probe!r}")
    if c.stages < 2:
        raise ValueError(f"stages must be at least 2, got {c.stages}")
    if c.step_groups not in (1, 2) or (c.step_groups == 2 and c.wg_rows != WAVE):
        raise ValueError(f"step_groups must be 1, or 2 with wg_rows=64 (two 64-register "
                         f"accumulators per wave), got {c.step_groups} with wg_rows="
                         f"{c.wg_rows}")
    if (K // GROUP) % c.step_groups:
        raise ValueError(f"step_groups {c.step_groups} must divide the {K // GROUP} K groups")
    if c.block_n % 32 or not 32 <= c.block_n <= 256 or c.block_n % c.epi_cols:
        raise ValueError(f"block_n must be a multiple of 32 in [32, 256] and of epi_cols "
                         f"{c.epi_cols}, got {c.block_n}")
    if N < c.block_n:
        raise ValueError(f"N {N} must be at least block_n {c.block_n}")
    if c.cluster == 2 and c.cluster_dim == "n" and c.n_tiles(N) % 2:
        raise ValueError(f"N {N} must make an even number of {c.block_n}-column tiles for a "
                         f"cluster of 2 along n, got {c.n_tiles(N)}")
    steps = K // GROUP // c.step_groups
    if c.steady and steps % c.stages:
        raise ValueError(f"steady pipeline: stages {c.stages} must divide the {steps} "
                         f"pipeline steps (the slots must line up from tile to tile)")
    if c.consumers not in (1, 2) or (c.consumers == 1 and c.cluster != 1):
        raise ValueError(f"consumers must be 2, or 1 without clusters, got {c.consumers} with "
                         f"cluster {c.cluster}")
    if c.split_parts and (c.consumers != 2 or c.wg_rows != WAVE or c.cluster != 1
                          or c.step_groups != 1 or c.probe):
        raise ValueError(f"split_parts needs 2 consumers of wg_rows={WAVE}, no clusters, one "
                         f"K group a step and no probe, got {c}")
    if c.ctas is not None and c.ctas < c.cluster:
        raise ValueError(f"ctas {c.ctas} must be at least the cluster size {c.cluster}")


def _wave_rows(wg, wg_rows: int, h: int):
    """The rows of warpgroup `wg`'s wave `h` in the CTA's tile."""
    return pl.ds(wg * wg_rows + h * WAVE, WAVE)


def _group(ref, j: int, groups: int):
    """K group j of a pipeline step's [rows, groups * 128] tile (the tile itself when the step
    is one group: the default kernel's refs stay unsliced)."""
    return ref if groups == 1 else ref.at[:, pl.ds(j * GROUP, GROUP)]


def _promote_step(x_smem, xs_smem, w_smem, ws_smem, sums, wg, c: WsConfig, interpret):
    """One pipeline step (`c.step_groups` K groups) on one consumer warpgroup: per 64-row
    wave, each group's FP8 wgmma into a fresh fp32 accumulator, then `sum += acc * (x_scale
    * w_scale)` group by group; with 2 groups both wgmmas are issued first, so the first
    group's promotion runs while the second's wgmma does. `early_scales`: every wave's row
    scales are loaded before the first wave's wgmma (DeepGEMM's order: no shared memory load
    between the second wave's wait and its FFMAs). `column_scales`: the w scales are one per
    column, and the product of a row's and a column's scale is formed per element (the same
    fp32 product as the row-layout path's, so the same sums)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    groups, wg_rows, cols = c.step_groups, c.wg_rows, c.column_scales

    def load(ref, axis):  # one value per accumulator row (axis 1) or column (0)
        return hopper.load(ref, plgpu.Layout.WGMMA.reduce(axis), interpret)
    # The w scales, loaded before the wgmmas are issued (used only after they are waited
    # for): 64 copies of the tile's one scale in the row layout, multiplied into the row
    # scales (the promotion is then one multiply-add per element: DeepGEMM's scale_a *
    # scale_b), or each column's in the column layout.
    w_sc = [load(ws_smem.at[j], 0 if cols else 1) for j in range(groups)]

    def wave_scales(h):
        rows = _wave_rows(wg, wg_rows, h)
        x_sc = [load(xs_smem.at[j, rows], 1) for j in range(groups)]
        return list(zip(x_sc, w_sc)) if cols else [x * w for x, w in zip(x_sc, w_sc)]
    early = [wave_scales(h) for h in range(len(sums))] if c.early_scales else None

    def promote(acc_sum, part, s_j):
        if cols:
            x_sc, w_cols = s_j
            return acc_sum + part * (jax.lax.broadcast_in_dim(x_sc, part.shape, [0]) *
                                     jax.lax.broadcast_in_dim(w_cols, part.shape, [1]))
        return acc_sum + part * jax.lax.broadcast_in_dim(s_j, part.shape, [0])
    out = []
    for h, acc_sum in enumerate(sums):
        rows = _wave_rows(wg, wg_rows, h)
        s = early[h] if c.early_scales else wave_scales(h)
        if interpret:  # no transposed wgmma operand there: the same products in fp32
            for j in range(groups):
                part = jax.lax.dot_general(
                    _group(x_smem.at[rows], j, groups)[...].astype(jnp.float32),
                    _group(w_smem, j, groups)[...].astype(jnp.float32), (((1,), (1,)), ((), ())))
                acc_sum = promote(acc_sum, part, s[j])
            out.append(acc_sum)
            continue

        def wave(*accs, rows=rows, acc_sum=acc_sum, s=s):
            for j, acc in enumerate(accs):
                plgpu.wgmma(acc, _group(x_smem.at[rows], j, groups),
                            _group(w_smem, j, groups).transpose((1, 0)))
            for j, acc in enumerate(accs):  # group j done when at most the rest are running
                part = plgpu.wgmma_accumulator_load(acc, wait_n=groups - 1 - j)
                acc_sum = promote(acc_sum, part, s[j])
            return acc_sum
        out.append(pl.run_scoped(wave, *[plgpu.ACC((WAVE, c.block_n), jnp.float32)] * groups))
    return tuple(out)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "sm_count", "interpret"))
def fp8_matmul_mgpu_ws(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16, *,
                       config: WsConfig | None = None, sm_count: int = 132,
                       interpret: bool = False):
    """DeepGEMM's recipe in Pallas Mosaic GPU (module docstring); same contract as
    `fp8_matmul_ref`. `config` default: `WsConfig.get_default(M, N, K, sm_count, out_dtype)`.

    Any M (x is padded to the cluster's rows); N and K multiples of 128, N an even number of
    `block_n`-column tiles with a cluster along N. The x scales are passed transposed ([G,
    M]: a group's scales are one TMA row) and the w scales as 64 copies per block ([G, N / 2]:
    one 256-byte TMA row per group and tile, loaded in the accumulator's row layout), or with
    `column_scales` one per column ([G, N]).

    `interpret`: run in Pallas' Mosaic GPU interpreter (on the CPU: TMA, barriers, clusters
    simulated; the scales read without the row layout, and each wave's product an fp32 dot in
    place of the wgmma: the interpreter models neither the layouts nor a transposed wgmma
    operand)."""
    fm._check(xq, x_scale, wq, w_scale)
    M, K = xq.shape
    N = wq.shape[0]
    c = config or WsConfig.get_default(M, N, K, sm_count, out_dtype)
    _check_config(c, N, K)
    return _ws_call(xq, x_scale, wq, w_scale, c, _Plain(c, out_dtype, N), sm_count, interpret)


@functools.partial(jax.jit, static_argnames=("act_dtype", "config", "sm_count", "interpret",
                                             "tail"))
def gate_up_swiglu_mgpu_ws(xq, x_scale, wq, w_scale, act_dtype=jnp.bfloat16, *,
                           config: WsConfig | None = None, sm_count: int = 132,
                           interpret: bool = False, tail: bool | None = None):
    """The FP8 FFN's gate/up GEMM with SwiGLU and the 1 x 128 quantisation of its output in
    the epilogue (the contract of `gate_up_swiglu.gate_up_swiglu_quant_ref`): wq [2F, K] holds
    the gate rows, then the up rows; returns (aq [M, F] fp8, a_scale [M, F / 128] f32), and
    the bf16 [M, 2F] product is never written (at batch 8's 4,608 rows it is 226 MB written
    by the GEMM and read again by the SwiGLU kernel: 3.1 ms of a 86.9 ms step, RESULTS.md
    twenty-seventh session).

    A CTA's tile is 128 rows of output block n's 128 columns: both 64-row warpgroups promote
    weight block n of gate and of up into two running sums (64 + 64 registers, with the one
    64-register wgmma accumulator the two parts take in turn: the default kernel's register
    budget), then round both to `act_dtype` (the GEMM's output dtype in the unfused path),
    apply `fused_quant.swiglu_quantize_tile` and store the FP8 tile and its row scales (group
    major, [F / 128, M]: the layout the down GEMM's x scales take) by TMA. `config`: its
    `wg_rows` must be 64 and `step_groups` 1 (default `WsConfig.get_default_swiglu`).

    `tail` (None: `SWIGLU_TAIL` where `config` is the default): the last partial wave split
    off (`swiglu_tail_split`, tiles of whole 128-row blocks without clusters only), its column
    blocks computed by a second launch in 64-row half tiles (`WsConfig.get_swiglu_tail`,
    whatever `config` says: a warpgroup on each of gate and up, or one on both) into the
    first's outputs; the same products, so the same outputs."""
    fm._check(xq, x_scale, wq, w_scale)
    M, K = xq.shape
    F = wq.shape[0] // 2
    if wq.shape[0] % (2 * BLOCK_N):
        raise ValueError(f"gate/up rows {wq.shape[0]} must be 2 F with F a multiple of "
                         f"{BLOCK_N}")
    c = config or WsConfig.get_default_swiglu(M, F, K, sm_count)
    _check_config(c, F, K)
    if c.wg_rows != WAVE or c.step_groups != 1 or c.probe or c.block_n != BLOCK_N:
        raise ValueError(f"the SwiGLU epilogue needs wg_rows={WAVE}, step_groups=1, no probe "
                         f"(two 64-register sums and one accumulator) and block_n={BLOCK_N} "
                         f"(a quantisation group), got {c}")
    if tail is None:
        tail = bool(SWIGLU_TAIL) and config is None
    main = (swiglu_tail_split(M, F, sm_count) if tail and c.consumers == 2 and c.cluster == 1
            and not c.split_parts and c.ctas is None and M % c.block_m == 0 else None)
    if main is None:
        return _ws_call(xq, x_scale, wq, w_scale, c,
                        _SwiGLU(c, F, act_dtype, interpret=interpret), sm_count, interpret)
    outs = _ws_call(xq, x_scale, wq, w_scale, c,
                    _SwiGLU(c, F, act_dtype, blocks=main, interpret=interpret), sm_count,
                    interpret, finish=False)
    t = WsConfig.get_swiglu_tail(M, K)
    return _ws_call(xq, x_scale, wq, w_scale, t,
                    _SwiGLU(t, F, act_dtype, first=main, interpret=interpret), sm_count,
                    interpret, into=outs)


@dataclasses.dataclass(frozen=True)
class _Plain:
    """The GEMM's own epilogue: each wave's sum cast to `out_dtype`, stored by TMA in
    `epi_cols`-wide pieces through `epi_slots` swizzled SMEM slots per warpgroup."""
    c: WsConfig
    out_dtype: Any
    N: int
    parts: int = 1  # weight tiles a pipeline step loads (their first columns: `w_cols`)

    def col0(self, ni):
        """Tile ni's first column: the last tile ends at N (`WsConfig.block_n`)."""
        return jnp.minimum(ni * self.c.block_n, self.N - self.c.block_n)

    def w_cols(self, ni):
        return (self.col0(ni),)

    def n_tiles(self) -> int:  # output column tiles
        return self.c.n_tiles(self.N)

    def outputs(self, Mp: int, N: int):
        from jax.experimental.pallas import mosaic_gpu as plgpu
        c, bits = self.c, jnp.dtype(self.out_dtype).itemsize * 8
        swizzle = plgpu.find_swizzle(c.epi_cols * bits)
        tiled = (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))
        return ((jax.ShapeDtypeStruct((Mp, N), self.out_dtype),),
                [plgpu.SMEM((c.consumers, c.epi_slots, WAVE, c.epi_cols), self.out_dtype,
                            transforms=tiled)])

    def store(self, refs, sums, wg, ms, ni, first_tile):
        del first_tile  # each warpgroup stores its own rows: nothing handed over
        from jax.experimental.pallas import mosaic_gpu as plgpu
        (o_gmem, o_smem), c = refs, self.c
        pieces, n0 = c.block_n // c.epi_cols, self.col0(ni)
        for h, acc_sum in enumerate(sums):
            for p in range(pieces):
                slot = o_smem.at[wg, (h * pieces + p) % c.epi_slots]
                cols = pl.ds(n0 + p * c.epi_cols, c.epi_cols)
                # the slot's previous store must have read it
                plgpu.wait_smem_to_gmem(c.epi_slots - 1, wait_read_only=True)
                slot[...] = acc_sum[:, p * c.epi_cols:(p + 1) * c.epi_cols].astype(
                    self.out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(slot, o_gmem.at[ms].at[_wave_rows(wg, c.wg_rows, h),
                                                               cols])

    def drain(self, refs, wg):
        del refs, wg  # no barrier of its own

    def finish(self, outs, M: int, Mp: int):
        (out,) = outs
        return out if Mp == M else out[:M]


@dataclasses.dataclass(frozen=True)
class _SwiGLU:
    """`gate_up_swiglu_mgpu_ws`'s epilogue: a step loads gate block n and up block n (rows
    n 128 and F + n 128 of w); the two sums become one quantised 128-column group."""
    c: WsConfig
    F: int
    act_dtype: Any
    parts: int = 2
    first: int = 0              # the column blocks this launch computes: [first, first +
    blocks: int | None = None   # blocks), all from `first` where None (`swiglu_tail_split`)
    interpret: bool = False     # the hand-over's load (`split_parts`): no layouts there

    def w_cols(self, ni):
        n = (self.first + ni) * BLOCK_N
        return (n, self.F + n)

    def n_tiles(self) -> int:
        return self.F // BLOCK_N - self.first if self.blocks is None else self.blocks

    def outputs(self, Mp: int, N: int):
        from jax.experimental.pallas import mosaic_gpu as plgpu
        tiled = _fp8_row_tiles()  # as the x and w tiles
        G, storers = self.F // GROUP, 1 if self.c.split_parts else self.c.consumers
        scratch = [plgpu.SMEM((storers, WAVE, GROUP), FP8, transforms=tiled),
                   plgpu.SMEM((storers, WAVE), jnp.float32)]
        if self.c.split_parts:  # the up sum's buffer, and its full / free barriers
            sw = plgpu.find_swizzle(BLOCK_N * 32)
            scratch += [plgpu.SMEM((WAVE, BLOCK_N), jnp.float32, transforms=(
                plgpu.TilingTransform((8, sw * 8 // 32)), plgpu.SwizzleTransform(sw))),
                plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1)]
        return ((jax.ShapeDtypeStruct((Mp, self.F), FP8),
                 jax.ShapeDtypeStruct((G, Mp), jnp.float32)), scratch)

    def store(self, refs, sums, wg, ms, ni, first_tile):
        from jax.experimental.pallas import mosaic_gpu as plgpu
        if not self.c.split_parts:
            self._store(refs[:4], *sums, wg, ms, ni)
            return
        (acc,), (up_smem, full, free) = sums, refs[4:]

        @pl.when(wg == 1)  # the up warpgroup: its sum into the buffer once the last is read
        def _():
            pl.when(jnp.logical_not(first_tile))(lambda: plgpu.barrier_wait(free))
            up_smem[...] = acc
            plgpu.barrier_arrive(full)

        @pl.when(wg == 0)
        def _():
            plgpu.barrier_wait(full)
            up = hopper.load(up_smem, plgpu.Layout.WGMMA, self.interpret)
            plgpu.barrier_arrive(free)
            self._store(refs[:4], acc, up, 0, ms, ni)

    def drain(self, refs, wg):
        """After a CTA's last tile: the up warpgroup sees the buffer's last release (a phase
        no one waits for otherwise)."""
        from jax.experimental.pallas import mosaic_gpu as plgpu
        if self.c.split_parts:
            _, _, free = refs[4:]  # as `store` unpacks them
            pl.when(wg == 1)(lambda: plgpu.barrier_wait(free))

    def _store(self, refs, gate, up, wg, ms, ni):
        """The tile's SwiGLU, quantised, by warpgroup `wg`'s store slots and rows."""
        from jax.experimental.pallas import mosaic_gpu as plgpu
        q_gmem, s_gmem, q_smem, s_smem = refs
        gate, up = gate.astype(self.act_dtype), up.astype(self.act_dtype)  # the unfused GEMM's
        q, scale = swiglu_quantize_tile(gate, up, keepdims=False)         # output dtype
        rows = _wave_rows(wg, WAVE, 0)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores read them
        q_smem.at[wg][...] = q
        s_smem.at[wg][...] = scale
        plgpu.commit_smem()
        g = self.first + ni
        plgpu.copy_smem_to_gmem(q_smem.at[wg], q_gmem.at[ms].at[rows, pl.ds(g * GROUP, GROUP)])
        plgpu.copy_smem_to_gmem(s_smem.at[wg], s_gmem.at[g].at[ms].at[rows])

    def finish(self, outs, M: int, Mp: int):
        q, s = outs
        return q[:M], s[:, :M].T


def _fp8_row_tiles():
    """SMEM transforms of FP8 tiles with 128-byte rows (a K group): 8-row tiles, 128B swizzle."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    swizzle = plgpu.find_swizzle(GROUP * 8)
    return (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))


def _ws_call(xq, x_scale, wq, w_scale, c: WsConfig, epilogue, sm_count: int,
             interpret: bool, into: tuple | None = None, finish: bool = True):
    """The persistent warp-specialised kernel (module docstring) with `epilogue`'s weight
    tiles per output tile, outputs and store (`_Plain` or `_SwiGLU`). `into`: the padded
    outputs of an earlier launch (`finish` False there), which this one writes its tiles
    into in place of new ones."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if c.probe and interpret:
        raise ValueError(f"probe {c.probe!r} times the compiled kernel; the interpreter has "
                         f"no wgmma accumulator to carry")
    M, K = xq.shape
    N = wq.shape[0]
    G, bm, tn, waves = K // GROUP, c.block_m, c.block_n, c.wg_rows // WAVE
    sg, kb = c.step_groups, c.step_groups * GROUP  # K groups and columns per pipeline step
    parts = epilogue.parts
    split = c.split_parts
    if split and parts != 2:
        raise ValueError("split_parts is the SwiGLU kernel's (two weight blocks a tile)")
    sums_wg = waves if split else waves * parts  # running sums a consumer carries
    pair_m = c.cluster == 2 and c.cluster_dim == "m"
    pair_n = c.cluster == 2 and c.cluster_dim == "n"
    cluster_m = bm * (2 if pair_m else 1)
    Mp = pl.cdiv(M, cluster_m) * cluster_m
    if Mp != M:
        xq = jnp.pad(xq, [(0, Mp - M), (0, 0)])
        x_scale = jnp.pad(x_scale, [(0, Mp - M), (0, 0)])
    xs_GM = x_scale.T
    m_iters = Mp // cluster_m
    n_iters = epilogue.n_tiles() // (2 if pair_n else 1)
    clusters = min((c.ctas or sm_count) // c.cluster, m_iters * n_iters)

    tiled = _fp8_row_tiles()
    share_x = ("cluster",) if pair_n else ()  # the pair multicasts what both of them read
    share_w = ("cluster",) if pair_m else ()
    # A group's w scales a tile reads: 64 copies of its block's ([G, N / 128 * 64]) or one
    # per column ([G, N]), widened here every call (1.5 MB at either FFN GEMM: an XLA
    # fusion before each call; read as stored, a scalar a group from shared memory, they
    # made the step slower: RESULTS.md thirty-eighth session).
    ws_cols = tn if c.column_scales else WAVE
    ws_G = jnp.repeat(w_scale.T, BLOCK_N if c.column_scales else WAVE, axis=1)
    in_specs = [
        plgpu.BlockSpec((bm, kb), lambda g: (0, g), transforms=tiled, collective_axes=share_x),
        plgpu.BlockSpec((sg, bm), lambda g: (g, 0), collective_axes=share_x)] + [
        plgpu.BlockSpec((tn, kb), lambda g: (0, g), transforms=tiled, collective_axes=share_w),
        # column scales each CTA loads itself: split between a pair, the second half of a
        # 96-column row would land 192 bytes in (TMA wants 128-byte aligned SMEM)
        plgpu.BlockSpec((sg, ws_cols), lambda g: (g, 0),
                        collective_axes=() if c.column_scales else share_w)] * parts

    def pipeline(body, context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(G // sg,), memory_registers=c.memory_registers,
            max_concurrent_steps=c.stages,
            wg_axis="wg", num_compute_wgs=c.consumers, in_specs=in_specs,
            compute_context=context,
            pipeline_state=state)

    def zeros():  # built inside the kernel: kernels capture no constants
        return hopper.layout_cast(jnp.zeros((WAVE, tn), jnp.float32), plgpu.Layout.WGMMA,
                                  interpret)

    out_types, scratch_types = epilogue.outputs(Mp, N)

    def kernel(x_gmem, xs_gmem, w_gmem, ws_gmem, *refs):
        wg = jax.lax.axis_index("wg")
        cta = jax.lax.axis_index("cluster")

        def body(_, x_smem, xs_smem, *w_and_sums):
            *w_smems, sums = w_and_sums
            if c.probe == "carry_acc":  # `sums` are the waves' accumulators: no promotion
                w_smem = w_smems[0]
                for h, acc in enumerate(sums):
                    for j in range(sg):
                        plgpu.wgmma(acc, _group(x_smem.at[_wave_rows(wg, c.wg_rows, h)], j, sg),
                                    _group(w_smem, j, sg).transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return sums
            if split:  # this warpgroup's part (0 gate, 1 up) over the tile's rows
                def part(p):
                    return lambda: _promote_step(x_smem, xs_smem, w_smems[2 * p],
                                                 w_smems[2 * p + 1], sums, 0, c, interpret)
                return jax.lax.cond(wg == 0, part(0), part(1))
            out = ()
            for p in range(parts):  # part p's waves: its weight block's running sums
                out += _promote_step(x_smem, xs_smem, w_smems[2 * p], w_smems[2 * p + 1],
                                     sums[p * waves:(p + 1) * waves], wg, c, interpret)
            return out

        def ignore(*_, **__):
            return None
        gmem_in = (x_gmem, xs_gmem) + (w_gmem, ws_gmem) * parts
        allocs = pipeline(ignore, ignore).get_allocations(*gmem_in)

        @functools.partial(pl.run_scoped, allocations=allocs, collective_axes="wg")
        def _(allocations):
            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
            def _(info):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters),
                                            0 if c.snake_dim == "m" else 1, c.snake_width)
                if pair_m:
                    mi = 2 * mi + cta
                if pair_n:
                    ni = 2 * ni + cta
                ms = pl.ds(mi * bm, bm)
                state, first_tile = None, info.local_index == 0
                if c.steady:  # the first tile fills the pipeline, later ones run on
                    state = jnp.where(first_tile, plgpu.PipelinePipeline.START,
                                      plgpu.PipelinePipeline.STEADY).astype(jnp.int32)

                def context(run):
                    if c.probe != "carry_acc":
                        epilogue.store(refs, run((zeros(),) * sums_wg), wg, ms, ni, first_tile)
                        return

                    def scoped(*accs):  # zeroed once per tile, summed into over all of K
                        run(accs)
                        epilogue.store(refs, tuple(plgpu.wgmma_accumulator_load(a, wait_n=0)
                                                   for a in accs), wg, ms, ni, first_tile)
                    pl.run_scoped(scoped, *[plgpu.ACC((WAVE, tn), jnp.float32)] * waves)
                w_in = ()
                for n0 in epilogue.w_cols(ni):
                    s0 = n0 if c.column_scales else n0 // BLOCK_N * WAVE
                    w_in += (w_gmem.at[pl.ds(n0, tn)], ws_gmem.at[:, pl.ds(s0, ws_cols)])
                pipeline(body, context, state)(x_gmem.at[ms], xs_gmem.at[:, ms], *w_in,
                                               allocations=allocations)

            epilogue.drain(refs, wg)
            if c.steady:  # drain: what STOP would do after the last tile (every CTA has one)
                @pl.when(wg == c.consumers)  # the producer
                def _():
                    [consumed] = allocations["flat_consumed_barrier_refs"]
                    for s in range(c.stages):
                        plgpu.barrier_wait(consumed.at[s])
        plgpu.wait_smem_to_gmem(0)

    mesh = dict(grid=(clusters,), grid_names=("cluster_grid",), cluster=(c.cluster,),
                cluster_names=("cluster",), num_threads=c.consumers + 1, thread_name="wg")
    run_interpreted = hopper.interpret_params() if interpret else None
    if into is None:
        outs = plgpu.kernel(kernel, out_type=out_types, scratch_types=scratch_types,
                            interpret=run_interpreted, **mesh)(xq, xs_GM, wq, ws_G)
    else:  # an earlier launch's outputs, written in place (mutable refs, as FACache's)
        out_refs = [jax.new_ref(o, memory_space=plgpu.GMEM) for o in into]

        def entry(*refs):
            pl.run_scoped(lambda *scratch: kernel(*refs, *scratch), *scratch_types,
                          collective_axes="wg")
        pl.kernel(entry, out_type=(), mesh=plgpu.Mesh(**mesh),
                  interpret=run_interpreted or False, name=f"{kernel.__name__}_into")(
            xq, xs_GM, wq, ws_G, *out_refs)
        outs = tuple(r[...] for r in out_refs)
    return epilogue.finish(outs, M, Mp) if finish else outs
