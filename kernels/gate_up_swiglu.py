"""The FP8 FFN's gate/up GEMM with SwiGLU and the 1 x 128 quantisation of its output in the
GEMM's epilogue (REFERENCE.md §7): the bf16 [M, 2F] gate | up product is never written, and
the SwiGLU + quantisation kernel (and at decode rows the split-K sum) is not launched.

Shapes: xq [M, K] fp8 e4m3 with x_scale [M, K / 128] (the RMSNorm's quantised output), wq
[2F, K] fp8 (gate rows, then up rows) with w_scale [2F / 128, K / 128]; out (aq [M, F] fp8,
a_scale [M, F / 128] f32), what `fused_quant.swiglu_quant` gives on the GEMM's output.
`gate_up_swiglu_quant_ref` is that composition on the references; `takes` says where the
dispatch (`quant.ffn_fp8`) runs a fused kernel, `gate_up_swiglu_quant` as it runs it there:
this Triton kernel at decode rows (`FUSE`), or from `MGPU_MIN_M` rows on Hopper the Mosaic
GPU kernel with the same epilogue (`fp8_matmul_mgpu_ws.gate_up_swiglu_mgpu_ws`). The first
off as shipped, the second on from batch 1's full canvas (768 rows).

The Triton kernel is `fp8_matmul_triton`'s GEMM on the same grid and tiles (row tile i,
column tile j of the 2F, K split k), which at decode rows (M <= 32, where the dispatch takes
it) are [128 columns x 32 rows] transposed tiles with K split 2 ways (LLaDA-8B): each program
leaves its fp32 partial in HBM, and the last of the 2 x splits programs of a column pair
(gate tile j, up tile j + F / 128: an atomic count) sums the partials in split order, rounds
gate and up to the activation dtype as the GEMM's output is, and applies SwiGLU and the
quantisation exactly as `fused_quant`'s kernel does. With at most 2 splits the sums are the
unfused path's bit for bit (one fp32 addition; XLA's sum over more splits may associate
otherwise: tensor-parallel shards' narrower F splits K more).

What it saves at the dual step's 32 rows (H200, RESULTS.md twenty-second and twenty-fourth
sessions' traces): the SwiGLU + quantisation kernel (2.5 us a layer), the split-K sum of
gate/up (its own fusion before that kernel) and the bf16 product's round trip. On an H100
(RESULTS.md thirty-second session) its GPU tests pass, bit for bit the unfused kernels at
LLaDA's widths, and the FFN alone at 32 rows takes 1.7% less device time, but the batch-1
dual step runs 1.6% slower with it (5.48 against 5.39 ms, twice each, alternated in one
process), so the dispatch leaves it off (`FUSE`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import fp8_matmul_triton as tr
from kernels.fp8_matmul import GROUP, fp8_matmul_ref
from kernels.fused_quant import FP8, swiglu_quant_ref, swiglu_quantize_tile


def gate_up_swiglu_quant_ref(xq, x_scale, wq, w_scale, act_dtype=jnp.bfloat16):
    """The unfused composition: the GEMM rounded to `act_dtype`, then SwiGLU + quantisation."""
    return swiglu_quant_ref(fp8_matmul_ref(xq, x_scale, wq, w_scale, act_dtype))


def _kernel(x_ref, xs_ref, w_ref, ws_ref, count_in, q_ref, s_ref, count_ref, part_ref, *,
            n_groups, splits, pairs, swap, act_dtype, group_major, interpret):
    """Program (i, j, k): the GEMM's tile, its fp32 partial stored; the pair's last program
    finishes the pair's columns (module docstring)."""
    del count_in  # aliased to count_ref
    i, j, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm, bn = x_ref.shape[0], w_ref.shape[0]
    accs = tr.accumulate(x_ref, xs_ref, w_ref, ws_ref, k * n_groups, n_groups, swap)
    r = pl.ds(i * bm, bm)
    pair = jax.lax.rem(j, jnp.int32(pairs))
    last = tr.finish_split(part_ref, count_ref, accs, r=r, col=j * bn, k=k,
                           slot=i * jnp.int32(pairs) + pair, arrivals=2 * splits, swap=swap,
                           interpret=interpret)

    @pl.when(last)
    def _():
        def total(col):  # the GEMM's output, rounded as it is
            return tr.split_sum(part_ref, r, col, GROUP, splits).astype(act_dtype)
        for c in range(bn // GROUP):
            col = pair * bn + c * GROUP
            q, scale = swiglu_quantize_tile(total(col), total(pairs * bn + col))
            q_ref[r, pl.ds(col, GROUP)] = q
            g = pair * (bn // GROUP) + c
            if group_major:
                s_ref[pl.ds(g, 1), r] = scale.reshape(1, bm)
            else:
                s_ref[r, pl.ds(g, 1)] = scale


@functools.partial(jax.jit, static_argnames=("act_dtype", "tiles", "interpret", "poison",
                                             "group_major"))
def gate_up_swiglu_quant_pallas(xq, x_scale, wq, w_scale, act_dtype=jnp.bfloat16, *,
                                tiles: tr.TritonTiles | None = None, interpret: bool = False,
                                poison: bool = False, group_major: bool = False):
    """The fused Triton kernel (module docstring); `tiles` as `fp8_matmul_pallas`'s (default:
    `TritonTiles.get_default(M, 2F, K)`), with columns in whole 128-wide groups. `poison`
    (tests): the outputs start NaN-filled, so an unwritten group shows. `group_major`: the
    scales are written [F / 128, M] (the layout the down GEMM of these rows reads) and the
    [M, F / 128] transpose is returned."""
    M, K = xq.shape
    N = wq.shape[0]
    t = tiles or tr.TritonTiles.get_default(M, N, K)
    if N % (2 * GROUP):
        raise ValueError(f"gate|up needs 2F rows with F a multiple of {GROUP}, got {N}")
    if t.block_n % GROUP or (N // 2) % t.block_n:
        raise ValueError(f"block_n {t.block_n} must be a multiple of {GROUP} dividing F "
                         f"{N // 2} (a gate tile and its up tile end in whole groups)")
    args, in_specs, Mp = tr.operands(xq, x_scale, wq, w_scale, t)
    F, S, bm, bn = N // 2, t.splits, t.block_m, t.block_n
    pairs, G = F // bn, F // GROUP
    s_shape = (G, Mp) if group_major else (Mp, G)
    counts = jnp.zeros((Mp // bm * pairs,), jnp.int32)  # one per row tile and column pair
    out_shape = [jax.ShapeDtypeStruct((Mp, F), FP8),
                 jax.ShapeDtypeStruct(s_shape, jnp.float32),
                 jax.ShapeDtypeStruct(counts.shape, jnp.int32),
                 jax.ShapeDtypeStruct((S, Mp, N), jnp.float32)]
    poisoned = ([jnp.full((Mp, F), jnp.nan, FP8), jnp.full(s_shape, jnp.nan, jnp.float32)]
                if poison else [])
    whole = pl.no_block_spec

    def body(x_ref, xs_ref, w_ref, ws_ref, count_in, *refs):
        _kernel(x_ref, xs_ref, w_ref, ws_ref, count_in, *refs[len(poisoned):],
                n_groups=K // GROUP // S, splits=S, pairs=pairs, swap=t.swap,
                act_dtype=act_dtype, group_major=group_major, interpret=interpret)

    q, s, _, _ = pl.pallas_call(
        body, grid=(Mp // bm, N // bn, S), in_specs=in_specs + [whole] * (1 + len(poisoned)),
        out_specs=[whole] * 4, out_shape=out_shape, interpret=interpret,
        name="fp8_gate_up_swiglu", compiler_params=tr.compiler_params(t),
        input_output_aliases={4: 2, **{5 + n: n for n in range(len(poisoned))}},
    )(*args, counts, *poisoned)
    return q[:M], (s[:, :M].T if group_major else s[:M])


# Whether the dispatch fuses where it can (`takes`). Off: slower in the dual step on an H100
# (module docstring). Read when the FFN is traced: set it before the first call (the
# benchmarks' `--settings` time it both ways).
FUSE = 0


# Rows from which the dispatch runs the gate/up GEMM with SwiGLU + quantisation in the
# epilogue of the Mosaic GPU kernel (`fp8_matmul_mgpu_ws.gate_up_swiglu_mgpu_ws`) on Hopper,
# in place of cuBLASLt's GEMM and the SwiGLU kernel; 0: never. Timed on an H100 (RESULTS.md
# thirty-fifth session): at batch 8's 4,608 rows the FFN 1.16 ms of kernels against 1.21,
# batch 8's step at 6,144 rows 112.9 ms against 115.4 (its GEMM 8% slower than cuBLASLt's,
# the SwiGLU kernel's 4.6 ms gone), the same tokens; at batch 1's 768 rows (thirty-sixth) the
# FFN 0.234 ms against 0.238, the exact + FP8 step 16.12-16.16 ms against 16.19-16.24, the
# same tokens. Below 768 rows (DPad's compact canvases) untimed, so off there.
# Read when the FFN is traced, as FUSE.
MGPU_MIN_M = 768


def takes_mgpu(M: int, F: int, K: int) -> bool:
    """Whether the dispatch fuses into the Mosaic GPU kernel: `MGPU_MIN_M` set and reached, on
    Hopper, F and K in whole 128-wide groups, and M in whole 128-row tiles: the FFN pads its
    rows to 16 only, and the kernel's own padding to 128 would add copies of x, the FP8
    output and its scales (56 MB near 4,600 rows) that fuse into no custom call."""
    if not MGPU_MIN_M or M < MGPU_MIN_M or M % GROUP or jax.default_backend() != "gpu":
        return False
    from kernels import fp8_matmul as fm
    return fm.compute_capability()[0] == 9 and F % GROUP == 0 and K % GROUP == 0


def takes(M: int, F: int, K: int) -> bool:
    """Whether the dispatch fuses: into the Mosaic GPU kernel where `takes_mgpu`; else (with
    `FUSE`) on a GPU, where the FP8 GEMM of these rows is the Triton kernel
    (`fp8_matmul._kernel_for`) at decode rows (its transposed tiles, up to 32 rows: there K is
    split and the split-K sum is saved too; with more rows a tile's fp32 partial, 8 bytes an
    output element against the bf16 product's 4, may cost more than the SwiGLU kernel it
    saves, unmeasured) and its default column tile ends in whole groups of gate and of up."""
    if takes_mgpu(M, F, K):
        return True
    if not FUSE or jax.default_backend() != "gpu" or not tr.swapped(M):
        return False
    from kernels import fp8_matmul as fm
    if fm.compute_capability() < (8, 9) or fm._kernel_for(M) != "triton":
        return False
    bn = tr.TritonTiles.get_default(M, 2 * F, K).block_n
    return bn % GROUP == 0 and F % bn == 0


def gate_up_swiglu_quant(xq, x_scale, wq, w_scale, act_dtype=jnp.bfloat16):
    """The fused kernel as the dispatch runs it where `takes` (the caller asks; elsewhere
    `quant.ffn_fp8` runs the GEMM and `fused_quant.swiglu_quant`): the Mosaic GPU one where
    `takes_mgpu`, else the Triton one; scales written in the layout the down GEMM of these
    rows reads. wq holds one gate | up column group (all gate rows, then all up rows): a
    layout of several groups (`quant.FP8FFN.tp` above the shards running it) must be
    reordered first, as `quant.ffn_fp8` does."""
    from kernels.fp8_matmul import scales_group_major
    M, K = xq.shape
    if takes_mgpu(M, wq.shape[0] // 2, K):  # its scales written group-major
        from kernels.fp8_matmul import sm_count
        from kernels.fp8_matmul_mgpu_ws import gate_up_swiglu_mgpu_ws
        return gate_up_swiglu_mgpu_ws(xq, x_scale, wq, w_scale, act_dtype,
                                      sm_count=sm_count())
    return gate_up_swiglu_quant_pallas(xq, x_scale, wq, w_scale, act_dtype,
                                       group_major=scales_group_major(M))
