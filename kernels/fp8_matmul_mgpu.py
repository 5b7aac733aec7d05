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


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Pipeline settings of `fp8_matmul_mgpu` (hashable: a static jit argument)."""
    block_n: int = 128             # output columns per CTA: a multiple of 64, <= 256, dividing N
    stages: int = 4                # TMA steps in flight
    warp_specialized: bool = True  # two compute warpgroups + one TMA warpgroup per CTA
    groups_per_step: int = 1       # 128-wide K groups per TMA step
    splits: int = 1                # CTAs over K (fp32 partials summed afterwards)
    ctas: int | None = None        # persistent CTAs looping over the output tiles

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


def _mgpu_step(x_smem, xs_smem, w_smem, ws_smem, acc, rows):
    """One pipeline step on one warpgroup's 64 rows: per 128-wide K group of the step an FP8
    wgmma into a fresh fp32 accumulator, all issued first; then each group, once done, is
    scaled (row x column) into the running register sum while later groups' wgmmas run."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    tm, tn = acc.shape
    n_groups = xs_smem.shape[0]

    def run(*parts):
        for c, part in enumerate(parts):
            x, w = x_smem.at[rows], w_smem
            if n_groups > 1:
                x, w = x.at[:, pl.ds(c * GROUP, GROUP)], w.at[:, pl.ds(c * GROUP, GROUP)]
            plgpu.wgmma(part, x, w.transpose((1, 0)))
        out = acc
        for c, part in enumerate(parts):
            done = plgpu.wgmma_accumulator_load(part, wait_n=n_groups - 1 - c)
            xs = hopper.load_whole(xs_smem.at[c, rows], plgpu.Layout.WGMMA.reduce(1))
            ws = hopper.load_whole(ws_smem.at[c], plgpu.Layout.WGMMA.reduce(0))
            out = out + done * (jax.lax.broadcast_in_dim(xs, (tm, tn), [0])
                                * jax.lax.broadcast_in_dim(ws, (tm, tn), [1]))
        return out
    return pl.run_scoped(run, *[plgpu.ACC((tm, tn), jnp.float32)] * n_groups)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config"))
def fp8_matmul_mgpu(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16, *,
                    config: MgpuConfig | None = None):
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
    tile. Scales are passed transposed ([G, M]) and the weight scale expanded per column
    ([G, N]) so each group's are one TMA row each."""
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
    bm = 2 * tm if warp_specialized else tm
    Mp = pl.cdiv(M, bm) * bm
    xq = jnp.pad(xq, [(0, Mp - M), (0, 0)])
    xs_GM = jnp.pad(x_scale, [(0, Mp - M), (0, 0)]).T
    ws_GN = jnp.repeat(w_scale.T, GROUP, axis=1)
    swizzle = plgpu.find_swizzle(GROUP * 8)  # a 128-byte FP8 row
    tiled = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
    in_specs = [plgpu.BlockSpec((bm, gs * GROUP), lambda g: (0, g), transforms=tiled),
                plgpu.BlockSpec((gs, bm), lambda g: (g, 0)),
                plgpu.BlockSpec((tn, gs * GROUP), lambda g: (0, g), transforms=tiled),
                plgpu.BlockSpec((gs, tn), lambda g: (g, 0))]
    share = G // splits  # K groups per CTA
    steps = (share // gs,)

    def zeros():  # built inside the kernel: kernels capture no constants
        return plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), plgpu.Layout.WGMMA)

    def ws_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=steps, memory_registers=40, max_concurrent_steps=stages, wg_axis="wg",
            num_compute_wgs=2, in_specs=in_specs, compute_context=compute_context)

    def kernel(x_gmem, xs_gmem, w_gmem, ws_gmem, o_gmem, o_smem2):
        wg = jax.lax.axis_index("wg") if warp_specialized else 0
        rows = pl.ds(wg * tm, tm)

        def body(_, *refs):
            return _mgpu_step(*refs, rows)

        def tile(m, n, allocations=None):  # one output tile: its K loop, then its store
            ms, ns = pl.ds(m * bm, bm), pl.ds(n * tn, tn)
            x, xs, w, ws, o = x_gmem, xs_gmem, w_gmem, ws_gmem, o_gmem
            if splits > 1:  # this CTA's share of K; its fp32 partial goes to o[k]
                k = jax.lax.axis_index("k")
                ks, gk = pl.ds(k * share * GROUP, share * GROUP), pl.ds(k * share, share)
                x, xs, w, ws, o = x.at[:, ks], xs.at[gk], w.at[:, ks], ws.at[gk], o.at[k]
            operands = (x.at[ms], xs.at[:, ms], w.at[ns], ws.at[:, ns])

            def store(acc):
                o_smem = o_smem2.at[wg]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store read it
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o.at[ms, ns].at[rows])

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
    threads = dict(num_threads=3, thread_name="wg") if warp_specialized else {}
    if ctas:
        grid = dict(grid=(ctas,), grid_names=("cta",))
    elif splits > 1:
        grid = dict(grid=(Mp // bm, N // tn, splits), grid_names=("m", "n", "k"))
    else:
        grid = dict(grid=(Mp // bm, N // tn), grid_names=("m", "n"))
    out = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(
                           (splits, Mp, N)[splits == 1:], part_dtype),
                       scratch_types=[plgpu.SMEM((bm // tm, tm, tn), part_dtype)],
                       **grid, **threads)(xq, xs_GM, wq, ws_GN)
    return (out if splits == 1 else out.sum(0)).astype(out_dtype)[:M]
