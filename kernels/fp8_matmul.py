"""Per-group scaled FP8 GEMM (REFERENCE.md §7): x [M, K] float8_e4m3fn with one fp32 scale per
1 x 128 group, times w [N, K] float8_e4m3fn (K-major, as Hopper's FP8 MMA reads it) with one
scale per 128 x 128 block, -> [M, N] in `out_dtype`.

Each 128-wide K group's FP8 products are summed by the tensor cores, then multiplied by (x scale
of the row) x (w scale of the block) and added to an fp32 accumulator. Two kernels:

- `fp8_matmul_pallas` (Pallas, Triton lowering): 16-64 rows by 128 (or a multiple) columns per
  program, M padded to the row tile; at decode shapes K is split over programs too (`k_splits`)
  and the fp32 partials summed afterwards. Equals the dequantised fp32 matmul up to fp32
  summation order. Fastest below 128 rows.
- `fp8_matmul_mgpu` (Pallas, Mosaic GPU: TMA + wgmma, Hopper only): 2x the Triton kernel
  from M 256 (RESULTS.md).
  Hopper's FP8 wgmma sums a group's products with about 14 significant bits rather than fp32's
  24 (DeepSeek-V3 report, §3.3.2), so its result is within ~2^-13 of the exact per-group one.

`fp8_matmul` dispatches by M (`MGPU_MIN_M`) and sets the Mosaic GPU kernel's pipeline by shape
(`mgpu_config`), as measured by `benchmarks/fp8_tiles.py`. XLA's FP8 `dot_general` (cuBLASLt)
applies one scale per tensor only, so it cannot compute this product: it is the speed ceiling in
the benchmarks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

GROUP = 128


def _check(xq, x_scale, wq, w_scale):
    M, K = xq.shape
    N = wq.shape[0]
    if K % GROUP or N % GROUP or wq.shape[1] != K:
        raise ValueError(f"need x [M, K], w [N, K] with N, K multiples of {GROUP}; "
                         f"got {xq.shape}, {wq.shape}")
    if x_scale.shape != (M, K // GROUP) or w_scale.shape != (N // GROUP, K // GROUP):
        raise ValueError(f"scales must be {(M, K // GROUP)} and {(N // GROUP, K // GROUP)}, "
                         f"got {x_scale.shape}, {w_scale.shape}")


def fp8_matmul_ref(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16):
    """Pure-jnp reference: exact per-group products in fp32, then the two scales."""
    _check(xq, x_scale, wq, w_scale)
    M, K = xq.shape
    N = wq.shape[0]
    xg = xq.astype(jnp.float32).reshape(M, K // GROUP, GROUP)
    wg = wq.astype(jnp.float32).reshape(N, K // GROUP, GROUP)
    partial = jnp.einsum("mgk,ngk->mng", xg, wg, precision=jax.lax.Precision.HIGHEST)
    w_scale_NG = jnp.repeat(w_scale, GROUP, axis=0)  # [N, K / 128]
    out = jnp.einsum("mng,mg,ng->mn", partial, x_scale, w_scale_NG,
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype)


def _kernel(x_ref, xs_ref, w_ref, ws_ref, *refs, n_groups, n_poisoned):
    o_ref = refs[n_poisoned]  # poisoned inputs alias the output; never read
    first = pl.program_id(2) * n_groups  # this program's share of K (split-K)
    n_sub = w_ref.shape[0] // GROUP  # 128-wide column blocks, one weight scale each

    def group(g, accs):
        g = first + g
        cols = pl.ds(g * GROUP, GROUP)
        x = x_ref[:, cols]  # loaded once, shared by the column blocks
        xs = xs_ref[:, pl.ds(g, 1)]
        return tuple(
            acc + jnp.dot(x, w_ref[pl.ds(c * GROUP, GROUP), cols].T,
                          preferred_element_type=jnp.float32) * (xs * ws_ref[c, pl.ds(g, 1)])
            for c, acc in enumerate(accs))
    zeros = jnp.zeros((x_ref.shape[0], GROUP), jnp.float32)
    accs = jax.lax.fori_loop(0, n_groups, group, (zeros,) * n_sub)
    for c, acc in enumerate(accs):
        o_ref[:, pl.ds(c * GROUP, GROUP)] = acc.astype(o_ref.dtype)


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


def warps(block_m: int) -> int:
    """Measured best (fp8_tiles): 8 warps for the thin decode tiles, 4 from 64 rows."""
    return 8 if block_m <= 32 else 4


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_m", "block_n", "splits",
                                             "interpret", "poison", "num_warps", "num_stages"))
def fp8_matmul_pallas(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16, *,
                      block_m: int | None = None, block_n: int = GROUP,
                      splits: int | None = None, interpret: bool = False,
                      poison: bool = False, num_warps: int | None = None, num_stages: int = 3):
    """The Pallas (Triton lowering) kernel; same contract as `fp8_matmul_ref`. A program
    computes `block_m` x `block_n` outputs (`block_n` a multiple of 128 dividing N). With
    `splits` > 1 (default: `k_splits`), each program sums one share of the K groups into an
    fp32 partial, and the partials are added afterwards."""
    _check(xq, x_scale, wq, w_scale)
    M, K = xq.shape
    N = wq.shape[0]
    bm = block_m or row_tile(M)
    Mp = pl.cdiv(M, bm) * bm
    if Mp != M:
        xq = jnp.pad(xq, [(0, Mp - M), (0, 0)])
        x_scale = jnp.pad(x_scale, [(0, Mp - M), (0, 0)])
    G = K // GROUP
    bn = block_n
    if bn % GROUP or N % bn:
        raise ValueError(f"block_n {bn} must be a multiple of {GROUP} dividing N {N}")
    S = splits or k_splits(Mp // bm, N // bn, G)
    if G % S:
        raise ValueError(f"splits {S} must divide the {G} K groups")
    out_shape = jax.ShapeDtypeStruct((S, Mp, N), out_dtype if S == 1 else jnp.float32)
    out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, k: (k, i, j))
    in_specs = [pl.BlockSpec((bm, K), lambda i, j, k: (i, 0)),
                pl.BlockSpec((bm, G), lambda i, j, k: (i, 0)),
                pl.BlockSpec((bn, K), lambda i, j, k: (j, 0)),
                pl.BlockSpec((bn // GROUP, G), lambda i, j, k: (j, 0))]
    poisoned = [jnp.full(out_shape.shape, jnp.nan, out_shape.dtype)] if poison else []
    from jax.experimental.pallas import triton as plgpu
    out = pl.pallas_call(
        functools.partial(_kernel, n_groups=G // S, n_poisoned=len(poisoned)),
        grid=(Mp // bm, N // bn, S), in_specs=in_specs + [out_spec] * len(poisoned),
        out_specs=out_spec, out_shape=out_shape, interpret=interpret, name="fp8_matmul",
        input_output_aliases={4: 0} if poison else {},
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or warps(bm), num_stages=num_stages),
    )(xq, x_scale, wq, w_scale, *poisoned)
    return (out[0] if S == 1 else out.sum(0)).astype(out_dtype)[:M]


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
            plgpu.wgmma(part, x, plgpu.transpose_ref(w, (1, 0)))
        out = acc
        for c, part in enumerate(parts):
            done = plgpu.wgmma_accumulator_load(part, wait_n=n_groups - 1 - c)
            xs = plgpu.load(xs_smem.at[c, rows], (), layout=plgpu.Layout.WGMMA.reduce(1))
            ws = plgpu.load(ws_smem.at[c], (), layout=plgpu.Layout.WGMMA.reduce(0))
            out = out + done * (jax.lax.broadcast_in_dim(xs, (tm, tn), [0])
                                * jax.lax.broadcast_in_dim(ws, (tm, tn), [1]))
        return out
    return pl.run_scoped(run, *[plgpu.ACC((tm, tn), jnp.float32)] * n_groups)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_n", "stages", "warp_specialized",
                                             "groups_per_step", "splits", "ctas"))
def fp8_matmul_mgpu(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16, *, block_n: int = 128,
                    stages: int = 4, warp_specialized: bool = True, groups_per_step: int = 1,
                    splits: int = 1, ctas: int | None = None):
    """The Mosaic GPU (Hopper wgmma + TMA) kernel; same contract as `fp8_matmul_ref`.

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
    _check(xq, x_scale, wq, w_scale)
    M, K = xq.shape
    N = wq.shape[0]
    G, tm, tn, gs = K // GROUP, 64, block_n, groups_per_step
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


def compute_capability() -> tuple[int, int]:
    """(major, minor) of the first GPU."""
    major, minor = jax.devices()[0].compute_capability.split(".")
    return int(major), int(minor)


def sm_count() -> int:
    """Streaming multiprocessors of the first GPU (132 on the H200 where none is reported)."""
    return getattr(jax.devices()[0], "core_count", 132)


# From `benchmarks/fp8_tiles.py` on the H200 (RESULTS.md): at M 32 the Triton kernel with
# split-K is faster (0.043 vs 0.048 ms for gate/up), from M 256 the Mosaic GPU one (2x).
MGPU_MIN_M = 128


def mgpu_config(M: int, N: int, K: int, sms: int = 132) -> dict:
    """`fp8_matmul_mgpu` settings for a shape, as measured by fp8_tiles on the H200. With
    fewer 128 x 128 output tiles than SMs (the down GEMM at M 256: 64 tiles) each CTA walks a
    long K loop: two K groups per TMA step with 2 steps in flight beat 1 with 4 (0.068 vs
    0.075-0.089 ms). With a few tiles per SM (gate/up at M 256: 384) 1 group x 4 steps wins
    (0.090 vs 0.108 ms). With many (M 4096) persistent CTAs at 2 groups x 2 steps win (down
    0.467 vs 0.498, gate/up 1.187 vs 1.212 ms). Two groups per step need an even group count."""
    tiles = -(-M // 128) * (N // 128)
    if (K // GROUP) % 2:
        return {}
    if tiles < sms:
        return dict(stages=2, groups_per_step=2)
    if tiles < 4 * sms:
        return {}
    return dict(stages=2, groups_per_step=2, ctas=sms)


def fp8_matmul(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16):
    """Dispatch: on Hopper the Mosaic GPU kernel from `MGPU_MIN_M` rows, else the Pallas
    (Triton) kernel on GPU; the reference elsewhere. GPUs without FP8 tensor cores (before
    compute capability 8.9, e.g. the A100) are refused: Triton cannot compile the FP8 dot."""
    if jax.default_backend() != "gpu":
        return fp8_matmul_ref(xq, x_scale, wq, w_scale, out_dtype)
    cc = compute_capability()
    if cc < (8, 9):
        raise ValueError(f"the FP8 FFN needs FP8 tensor cores (compute capability 8.9 or "
                         f"newer: Ada, Hopper); this GPU's is {cc[0]}.{cc[1]}")
    if xq.shape[0] >= MGPU_MIN_M and cc[0] == 9:
        (M, K), N = xq.shape, wq.shape[0]
        return fp8_matmul_mgpu(xq, x_scale, wq, w_scale, out_dtype,
                               **mgpu_config(M, N, K, sm_count()))
    return fp8_matmul_pallas(xq, x_scale, wq, w_scale, out_dtype)
