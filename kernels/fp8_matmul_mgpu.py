"""The per-group FP8 GEMM (contract: `kernels/fp8_matmul.py::fp8_matmul_ref`) lowered through
Pallas' Mosaic GPU backend (Hopper only: TMA + wgmma), with its pipeline settings (`MgpuConfig`).

Per pipeline step one or more 128-wide K groups of FP8 tiles arrive by TMA; each group's wgmma
sums it into a fresh fp32 accumulator and its two scales fold it into the running fp32 sum in
registers (promotion every group, as DeepSeek-V3 does). Hopper's FP8 wgmma sums a group's
products with about 14 significant bits rather than fp32's 24 (DeepSeek-V3 report, section
3.3.2), so the result is within ~2^-13 of the exact per-group one. 2x the Triton kernel from
M 256 (RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import fp8_matmul as fm
from kernels import hopper

GROUP = fm.GROUP


# `MgpuConfig.get_decode`'s pipeline (read when traced, so that benchmarks can set them): the
# weight rows a CTA, the TMA steps in flight (fewer where they do not fit), and the K splits:
# the fewest giving at least `DECODE_CTAS` CTAs. The fastest at 32 rows on an H100
# (`fp8_tiles --kernels mgpu_swap`, fiftieth session): 64 rows, 4 steps, 384 CTAs for
# gate/up (no split); for down 64 rows, 4 steps of 2 K groups, 256 CTAs (K split 4 ways).
# One group a step here (the FFN's and the step's timings ran so; down's sweep printed its
# best only).
DECODE_BLOCK_N = 64
DECODE_STAGES = 4
DECODE_CTAS = 256
# 1: `MgpuConfig.scale_row` where K allows it (off: not yet timed on a GPU)
DECODE_SCALE_ROW = 0


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Pipeline settings of `fp8_matmul_mgpu` (hashable: a static jit argument)."""
    block_n: int = 128             # output columns per CTA: a multiple of 64, <= 256, dividing
    #                                N (swap: 64 or 128 weight rows)
    stages: int = 4                # TMA steps in flight
    warp_specialized: bool = True  # two compute warpgroups + one TMA warpgroup per CTA
    groups_per_step: int = 1       # 128-wide K groups per TMA step
    splits: int = 1                # CTAs over K (fp32 partials summed afterwards)
    ctas: int | None = None        # persistent CTAs looping over the output tiles
    # Decode rows: the weight tile on wgmma's M side (`block_n` rows, 64 a wgmma) and x's rows,
    # padded to a multiple of 32, on its N side, so that few rows pad to 32, not 64 (one
    # warpgroup, no persistent CTAs). The output is written transposed and turned by XLA.
    swap: bool = False
    # swap: the CTA's block of w scales (one row of G) copied to shared memory once, before
    # its pipeline, instead of 32 copies a block made by XLA each call (off until timed)
    scale_row: bool = False

    @classmethod
    def get_default(cls, M: int, N: int, K: int, sms: int = 132) -> MgpuConfig:
        """As measured by `benchmarks/fp8_tiles.py` on the H200 (RESULTS.md). With fewer
        128 x 128 output tiles than SMs (the down GEMM at M 256: 64 tiles) each CTA walks a
        long K loop: two K groups per TMA step with 2 steps in flight beat 1 with 4 (0.068 vs
        0.075-0.089 ms). With a few tiles per SM (gate/up at M 256: 384) 1 group x 4 steps
        wins (0.090 vs 0.108 ms). With many (M 4096) persistent CTAs at 2 groups x 2 steps win
        (down 0.467 vs 0.498, gate/up 1.187 vs 1.212 ms). Two groups per step need an even
        group count."""
        tiles = -(-M // 128) * (N // 128)
        if (K // GROUP) % 2 or sms <= tiles < 4 * sms:
            return cls()
        if tiles < sms:
            return cls(stages=2, groups_per_step=2)
        return cls(stages=2, groups_per_step=2, ctas=sms)

    @classmethod
    def get_decode(cls, M: int, N: int, K: int) -> MgpuConfig:
        """`swap` at decode rows by the module's DECODE_* settings: up to `DECODE_STAGES`
        steps, as many as shared memory holds beside the output tile (64 weight rows where
        `DECODE_BLOCK_N`'s leave room for fewer than 2)."""
        G, rows = K // GROUP, pl.cdiv(M, 32) * 32
        for block_n in dict.fromkeys((DECODE_BLOCK_N, 64)):
            stages = min(DECODE_STAGES, swap_stages_that_fit(block_n, rows))
            if stages >= 2:
                break
        else:
            raise ValueError(f"swap at {M} rows: no room for 2 pipeline steps")
        tiles = N // block_n
        splits = next(s for s in range(1, G + 1)
                      if G % s == 0 and (tiles * s >= DECODE_CTAS or s == G))
        return cls(block_n=block_n, stages=stages, warp_specialized=False, splits=splits,
                   swap=True, scale_row=bool(DECODE_SCALE_ROW) and G % 32 == 0)


def swap_stages_that_fit(block_n: int, rows: int, groups: int = 1) -> int:
    """Pipeline steps of `swap` (`groups` K groups a step) that fit shared memory: a step's
    FP8 tiles, x's scale rows and the w scales' 32 copies, beside the fp32 output tile (and,
    with `scale_row`, a row of at most 96 w scales: within the 4 KB reserve's spare)."""
    step = groups * (GROUP * (block_n + rows) + 4 * rows + 4 * 32)
    return (hopper.SMEM_BYTES - hopper.SMEM_RESERVE - 4 * block_n * rows) // step


def _mgpu_step(x_smem, xs_smem, w_smem, ws_smem, acc, rows, swap=False, interpret=False,
               w_scale=None):
    """One pipeline step on one warpgroup's 64 rows (`swap`: its 64 or 128 weight rows, x's
    rows as the columns): per 128-wide K group of the step an FP8 wgmma into a fresh fp32
    accumulator, all issued first; then each group, once done, is scaled (row x column scale;
    swap: x's column scale x the tile's one w scale) into the running register sum while
    later groups' wgmmas run. `interpret`: the same products in fp32 in
    place of the wgmma (the interpreter has no transposed wgmma operand and no layouts).
    `w_scale(c)` (swap): group c's w scale, where `ws_smem` is None."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    shape = acc.shape
    n_groups = xs_smem.shape[0]
    if w_scale is None:
        w_scale = lambda c: ws_smem[c, 0]  # noqa: E731 (32 copies of the block's scale)

    def load(ref, axis):  # one value per accumulator row (axis 1) or column (0)
        return hopper.load(ref, plgpu.Layout.WGMMA.reduce(axis), interpret)

    def operands(c):  # group c's (a, b) of a @ b.T
        x, w = x_smem.at[rows], w_smem
        if n_groups > 1:
            x, w = x.at[:, pl.ds(c * GROUP, GROUP)], w.at[:, pl.ds(c * GROUP, GROUP)]
        return (w, x) if swap else (x, w)

    def promote(out, c, done):
        if swap:  # the weight tile lies in one 128 x 128 block: one scale a group
            scale = jax.lax.broadcast_in_dim(load(xs_smem.at[c, rows], 0) * w_scale(c),
                                             shape, [1])
        else:
            scale = (jax.lax.broadcast_in_dim(load(xs_smem.at[c, rows], 1), shape, [0])
                     * jax.lax.broadcast_in_dim(load(ws_smem.at[c], 0), shape, [1]))
        return out + done * scale

    if interpret:
        out = acc
        for c in range(n_groups):
            a, b = operands(c)
            out = promote(out, c, jax.lax.dot_general(
                a[...].astype(jnp.float32), b[...].astype(jnp.float32), (((1,), (1,)), ((), ()))))
        return out

    def run(*parts):
        for c, part in enumerate(parts):
            a, b = operands(c)
            plgpu.wgmma(part, a, b.transpose((1, 0)))
        out = acc
        for c, part in enumerate(parts):
            out = promote(out, c, plgpu.wgmma_accumulator_load(part, wait_n=n_groups - 1 - c))
        return out
    return pl.run_scoped(run, *[plgpu.ACC(shape, jnp.float32)] * n_groups)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def fp8_matmul_mgpu(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16, *,
                    config: MgpuConfig | None = None, interpret: bool = False):
    """The Mosaic GPU (Hopper wgmma + TMA) kernel; same contract as `fp8_matmul_ref`;
    `config` default: `MgpuConfig.get_default(M, N, K)` at 132 SMs.

    Each warpgroup owns 64 x `block_n` outputs. Per pipeline step `groups_per_step` 128-wide
    K groups of FP8 tiles arrive by TMA (`stages` steps in flight); each group's wgmma sums it
    in a fresh fp32 accumulator and its scales fold it into the running fp32 sum in registers
    (promotion every group, as DeepSeek-V3 does: the wgmma itself keeps ~14 bits).
    `warp_specialized`: two compute warpgroups (128 rows, sharing the weight tile) and a TMA
    warpgroup per CTA, so one warpgroup's scaling overlaps the other's wgmma; else one
    warpgroup per CTA with an in-line pipeline. `splits` > 1 splits K over CTAs (fp32
    partials, summed afterwards) when the output tiles alone are too few for the SMs. `ctas`
    (warp-specialised, no split): that many persistent CTAs (one per SM) loop over the output
    tiles, so a tile's output store overlaps the next tile's loads and no CTA is launched per
    tile. `swap` (decode rows): each warpgroup owns `block_n` weight rows x all of x's rows
    (padded to 32), the output computed transposed. Scales are passed transposed ([G, M]) and
    the weight scale expanded per column ([G, N]; swap: 32 copies a block) so each group's are
    one TMA row each (`scale_row`: swap's CTA copies its block's row of w scales once).
    `interpret`: in Pallas' Mosaic GPU interpreter (on the CPU), the wgmmas as fp32
    products."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    fm._check(xq, x_scale, wq, w_scale)
    M, K = xq.shape
    N = wq.shape[0]
    c = config or MgpuConfig.get_default(M, N, K)
    stages, warp_specialized, splits, ctas = c.stages, c.warp_specialized, c.splits, c.ctas
    G, tm, tn, gs = K // GROUP, 64, c.block_n, c.groups_per_step
    if tn % 64 or N % tn or tn > 256:
        raise ValueError(f"block_n {tn} must be a multiple of 64, at most 256, dividing N {N}")
    if G % (splits * gs):
        raise ValueError(f"splits {splits} x groups_per_step {gs} must divide the {G} K groups")
    if ctas and (splits > 1 or not warp_specialized):
        raise ValueError("persistent CTAs (ctas) need warp_specialized and splits 1")
    if c.swap and (warp_specialized or ctas or M > 256 or tn not in (64, 128)):
        # a swap tile reads one w scale a group: its rows must lie in one 128-row block
        raise ValueError("swap (decode rows) needs warp_specialized False, no ctas, "
                         f"M <= 256 and block_n 64 or 128; got {c}, M {M}")
    if c.scale_row and (not c.swap or G % 32):
        # a copy of whole 128-byte lines (the compiled kernel's copies need them)
        raise ValueError(f"scale_row needs swap and K / 128 a multiple of 32; got {c}, K {K}")
    # swap: x's rows padded so that a group's scales (a TMA row) are 128 bytes or more
    bm = pl.cdiv(M, 32) * 32 if c.swap else 2 * tm if warp_specialized else tm
    Mp = pl.cdiv(M, bm) * bm
    xq = jnp.pad(xq, [(0, Mp - M), (0, 0)])
    xs_GM = jnp.pad(x_scale, [(0, Mp - M), (0, 0)]).T
    # The w scales a TMA row a group ([G, N / 128 * reps]): each block's per column, or (swap:
    # a CTA's weight rows lie in one block) 32 copies of it, the fewest that make a 128-byte
    # row; with scale_row as stored ([N / 128, G]), a CTA copying its block's row
    ws_arg = w_scale if c.scale_row else jnp.repeat(w_scale.T, 32 if c.swap else GROUP, axis=1)
    swizzle = plgpu.find_swizzle(GROUP * 8)  # a 128-byte FP8 row
    tiled = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
    in_specs = [plgpu.BlockSpec((bm, gs * GROUP), lambda g: (0, g), transforms=tiled),
                plgpu.BlockSpec((gs, bm), lambda g: (g, 0)),
                plgpu.BlockSpec((tn, gs * GROUP), lambda g: (0, g), transforms=tiled),
                plgpu.BlockSpec((gs, 32 if c.swap else tn), lambda g: (g, 0))]
    if c.scale_row:  # the w scales come once a CTA, not a block a step
        in_specs = in_specs[:3]
    share = G // splits  # K groups per CTA
    steps = (share // gs,)

    acc_shape = (tn, bm) if c.swap else (tm, tn)  # one warpgroup's outputs

    def zeros():  # built inside the kernel: kernels capture no constants
        return hopper.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA,
                                  interpret)

    def ws_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=steps, memory_registers=40, max_concurrent_steps=stages, wg_axis="wg",
            num_compute_wgs=2, in_specs=in_specs, compute_context=compute_context)

    def kernel(x_gmem, xs_gmem, w_gmem, ws_gmem, o_gmem, o_smem2, *row):
        wg = jax.lax.axis_index("wg") if warp_specialized else 0
        rows = pl.ds(0, bm) if c.swap else pl.ds(wg * tm, tm)

        def body(idx, *refs):
            if not c.scale_row:
                return _mgpu_step(*refs, rows, c.swap, interpret)
            (x, xs, w, acc), row_smem = refs, row[0]
            first = jax.lax.axis_index("k") * share if splits > 1 else 0  # the CTA's 1st group
            return _mgpu_step(x, xs, w, None, acc, rows, c.swap, interpret,
                              lambda j: row_smem[first + idx[0] * gs + j])

        def tile(m, n, allocations=None):  # one output tile: its K loop, then its store
            ms, ns = pl.ds(m * bm, bm), pl.ds(n * tn, tn)
            x, xs, w, ws, o = x_gmem, xs_gmem, w_gmem, ws_gmem, o_gmem
            if splits > 1:  # this CTA's share of K; its fp32 partial goes to o[k]
                k = jax.lax.axis_index("k")
                ks, gk = pl.ds(k * share * GROUP, share * GROUP), pl.ds(k * share, share)
                x, xs, w, o = x.at[:, ks], xs.at[gk], w.at[:, ks], o.at[k]
                ws = ws if c.scale_row else ws.at[gk]
            operands = (x.at[ms], xs.at[:, ms], w.at[ns])
            if c.scale_row:  # the block's G scales, before the pipeline's first step
                row_smem, row_barrier = row
                plgpu.copy_gmem_to_smem(ws.at[n * tn // GROUP], row_smem, row_barrier)
                plgpu.barrier_wait(row_barrier)
            else:
                ws_cols = pl.ds(n * tn // GROUP * 32, 32) if c.swap else ns
                operands += (ws.at[:, ws_cols],)

            def store(acc):
                o_smem = o_smem2.at[wg]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store read it
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o.at[ns, ms] if c.swap else o.at[ms, ns].at[rows])

            if warp_specialized:
                ws_pipeline(body, lambda pipeline: store(pipeline(zeros())))(
                    *operands, allocations=allocations)
            else:
                store(plgpu.emit_pipeline(body, grid=steps, in_specs=in_specs,
                                          init_carry=zeros(), max_concurrent_steps=stages)(
                    *operands))

        if ctas:  # the pipeline's buffers are allocated once, outside the tile loop
            def ignore(*_, **__):
                return None

            @functools.partial(pl.run_scoped, allocations=ws_pipeline(ignore, ignore)
                               .get_allocations(x_gmem, xs_gmem, w_gmem, ws_gmem),
                               collective_axes="wg")
            def _(allocations):
                @plgpu.nd_loop((Mp // bm, N // tn), collective_axes="cta")
                def _(info):
                    tile(*info.index, allocations)
        else:
            tile(jax.lax.axis_index("m"), jax.lax.axis_index("n"))
        plgpu.wait_smem_to_gmem(0)

    part_dtype = out_dtype if splits == 1 else jnp.float32
    row_scratch = ((plgpu.SMEM((G,), jnp.float32), plgpu.Barrier(num_arrivals=1))
                   if c.scale_row else ())
    threads = dict(num_threads=3, thread_name="wg") if warp_specialized else {}
    if ctas:
        grid = dict(grid=(ctas,), grid_names=("cta",))
    elif splits > 1:
        grid = dict(grid=(Mp // bm, N // tn, splits), grid_names=("m", "n", "k"))
    else:
        grid = dict(grid=(Mp // bm, N // tn), grid_names=("m", "n"))
    out_shape = (N, Mp) if c.swap else (Mp, N)
    out = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(
                           (splits, *out_shape)[splits == 1:], part_dtype),
                       scratch_types=[plgpu.SMEM((1, *acc_shape) if c.swap else
                                                 (bm // tm, tm, tn), part_dtype),
                                      *row_scratch],
                       interpret=hopper.interpret_params() if interpret else None,
                       **grid, **threads)(xq, xs_GM, wq, ws_arg)
    out = out if splits == 1 else out.sum(0)
    return (out.T if c.swap else out).astype(out_dtype)[:M]
