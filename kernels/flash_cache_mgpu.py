"""The Flash-Cache update (contract: `kernels/flash_cache.py::flash_cache_ref`) lowered through
Pallas' Mosaic GPU backend (Hopper only): projection of a step's query rows onto one head's
columns of w_qkv, rotate-half RoPE, and the write of the rotated keys and the values into the
cache rows of the queried positions, in one kernel. Only q leaves it; k and v exist in HBM
only in the cache.

Why a second kernel: the update streams w_qkv (100 MB at LLaDA-8B) once per step, and at a
batch-1 step's 128 rows every program also reads the same rows h [128, D] (1 MB): with one
program per head (96) the Triton kernel moves as many bytes from L2 for h as from HBM for
the weights, and ran at 1.66-1.84x the weights' read floor on the H200 (RESULTS.md,
fifteenth session). Here:
- A CTA owns one head's K = 128 columns (both RoPE halves: pairs i, i + K/2 stay in one
  accumulator) for `64 * consumers` rows: one or two consumer warpgroups of 64 rows (Hopper's
  wgmma M) and a TMA producer warpgroup (`emit_pipeline_warp_specialized`), `stages` steps of
  `block_k` d_model columns in flight.
- Clusters of `cluster` CTAs on neighbouring heads: each h tile is read from L2 once per
  cluster and multicast by TMA to its CTAs (the weights, different per head, are not shared).
- Epilogue per consumer: the fp32 sum rounded to the activation dtype (as the reference
  rounds the projection), rotated with the rows' cos/sin (TMA'd into shared memory while
  the pipeline runs), staged in shared memory one RoPE half apart from the other; a q head's
  tile goes out by two TMA stores, a key or value head's rows by two each to their cache
  row, read from shared memory (Hopper's TMA has no scatter: 128 row stores per warpgroup,
  each 64 columns, skipped for padding rows).

Shapes as `flash_cache_pallas`; caches are updated in place (mutable refs aliased into the
kernel, the caller's buffers donated). Support: `refusal`.

Measured on the H200 (2026-12-04, RESULTS.md nineteenth session; one layer of random
LLaDA-8B, 128 rows at batch 1): correct (`pytest -m gpu tests/test_flash_cache.py`: its six
cases passed), but not faster than the Triton kernel: over 15 interleaved rounds 1.10x the
unfused XLA ops where the Triton kernel gave 1.18x (58.2 against 54.2 us; floor 28.1), at the
dual cache's 32 rows 0.95x against 1.07x. The multicast cluster did not pay (cluster 2
1.08-1.10x slower than 1 in two calls, level in the third). Kept beside its tests and
benchmark (`benchmarks/flash.py --update-mgpu`), not dispatched
(`kernels/flash_cache.py::MGPU`); jax 0.11.2 (the GPU machine's) warns that the Pallas
Triton backend of the dispatched kernel is deprecated and will be removed. What is left to
try: more bytes in flight (the cos/sin tables and the staging take 96 KiB beside the 96 KiB
pipeline; one could share the tables' space with the staging), one wgmma in flight per
consumer (`wgmma_wait(1)` with delayed release) for the compute-bound batch-4 rows (1.8x
their FLOP floor here).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import hopper
from kernels.flash_cache import _check, flat_rows

WG_ROWS = 64  # rows per consumer warpgroup: Hopper's wgmma M


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Knobs (hashable: a static jit argument)."""
    block_k: int = 64           # d_model columns per pipeline step
    stages: int = 3             # pipeline steps in flight
    # CTAs (neighbouring heads) sharing each h tile by multicast. 1: faster than 2 at batch 1
    # (128 rows) in two GPU calls of 2026-12-04 (58.0 / 54.5 us against 62.8 / 60.0), level in
    # the third (58.2 / 58.0): RESULTS.md, nineteenth session
    cluster: int = 1
    consumers: int | None = None  # warpgroups of 64 rows; None: 1 up to 64 rows, else 2

    def rows(self, M: int) -> int:
        return WG_ROWS * (self.consumers or (1 if M <= WG_ROWS else 2))

    def smem_bytes(self, M: int, K: int, itemsize: int) -> int:
        rows = self.rows(M)
        pipeline = self.stages * (rows + K) * self.block_k * itemsize
        # + cos|sin fp32, staging, cache rows
        return pipeline + rows * K * 4 + rows * K * itemsize + rows * 4


def refusal(dtypes, M: int, D: int, K: int, heads: int, tp: int,
            config: MgpuConfig = MgpuConfig()) -> str | None:
    """Why this kernel cannot take these settings, or None (the one support check, used by
    the kernel and by `flash_cache`'s dispatch). `dtypes`: of h, w_qkv and the caches (one
    bf16 or f16 type: the staged tiles go to the caches as they are); `heads`: q + k + v
    heads (H + 2G)."""
    dtype, *others = map(jnp.dtype, dtypes)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"bf16 or f16 only, got {dtype}"
    if any(o != dtype for o in others):
        return f"h, w_qkv and the caches must share one dtype, got {[dtype, *others]}"
    if tp != 1:
        return f"tp={tp}: the column groups of tensor parallelism are the Triton kernel's"
    if K not in (64, 128):  # the two lowered for CUDA in the tests
        return f"head dim must be 64 or 128, got {K}"
    c = config
    if c.consumers not in (None, 1, 2):
        return f"consumers must be 1 or 2, got {c.consumers}"
    if c.block_k % 64 or D % c.block_k:
        return f"block_k must be a multiple of 64 dividing d_model {D}, got {c.block_k}"
    if c.stages < 2:
        return f"stages must be at least 2, got {c.stages}"
    if c.cluster not in (1, 2, 4) or heads % c.cluster:
        return f"cluster must be 1, 2 or 4 and divide the {heads} heads, got {c.cluster}"
    need = c.smem_bytes(M, K, jnp.dtype(dtype).itemsize)
    return hopper.smem_refusal(need, "fewer stages or a smaller block_k")


@functools.partial(jax.jit, static_argnames=("n_heads", "tp", "config", "interpret"),
                   donate_argnums=(5, 6))
def flash_cache_mgpu(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK, *,
                     n_heads: int, tp: int = 1, config: MgpuConfig | None = None,
                     interpret: bool = False):
    """The fused update (module docstring); `flash_cache_ref`'s contract. `interpret`: Pallas'
    Mosaic GPU interpreter on the CPU (TMA, barriers and warpgroups simulated, clusters not:
    cluster 1 only; each wgmma an fp32 dot of the same operands)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    _check(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK, n_heads, tp)
    B, R, D = h_BRD.shape
    _, T, G, K = k_BTGK.shape
    M, NH, half = B * R, n_heads + 2 * G, K // 2
    c = config or MgpuConfig()
    dtypes = (h_BRD.dtype, w_qkv_DN.dtype, k_BTGK.dtype, v_BTGK.dtype)
    if (why := refusal(dtypes, M, D, K, NH, tp, c)) is not None:
        raise ValueError(why)
    dtype = h_BRD.dtype
    rows = c.rows(M)
    consumers = rows // WG_ROWS
    Mp = pl.cdiv(M, rows) * rows
    n_valid = B * T
    h, idx = flat_rows(h_BRD, cols_BR, T, Mp)
    # cos | sin side by side: one TMA copy per warpgroup
    cs = jnp.pad(jnp.concatenate([cos_BRk, sin_BRk], -1).reshape(M, K).astype(jnp.float32),
                 [(0, Mp - M), (0, 0)])

    item = jnp.dtype(dtype).itemsize * 8
    sw = plgpu.find_swizzle(c.block_k * item)
    h_tiled = (plgpu.TilingTransform((8, sw * 8 // item)), plgpu.SwizzleTransform(sw))
    sw_w = plgpu.find_swizzle(K * item)
    w_tiled = (plgpu.TilingTransform((8, sw_w * 8 // item)), plgpu.SwizzleTransform(sw_w))
    share_h = ("cluster",) if c.cluster > 1 else ()
    in_specs = [
        plgpu.BlockSpec((rows, c.block_k), lambda d: (0, d), transforms=h_tiled,
                        collective_axes=share_h),
        plgpu.BlockSpec((c.block_k, K), lambda d: (d, 0), transforms=w_tiled)]

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(D // c.block_k,), memory_registers=40, max_concurrent_steps=c.stages,
            wg_axis="wg", num_compute_wgs=consumers, in_specs=in_specs,
            compute_context=context)

    def kernel(h_g, w_g, cs_g, idx_g, k_ref, v_ref, q_g, cs_smem, out_smem, idx_smem,
               bars):
        wg = jax.lax.axis_index("wg")
        j = jax.lax.axis_index("heads") * c.cluster + jax.lax.axis_index("cluster")
        row_tile = pl.ds(jax.lax.axis_index("rows") * rows, rows)
        head = pl.ds(j * K, K)

        def body(_, h_smem, w_smem, acc):
            mine = h_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)]
            if interpret:
                return acc + jnp.dot(mine[...], w_smem[...], preferred_element_type=jnp.float32)
            plgpu.wgmma(acc, mine, w_smem)
            plgpu.wgmma_wait(0)  # the slot is released when the body returns
            return acc

        def epilogue(acc, r0):
            x = acc.astype(dtype).astype(jnp.float32)  # the reference rounds the projection
            x1, x2 = x[:, :half], x[:, half:]
            plgpu.barrier_wait(bars.at[2 * wg])
            tab = cs_smem.at[wg]
            cos, sin = tab[:, pl.ds(0, half)], tab[:, pl.ds(half, half)]
            # the halves staged apart: a TMA store reads 128-byte rows (an unswizzled box of
            # 256-byte rows stores its second 128 bytes from the wrong place)
            lo, hi = out_smem.at[wg, 0], out_smem.at[wg, 1]

            @pl.when(j < n_heads + G)  # q and k heads rotate, v heads do not
            def _():
                lo[...] = (x1 * cos - x2 * sin).astype(dtype)
                hi[...] = (x2 * cos + x1 * sin).astype(dtype)

            @pl.when(j >= n_heads + G)
            def _():
                lo[...] = x1.astype(dtype)
                hi[...] = x2.astype(dtype)
            plgpu.commit_smem()

            @pl.when(j < n_heads)
            def _():
                for part, stage in enumerate((lo, hi)):
                    plgpu.copy_smem_to_gmem(
                        stage, q_g.at[pl.ds(r0, WG_ROWS), pl.ds(j * K + part * half, half)])

            def scatter(cache, g):
                plgpu.barrier_wait(bars.at[2 * wg + 1])
                cache_rows = idx_smem.at[wg]

                @pl.loop(0, WG_ROWS)
                def _(r):
                    # from shared memory: a global load here would put its latency before
                    # each of the 64 stores in turn
                    row = cache_rows[r]

                    @pl.when(row < n_valid)  # padding rows of the query budget do not write
                    def _():
                        for part, stage in enumerate((lo, hi)):
                            plgpu.copy_smem_to_gmem(
                                stage.at[pl.ds(r, 1)],
                                cache.at[pl.ds(row, 1), pl.ds(g * K + part * half, half)])

            @pl.when((j >= n_heads) & (j < n_heads + G))
            def _():
                scatter(k_ref, j - n_heads)

            @pl.when(j >= n_heads + G)
            def _():
                scatter(v_ref, j - n_heads - G)
            plgpu.wait_smem_to_gmem(0)

        def context(run):
            r0 = jax.lax.axis_index("rows") * rows + wg * WG_ROWS
            # the rows' cos | sin and (key and value heads: each copy is waited for) cache
            # rows, loaded while the projection streams
            plgpu.copy_gmem_to_smem(cs_g.at[pl.ds(r0, WG_ROWS)], cs_smem.at[wg],
                                    bars.at[2 * wg])

            @pl.when(j >= n_heads)
            def _():
                plgpu.copy_gmem_to_smem(idx_g.at[pl.ds(r0, WG_ROWS)], idx_smem.at[wg],
                                        bars.at[2 * wg + 1])
            if interpret:
                acc = run(jnp.zeros((WG_ROWS, K), jnp.float32))
            else:
                acc = pl.run_scoped(lambda a: (run(a), a[...])[1],
                                    plgpu.ACC((WG_ROWS, K), jnp.float32))
            epilogue(acc, r0)

        def ignore(*_, **__):
            return None
        allocs = pipeline(ignore, ignore).get_allocations(h_g, w_g)

        @functools.partial(pl.run_scoped, allocations=allocs, collective_axes="wg")
        def _(allocations):
            pipeline(body, context)(h_g.at[row_tile], w_g.at[:, head], allocations=allocations)

    k_flat = jax.new_ref(k_BTGK.reshape(n_valid, G * K), memory_space=plgpu.GMEM)
    v_flat = jax.new_ref(v_BTGK.reshape(n_valid, G * K), memory_space=plgpu.GMEM)
    mesh = plgpu.Mesh(grid=(Mp // rows, NH // c.cluster), grid_names=("rows", "heads"),
                      cluster=(c.cluster,), cluster_names=("cluster",),
                      num_threads=consumers + 1, thread_name="wg")
    scratch = [plgpu.SMEM((consumers, WG_ROWS, K), jnp.float32),
               plgpu.SMEM((consumers, 2, WG_ROWS, half), dtype),
               plgpu.SMEM((consumers, WG_ROWS), jnp.int32),
               plgpu.Barrier(num_barriers=2 * consumers)]

    def entry(*refs):
        pl.run_scoped(lambda *s: kernel(*refs, *s), *scratch, collective_axes="wg")
    # pl.kernel, not plgpu.kernel: the caches go in as mutable refs, written in place
    q = pl.kernel(
        entry, out_type=jax.ShapeDtypeStruct((Mp, n_heads * K), dtype), mesh=mesh,
        compiler_params=None if interpret else plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=hopper.interpret_params() if interpret else False, name="flash_cache_mgpu",
    )(h, w_qkv_DN, cs, idx, k_flat, v_flat)
    return (q[:M].reshape(B, R, n_heads, K), k_flat[...].reshape(B, T, G, K),
            v_flat[...].reshape(B, T, G, K))
