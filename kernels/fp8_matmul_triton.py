"""The per-group FP8 GEMM (contract: `kernels/fp8_matmul.py::fp8_matmul_ref`) lowered through
Pallas' Triton backend, with its tile settings (`TritonTiles`).

A program computes `block_m` x `block_n` outputs (`block_n` a multiple of 128, or 16, 32 or 64
columns inside one 128-wide weight-scale block), M padded to the row tile; at decode shapes K
is also split over programs (`splits`) and the fp32 partials are summed afterwards by XLA.
Each 128-wide K group is one FP8 dot, scaled and added to an fp32 accumulator: the result
equals the dequantised fp32 matmul up to fp32 summation order. On Hopper the dispatch gives
it up to 32 rows (cuBLASLt above: RESULTS.md); runs on every GPU with FP8 tensor cores (Ada,
Hopper).

At 32 rows the kernel reads its weights at 1.4 (down) and 2.1 (gate/up) TB/s on an H100,
where the bf16 FFN reads at 2.7 (RESULTS.md, thirty-second session). Three tile options were
built to close that gap, measured slower or no faster, and removed after commit d4e0970 (the
last that has them, with their tests, sweep axes and device_plan.sh stages):
- `prefetch` loaded the operands of the next K groups before a group's dots and carried them
  through the loop in registers (the same sums in the same order), so the weight reads were
  issued ahead even where Triton's software pipeline (`num_stages`) does not issue them. On
  an H100 at 32 rows (3 stages, 4 warps) one group ahead took 1.65-1.78x the time (RESULTS.md,
  thirty-third session): in Triton 3.9's PTX its loop had no cp.async left, the pipeline off.
- `programs` made the grid persistent: a row tile's (column tile, K split) items cut into
  that many contiguous ranges, each program running its range's K groups as one flat loop
  (the same sums in the same order, bit for bit on the GPU too), to pay the pipeline's fill
  once a program rather than once a tile. On an H100 at 32 rows it took 1.2-1.4x the time:
  264 programs 32.2-32.7 us against 25.7-26.6 for down, and 50.8-51.8 against 44.4-45.0 for
  gate/up; 132 programs were slower still (RESULTS.md, thirty-third session).
- `scales_ahead` loaded a program's K-group scales once, before its loop, as vectors, each
  group's picked from registers by a masked sum (exact). In PTX of the down GEMM at 32 rows
  the loop otherwise waits on 5 plain global loads a group, the scales, which Triton's
  pipeline does not issue ahead (it copies only the dots' operands, by cp.async); with it the
  loop had none, for 3 shared stores and 4 more barriers. Yet on an H200 it changed the
  default tiles' time by 0-1% and the batch-1 dual step not at all (4.44 ms both ways;
  RESULTS.md, thirty-fourth session).
Two epilogues built on its split-K grid went after commit a5b878e, both slower in the step:
- `sum_in_kernel`: the last of a tile's split programs to finish (an atomic count a tile)
  summed the fp32 partials in split order and wrote the output, where XLA sums them after
  the kernel. The partials at the dual step's 32 rows (down: 12 splits, 6.3 MB written and
  read again) are a quarter of the down GEMM's weight bytes, yet the FFN at 32 rows took 15%
  longer on an H100 (85.4 against 74.4 us of device time, RESULTS.md thirty-second session;
  each tile's last program reads the 12 partials alone, after the others).
- The gate/up GEMM with SwiGLU + quantisation in that epilogue (`gate_up_swiglu.FUSE`: the
  bf16 product, its split-K sum and the SwiGLU kernel saved at decode rows): bit for bit the
  unfused kernels and the FFN alone 1.7% faster at 32 rows, but the batch-1 dual step 1.6%
  slower (5.48 against 5.39 ms, alternated; RESULTS.md thirty-second session).

`swap` computes each tile transposed, out^T = W @ x^T, so that at decode shapes the 128 weight
rows of a column block sit on the MMA's M side (Hopper's wgmma takes 64 rows per warpgroup
there) and the few tokens on its N side, which may be as narrow as 8; both operands stay
K-major, as FP8 MMAs require. Measured 1.09x at M 32 on the H200. Yet in Triton 3.9's own
compile of the lowered module (`benchmarks/triton_ptx.py`, CPU) the swapped 32-row tile's
dots are `mma.sync` (64 a K loop iteration), not wgmma; XLA's Triton is unchecked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import fp8_matmul as fm

GROUP = fm.GROUP


def k_splits(m_tiles: int, n_tiles: int, n_groups: int, programs: int = 264) -> int:
    """Split K when the output tiles alone are too few to fill the GPU (decode shapes): the
    smallest divisor of the group count giving >= `programs` (2 per SM on an H200)."""
    for s in range(1, n_groups + 1):
        if n_groups % s == 0 and (m_tiles * n_tiles * s >= programs or s == n_groups):
            return s
    return 1


def row_tile(M: int) -> int:
    """Rows per program: the smallest power of two >= M in [16, 64]. (16 is Triton's smallest
    dot tile; on the H200 64 x 128 tiles beat 128 x 128 and 64 x 256 at M 4096 and 16384:
    `benchmarks/fp8_tiles.py`, RESULTS.md.)"""
    return min(64, max(16, 1 << (M - 1).bit_length()))


def swapped(M: int) -> bool:
    """Whether the default tiles compute each tile transposed (`TritonTiles.swap`): row tiles
    of up to 32 rows, the decode shapes. The activation scales are then read K-group-major."""
    return row_tile(M) <= 32


@dataclasses.dataclass(frozen=True)
class TritonTiles:
    """Tile settings of `fp8_matmul_pallas` (hashable: a static jit argument)."""
    block_m: int = 64      # rows per program (M is padded to a multiple)
    block_n: int = GROUP   # columns per program: a multiple of 128 dividing N, or 16, 32, 64
    #                        (narrow tiles: more programs at decode shapes, fewer K splits)
    splits: int = 1        # programs over K (fp32 partials summed afterwards); divides K / 128
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False     # out^T = W @ x^T per tile: weights on the MMA's wide side (decode)

    @classmethod
    def get_default(cls, M: int, N: int, K: int) -> TritonTiles:
        """As measured by `benchmarks/fp8_tiles.py` on the H200: the row tile by M
        (`row_tile`), 128 columns, K split until ~2 programs per SM (`k_splits`), 4 warps;
        tiles of up to 32 rows transposed (`swap`). At M 32 (2026-12-03, RESULTS.md) the four
        swapped 32-row settings took 0.077-0.079 ms for gate/up + down together, every unswapped
        one 0.080-0.090. Narrow columns (fewer K splits) do not pay at M 32: the down GEMM
        (K 12288) took a median of 0.029 ms in 128 columns split 12 ways and 0.029-0.034 in 64
        columns split 6 or 12 (seventeenth session, 5 rounds); at M 16 one untransposed
        64-column tile was ~10% faster (0.026 against 0.029) in that run, ranges overlapping:
        not adopted; one sixteenth-session sweep's 0.040 for 128 columns did not recur. 4
        warps and 3 stages the fastest by a margin under the run's spread. GPUs other than the
        H200 (Ada has no wgmma) are unmeasured."""
        bm = row_tile(M)
        splits = k_splits(pl.cdiv(M, bm), N // GROUP, K // GROUP)
        return cls(block_m=bm, block_n=GROUP, splits=splits, num_warps=4, swap=swapped(M))


# maxNumImpreciseAcc of the FP8 dots Pallas lowers to Triton (0: unset, as Pallas leaves it).
# Triton's own `tl.dot` sets 2**30 for FP8; unset, Triton refuses Hopper's wgmma for an FP8
# dot with an f32 result and upcasts both operands to f16 for mma.sync (Triton 3.9's
# compile of our module: the down GEMM's K loop 505 instructions with 64 mma.sync, against
# 282 with 8 wgmma at 32 (187 at 2**30); benchmarks/triton_ptx.py, RESULTS.md thirty-third
# session). Set, the tensor cores accumulate that many products before each fp32 add: 32
# (one wgmma's K) is the least that allows wgmma; every 128-wide group is scaled into fp32
# anyway. Read when a kernel is lowered (a module switch: set it before the first call).
# 0: at 32 on an H200 the bits change (relative error 4.5e-5) and the batch-1 dual step does
# not get faster (4.46 against 4.43-4.44 ms; RESULTS.md, thirty-fourth session): the decode
# GEMMs wait on their weights, not on the MMA.
IMPRECISE_ACC = 0


def _install_fp8_dot_rule():
    """Wrap Pallas' Triton rule for dot_general so that an FP8 x FP8 dot gets
    maxNumImpreciseAcc = IMPRECISE_ACC where that is set (read at lowering time)."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering
    except ImportError:  # another jax layout: the dots stay as Pallas lowers them
        return
    original = lowering.triton_lowering_rules[jax.lax.dot_general_p]
    if getattr(original, "fp8_imprecise_acc", False):
        return

    def rule(ctx, a, b, **params):
        out = original(ctx, a, b, **params)
        fp8 = all(aval.dtype == jnp.float8_e4m3fn for aval in ctx.avals_in)
        op = getattr(out, "owner", None)
        op = getattr(op, "operation", op)
        if IMPRECISE_ACC and fp8 and op is not None and op.name == "tt.dot":
            op.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(
                ir.IntegerType.get_signless(32), int(IMPRECISE_ACC))
        return out
    rule.fp8_imprecise_acc = True
    lowering.triton_lowering_rules[jax.lax.dot_general_p] = rule


_install_fp8_dot_rule()


def accumulate(x_ref, xs_ref, w_ref, ws_ref, first, n_groups: int, swap: bool):
    """This program's fp32 sums over K groups [first, first + n_groups), one per 128-wide
    weight block of its columns: [128, bm] each where `swap` (out^T; `xs_ref` then holds the
    activation scales transposed, [G, bm]), else [bm, 128] (`xs_ref` [bm, G])."""
    sub = min(w_ref.shape[0], GROUP)  # column block with one weight scale per K group
    n_sub = w_ref.shape[0] // sub

    def add_group(i, accs):
        g = first + i
        cols = pl.ds(g * GROUP, GROUP)
        x = x_ref[:, cols]
        xs = xs_ref[pl.ds(g, 1), :] if swap else xs_ref[:, pl.ds(g, 1)]
        ws = tuple(w_ref[pl.ds(c * sub, sub), cols] for c in range(n_sub))
        w_scales = tuple(ws_ref[c, pl.ds(g, 1)] for c in range(n_sub))
        return tuple(
            acc + (jnp.dot(w, x.T, preferred_element_type=jnp.float32) if swap else
                   jnp.dot(x, w.T, preferred_element_type=jnp.float32)) * (xs * w_scale)
            for acc, w, w_scale in zip(accs, ws, w_scales))

    zeros = (jnp.zeros((sub, x_ref.shape[0]) if swap else (x_ref.shape[0], sub),
                       jnp.float32),) * n_sub
    return jax.lax.fori_loop(0, n_groups, add_group, zeros)


def _kernel(x_ref, xs_ref, w_ref, ws_ref, *refs, n_groups, n_poisoned, swap):
    o_ref = refs[n_poisoned]  # poisoned inputs alias the output; never read
    first = pl.program_id(2) * n_groups  # this program's share of K (split-K)
    accs = accumulate(x_ref, xs_ref, w_ref, ws_ref, first, n_groups, swap)
    sub = min(w_ref.shape[0], GROUP)
    for c, acc in enumerate(accs):
        o_ref[:, pl.ds(c * sub, sub)] = (acc.T if swap else acc).astype(o_ref.dtype)


def operands(xq, x_scale, wq, w_scale, t: TritonTiles):
    """The grid's operands and their blocks for tiles `t`: (x, its scales, w, its scales)
    with M padded to the row tile, the activation scales transposed where `t.swap`; their
    BlockSpecs over the grid (row tile i, column tile j, K split k); Mp."""
    fm._check(xq, x_scale, wq, w_scale)
    M, K = xq.shape
    N = wq.shape[0]
    bm, bn, S, G = t.block_m, t.block_n, t.splits, K // GROUP
    if (bn % GROUP if bn >= GROUP else bn not in (16, 32, 64)) or N % bn:
        raise ValueError(f"block_n {bn} must be 16, 32, 64 or a multiple of {GROUP}, dividing "
                         f"N {N}")
    if G % S:
        raise ValueError(f"splits {S} must divide the {G} K groups")
    Mp = pl.cdiv(M, bm) * bm
    if Mp != M:
        xq = jnp.pad(xq, [(0, Mp - M), (0, 0)])
        x_scale = jnp.pad(x_scale, [(0, Mp - M), (0, 0)])
    if t.swap:
        x_scale = x_scale.T  # [G, Mp]: a group's scales load as one row of the tile's width
    in_specs = [pl.BlockSpec((bm, K), lambda i, j, k: (i, 0)),
                pl.BlockSpec((G, bm), lambda i, j, k: (0, i)) if t.swap else
                pl.BlockSpec((bm, G), lambda i, j, k: (i, 0)),
                pl.BlockSpec((bn, K), lambda i, j, k: (j, 0)),
                # a narrow tile's one scale row: block row j * bn // 128 (blocks of one row)
                pl.BlockSpec((bn // GROUP, G), lambda i, j, k: (j, 0)) if bn >= GROUP else
                pl.BlockSpec((1, G), lambda i, j, k: (j * bn // GROUP, 0))]
    return (xq, x_scale, wq, w_scale), in_specs, Mp


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiles", "interpret", "poison"))
def fp8_matmul_pallas(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16, *,
                      tiles: TritonTiles | None = None, interpret: bool = False,
                      poison: bool = False):
    """The Pallas (Triton lowering) kernel; same contract as `fp8_matmul_ref`:
    xq [M, K] fp8, x_scale [M, K / 128] f32, wq [N, K] fp8, w_scale [N / 128, K / 128] f32
    -> [M, N] `out_dtype`. `tiles` default: `TritonTiles.get_default(M, N, K)`. `poison`
    (tests) makes the output a NaN-filled buffer first, so an unwritten tile shows."""
    from jax.experimental.pallas import triton as plgpu
    M, K = xq.shape
    N = wq.shape[0]
    t = tiles or TritonTiles.get_default(M, N, K)
    args, in_specs, Mp = operands(xq, x_scale, wq, w_scale, t)
    bm, bn, S, G = t.block_m, t.block_n, t.splits, K // GROUP
    # [S, Mp, N]: fp32 partials of the S K splits (summed by XLA below), or the output itself
    out_shape = jax.ShapeDtypeStruct((S, Mp, N), out_dtype if S == 1 else jnp.float32)
    poisoned = [jnp.full(out_shape.shape, jnp.nan, out_shape.dtype)] if poison else []
    out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, k: (k, i, j))
    out = pl.pallas_call(
        functools.partial(_kernel, n_groups=G // S, n_poisoned=len(poisoned), swap=t.swap),
        grid=(Mp // bm, N // bn, S), in_specs=in_specs + [out_spec] * len(poisoned),
        out_specs=out_spec, out_shape=out_shape, interpret=interpret, name="fp8_matmul",
        input_output_aliases={4: 0} if poison else {},
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
    )(*args, *poisoned)
    return (out[0] if S == 1 else out.sum(0)).astype(out_dtype)[:M]
