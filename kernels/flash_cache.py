"""Flash-Cache update: the cache-update path of Flash-dLLM's selective refresh (REFERENCE.md §8)
in one kernel: Q/K/V projection of a step's query rows, rotate-half RoPE of q and k, and the
write of the rotated keys and the values straight into the K/V cache rows of the queried
positions. Only q leaves the kernel (the attention that follows needs it); k and v never exist
in HBM outside the cache.

Shapes: h [B, R, D] normed hidden states of the query rows; w_qkv [D, (H + 2G) K] (columns
q | k | v, or `tp` column groups of them: lacache_jax/model.py Layer.tp); cos/sin [B, R, K/2]
fp32 RoPE tables at the rows' positions; cols [B, R] int32 cache column of each row, >= T for
rows that must not write (padding of the static query budget); caches k/v [B, T, G, K].
Returns (q [B, R, H, K] rotated, k cache, v cache). `flash_cache_ref` is the pure-jnp
reference with the same signature; `flash_cache` dispatches (Pallas on GPU up to
FUSED_MAX_ROWS query rows, reference elsewhere and above).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.forced import Forced


def _check(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK, n_heads, tp):
    B, R, D = h_BRD.shape
    _, T, G, K = k_BTGK.shape
    if v_BTGK.shape != k_BTGK.shape or k_BTGK.shape[0] != B:
        raise ValueError(f"k/v caches must be [B={B}, T, G, K] alike, got {k_BTGK.shape}, "
                         f"{v_BTGK.shape}")
    if w_qkv_DN.shape != (D, (n_heads + 2 * G) * K):
        raise ValueError(f"w_qkv must be [{D}, {(n_heads + 2 * G) * K}], got {w_qkv_DN.shape}")
    if cos_BRk.shape != (B, R, K // 2) or sin_BRk.shape != cos_BRk.shape:
        raise ValueError(f"cos/sin must be [{B}, {R}, {K // 2}], got {cos_BRk.shape}, "
                         f"{sin_BRk.shape}")
    if cols_BR.shape != (B, R):
        raise ValueError(f"cols must be [{B}, {R}], got {cols_BR.shape}")
    if n_heads % G or n_heads % tp or G % tp:
        raise ValueError(f"n_heads={n_heads}, kv heads {G} and tp={tp} do not divide evenly")


def rope(x_BRHK: jax.Array, cos_BRk: jax.Array, sin_BRk: jax.Array) -> jax.Array:
    """Rotate-half RoPE in fp32, cast back (REFERENCE.md §3)."""
    x = x_BRHK.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos_BRk[:, :, None, :], sin_BRk[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                           axis=-1).astype(x_BRHK.dtype)


def flash_cache_ref(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK, *,
                    n_heads: int, tp: int = 1):
    """Projection, RoPE and scatter of the new keys/values as separate XLA ops."""
    _check(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK, n_heads, tp)
    B, R, _ = h_BRD.shape
    G, K = k_BTGK.shape[2:]
    qkv_BRN = (h_BRD @ w_qkv_DN).reshape(B, R, tp, -1)
    q, k, v = jnp.split(qkv_BRN, [n_heads * K // tp, (n_heads + G) * K // tp], axis=-1)
    q = rope(q.reshape(B, R, n_heads, K), cos_BRk, sin_BRk)
    k = rope(k.reshape(B, R, G, K), cos_BRk, sin_BRk)
    v = v.reshape(B, R, G, K)
    b = jnp.arange(B)[:, None]
    with jax.named_scope("cache_update"):
        # Rows whose column lies past the cache (>= T) are padding of the query budget.
        k_BTGK = k_BTGK.at[b, cols_BR].set(k.astype(k_BTGK.dtype), mode="drop")
        v_BTGK = v_BTGK.at[b, cols_BR].set(v.astype(v_BTGK.dtype), mode="drop")
    return q, k_BTGK, v_BTGK


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the Pallas kernel: `rows` query rows per program, `depth` the d_model chunk
    of the projection loop, Triton's `warps` and `stages`, `splits` programs per head,
    each taking 1/splits of both RoPE halves' columns (pairs i, i + K/2 stay together), and
    `split_k` programs per head along d_model. A
    batch-1 step of LLaDA-8B has one row tile and 96 heads: 96 programs on 132 SMs, each
    streaming a 1 MB weight column block; `splits` 2 gives 192 smaller ones. Programs run
    row tile fastest, so the row tiles of one head's weight columns follow each other and
    share them in L2."""
    rows: int = 64
    depth: int = 64
    warps: int = 4
    stages: int = 2
    splits: int = 1
    # programs per head along d_model, each summing 1/split_k of it into an fp32 partial; the
    # last to finish (an atomic count) adds the partials in a fixed order and rotates and
    # writes (deterministic). 2: 192 programs at batch 1, where 96 leave 36 of 132 SMs idle.
    split_k: int = 1

    @classmethod
    def get_default(cls, M: int, D: int) -> "BlockSizes":
        # One row tile for a batch-1 step (R <= 128 rows): the weights stream once. At R 128,
        # D 4096 on the H200, 128-deep chunks with 3 stages ran 49.1 and 49.3 us where 64-deep
        # with 4 stages ran 53.5 and 51.4-53.4 (sixth and tenth sessions; the fourth had
        # them at 58.4 and 53.6 before the kernel's later changes): benchmarks/RESULTS.md.
        # Smaller tiles keep 64-deep chunks with 4 stages (not measured against others).
        rows = min(128, max(16, 1 << max(M - 1, 0).bit_length()))
        wide = rows == 128 and D % 128 == 0
        depth = 128 if wide else next(d for d in (64, 32, 16, 8) if D % d == 0)
        return cls(rows, depth, 8 if rows == 128 else 4, 3 if wide else 4)


# Above this many query rows (B R) the separate XLA ops are faster: the weights are read once
# either way, and XLA's GEMM beats the kernel's projection loop at large M (H200, R 128: fused
# 1.33x faster than unfused at B 1, 1.14x slower at B 32; the crossing between is unmeasured).
FUSED_MAX_ROWS = 512


def use_kernel(M: int, tp: int, head_dim: int = 128) -> bool:
    """Whether `flash_cache` runs the Pallas kernel for M = B R query rows (on a GPU): also
    only where a RoPE half (head_dim / 2) is a power of two of at least 16 columns, which
    Triton's blocks need."""
    half = head_dim // 2
    return (jax.default_backend() == "gpu" and tp == 1 and M <= FUSED_MAX_ROWS
            and half >= 16 and half & (half - 1) == 0)


# Whether Hopper takes the Mosaic GPU kernel (kernels/flash_cache_mgpu.py) where it supports
# the shape. Off: it did not run faster than the Triton kernel on the H200 (RESULTS.md,
# nineteenth session).
MGPU = False


def takes_mgpu(dtypes, M: int, D: int, head_dim: int, heads: int, tp: int) -> bool:
    """Whether the Pallas path runs the Mosaic GPU kernel for M query rows of `heads` q + k
    + v heads (else the Triton kernel): when `MGPU` is set, on Hopper, where
    `flash_cache_mgpu.refusal` is None at its defaults. `dtypes`: of h, w_qkv, the caches."""
    if not MGPU or jax.default_backend() != "gpu":
        return False
    from kernels.flash_cache_mgpu import refusal
    if refusal(dtypes, M, D, head_dim, heads, tp) is not None:
        return False
    from kernels.fp8_matmul import compute_capability
    return compute_capability()[0] == 9


def chosen(rows: int, R: int, tp: int, head_dim: int) -> str:
    """What `flash_cache` runs for `rows` batch rows of R query rows each ("pallas" or
    "ref"): the dispatch's default, or the implementation forced while tracing."""
    from lacache_jax.sharding import per_data_shard
    M = per_data_shard(rows) * R  # the rows one device runs
    return implementation.choice("pallas" if use_kernel(M, tp, head_dim) else "ref")


def flat_rows(h_BRD, cols_BR, T: int, Mp: int):
    """The kernels' row operands: h [B, R, D] as [Mp, D] (zero rows padding M = B R up to Mp)
    and each row's flat cache row b T + col [Mp] in the caches viewed [B T, G K], B T (past
    the end: no write) for rows at a column >= T and for the padding."""
    B, R, D = h_BRD.shape
    M = B * R
    b = jnp.arange(B, dtype=jnp.int32)[:, None]
    flat = jnp.where(cols_BR < T, b * T + cols_BR, B * T).reshape(M).astype(jnp.int32)
    return (jnp.pad(h_BRD.reshape(M, D), [(0, Mp - M), (0, 0)]),
            jnp.pad(flat, [(0, Mp - M)], constant_values=B * T))


def _kernel(h_ref, w_ref, cos_ref, sin_ref, idx_ref, k_in, v_in, *refs,
            n_heads, n_kv, tp, K, rows, depth, splits, split_k, n_valid, interpret):
    """Program (row tile i, column head j, part s of `splits`, d_model part kk of
    `split_k`): j < H a query head, then G key heads, then G value heads. Projects the
    tile's rows onto the part's columns of both K/2 halves (so RoPE pairs stay in
    registers), rotates q and k, then stores q, or scatters k / v rows into the cache at
    their flat row index; rows at index n_valid (padding) are masked. With split_k > 1
    each program sums its part of d_model and the last of a head's programs to finish goes
    on with the sum of all parts (below)."""
    del k_in, v_in  # aliased to k_ref / v_ref: only the queried rows are overwritten
    if split_k > 1:
        count_in, q_ref, k_ref, v_ref, part_ref, count_ref = refs
        del count_in  # aliased to count_ref
    else:
        q_ref, k_ref, v_ref = refs
    i, js = pl.program_id(0), pl.program_id(1)
    j, part = jax.lax.div(js, jnp.int32(splits)), jax.lax.rem(js, jnp.int32(splits))
    half = K // 2
    width_s = half // splits  # the part's columns in each half
    off = part * width_s
    D = h_ref.shape[1]
    # Column of head j in w_qkv: `tp` groups of [q heads | k heads | v heads] (Layer.tp).
    hq, hk = n_heads // tp, n_kv // tp
    width = (hq + 2 * hk) * K
    is_q, is_k = j < n_heads, (j >= n_heads) & (j < n_heads + n_kv)
    i32 = jnp.int32  # explicit: weak-typed Python ints in a select lower badly to Triton
    local = j - jnp.where(is_q, i32(0), jnp.where(is_k, i32(n_heads), i32(n_heads + n_kv)))
    per = jnp.where(is_q, i32(hq), i32(hk))
    first = jnp.where(is_q, i32(0), jnp.where(is_k, i32(hq), i32(hq + hk)))
    # Non-negative operands: C division (lax) is floor division here, and lowers to Triton.
    col = jax.lax.div(local, per) * width + (first + jax.lax.rem(local, per)) * K + off
    r = pl.ds(i * rows, rows)

    chunks = D // depth // split_k  # this program's d_model chunks
    first_chunk = pl.program_id(2) * chunks if split_k > 1 else 0

    def step(d, acc):
        a1, a2 = acc
        dd = pl.ds((first_chunk + d) * depth, depth)
        h = h_ref[r, dd]
        w1 = w_ref[dd, pl.ds(col, width_s)]
        w2 = w_ref[dd, pl.ds(col + half, width_s)]
        return (a1 + jnp.dot(h, w1, preferred_element_type=jnp.float32),
                a2 + jnp.dot(h, w2, preferred_element_type=jnp.float32))
    zero = jnp.zeros((rows, width_s), jnp.float32)
    x1, x2 = jax.lax.fori_loop(0, chunks, step, (zero, zero))
    finish = functools.partial(_rotate_and_write, h_ref, cos_ref, sin_ref, idx_ref, q_ref,
                               k_ref, v_ref, j=j, r=r, off=off, width_s=width_s, half=half,
                               K=K, n_heads=n_heads, n_kv=n_kv, n_valid=n_valid)
    if split_k == 1:
        finish(x1, x2)
        return
    # d_model split: each program leaves its fp32 partial; the last of the head's split_k
    # programs to finish sums them in the order of kk (run to run the same bits) and goes on
    pcols = [pl.ds(j * K + lo + off, width_s) for lo in (0, half)]
    kk = pl.program_id(2)
    part_ref[kk, r, pcols[0]] = x1
    part_ref[kk, r, pcols[1]] = x2
    if not interpret:  # one program at a time there, and no rule for the barrier
        plgpu.debug_barrier()  # every thread's partial stored before the count is released
    tile = (i * jnp.int32(pl.num_programs(1)) + js).astype(jnp.int32)
    done = plgpu.atomic_add(count_ref, (tile,), jnp.int32(1))

    @pl.when(done == split_k - 1)
    def _():
        # volatile: read from L2, where the other programs put their partials (no stale L1
        # line); the lowering of cache_modifier=".cg" fails in jax 0.10.2
        def total(c):
            y = plgpu.load(part_ref.at[jnp.int32(0), r, c], volatile=True)
            for s in range(1, split_k):
                y = y + plgpu.load(part_ref.at[jnp.int32(s), r, c], volatile=True)
            return y
        finish(total(pcols[0]), total(pcols[1]))


def _rotate_and_write(h_ref, cos_ref, sin_ref, idx_ref, q_ref, k_ref, v_ref, x1, x2, *, j, r,
                      off, width_s, half, K, n_heads, n_kv, n_valid):
    """The epilogue of program (row tile `r`, head `j`, columns `off` + [0, width_s) of each
    RoPE half) on its fp32 projection halves x1, x2: round, rotate q and k, store q or
    scatter k / v into the cache."""
    is_q, is_k = j < n_heads, (j >= n_heads) & (j < n_heads + n_kv)
    # The reference rounds the projection to the activation dtype before RoPE: so do we.
    x1 = x1.astype(h_ref.dtype).astype(jnp.float32)
    x2 = x2.astype(h_ref.dtype).astype(jnp.float32)
    cos, sin = cos_ref[r, pl.ds(off, width_s)], sin_ref[r, pl.ds(off, width_s)]
    o1 = jnp.where(j < n_heads + n_kv, x1 * cos - x2 * sin, x1)
    o2 = jnp.where(j < n_heads + n_kv, x2 * cos + x1 * sin, x2)

    @pl.when(is_q)
    def _():
        q_ref[r, pl.ds(j * K + off, width_s)] = o1.astype(q_ref.dtype)
        q_ref[r, pl.ds(j * K + half + off, width_s)] = o2.astype(q_ref.dtype)

    idx = idx_ref[r]
    ok = (idx < n_valid)[:, None]

    def scatter(ref, g):
        # Both indexers are arrays (row and column): the form interpret mode's masked store
        # also supports; Triton makes one pointer tensor of it. Masked rows keep their
        # index past the cache: Triton never dereferences a masked lane, and interpret
        # mode's scatter drops out-of-bounds rows, where any in-bounds stand-in could
        # collide with a real row's write.
        lanes = jnp.arange(width_s, dtype=jnp.int32)[None, :] + g * K + off
        for lo, o in ((0, o1), (half, o2)):
            plgpu.store(ref.at[idx[:, None], lanes + lo], o.astype(ref.dtype), mask=ok)

    @pl.when(is_k)
    def _():
        scatter(k_ref, j - n_heads)

    @pl.when(~is_q & ~is_k)
    def _():
        scatter(v_ref, j - n_heads - n_kv)


@functools.partial(jax.jit, static_argnames=("n_heads", "tp", "block", "interpret"),
                   donate_argnums=(5, 6))
def flash_cache_pallas(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK, *,
                       n_heads: int, tp: int = 1, block: BlockSizes | None = None,
                       interpret: bool = False):
    """The fused kernel. Rows of every batch row are flattened (M = B R) so the weights are
    streamed once per row tile, not once per batch row; the caches are viewed flat
    [B T, G K] and updated in place (aliased, donated). q [B, R, H, K] is written to HBM:
    the attention that follows reads it (fusing the attention too is the next step)."""
    _check(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK, n_heads, tp)
    B, R, D = h_BRD.shape
    _, T, G, K = k_BTGK.shape
    M = B * R
    block = block or BlockSizes.get_default(M, D)
    if D % block.depth:
        raise ValueError(f"block.depth={block.depth} must divide d_model={D}")
    if block.splits < 1 or (K // 2) % block.splits:
        raise ValueError(f"block.splits={block.splits} must divide head_dim / 2 = {K // 2}")
    if not interpret and K // 2 // block.splits < 16:
        raise ValueError(f"block.splits={block.splits} leaves {K // 2 // block.splits} columns "
                         f"per RoPE half: Triton's dot needs at least 16")
    if block.split_k < 1 or D % (block.depth * block.split_k):
        raise ValueError(f"block.split_k={block.split_k} must divide d_model={D} into whole "
                         f"{block.depth}-column chunks")
    Mp = pl.cdiv(M, block.rows) * block.rows
    h, idx = flat_rows(h_BRD, cols_BR, T, Mp)
    cos, sin = (jnp.pad(x.reshape(M, K // 2), [(0, Mp - M), (0, 0)]) for x in (cos_BRk, sin_BRk))
    S, NH = block.split_k, n_heads + 2 * G
    kernel = functools.partial(_kernel, n_heads=n_heads, n_kv=G, tp=tp, K=K, rows=block.rows,
                               depth=block.depth, splits=block.splits, split_k=S,
                               n_valid=B * T, interpret=interpret)
    grid = (Mp // block.rows, NH * block.splits)
    out_shape = [jax.ShapeDtypeStruct((Mp, n_heads * K), h.dtype),
                 jax.ShapeDtypeStruct((B * T, G * K), k_BTGK.dtype),
                 jax.ShapeDtypeStruct((B * T, G * K), v_BTGK.dtype)]
    extra, aliases = (), {5: 1, 6: 2}
    if S > 1:  # the partials, and per program tile a count of its finished d_model parts
        grid += (S,)
        out_shape += [jax.ShapeDtypeStruct((S, Mp, NH * K), jnp.float32),
                      jax.ShapeDtypeStruct((grid[0] * grid[1],), jnp.int32)]
        extra, aliases = (jnp.zeros((grid[0] * grid[1],), jnp.int32),), {5: 1, 6: 2, 7: 4}
    q, k, v, *_ = pl.pallas_call(
        kernel, grid=grid, out_shape=out_shape, input_output_aliases=aliases,
        interpret=interpret, name="flash_cache",
        compiler_params=plgpu.CompilerParams(num_warps=block.warps, num_stages=block.stages),
    )(h, w_qkv_DN, cos, sin, idx, k_BTGK.reshape(B * T, G * K), v_BTGK.reshape(B * T, G * K),
      *extra)
    return (q[:M].reshape(B, R, n_heads, K), k.reshape(B, T, G, K), v.reshape(B, T, G, K))


# Benchmarks force the kernel or the reference while tracing (kernels/forced.py).
implementation = Forced("flash_cache")


def flash_cache(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK, *, n_heads: int,
                tp: int = 1):
    """Dispatch: a Pallas kernel on GPU (per data shard under a mesh) up to FUSED_MAX_ROWS
    query rows per device (the Triton one; the Mosaic GPU one instead when `MGPU` is set,
    on Hopper, where it takes the shape: `takes_mgpu`), the reference elsewhere, above that
    and whenever tensor parallelism splits the heads (tp > 1)."""
    from jax.sharding import PartitionSpec as PS

    from lacache_jax.sharding import DATA, per_data_shard, shard_kernel
    if chosen(h_BRD.shape[0], h_BRD.shape[1], tp, k_BTGK.shape[-1]) == "ref":
        return flash_cache_ref(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK,
                               n_heads=n_heads, tp=tp)
    rows, heads = PS(DATA, None, None), PS(DATA, None, None, None)
    B, R, D = h_BRD.shape
    G, K = k_BTGK.shape[2:]
    dtypes = (h_BRD.dtype, w_qkv_DN.dtype, k_BTGK.dtype, v_BTGK.dtype)
    if takes_mgpu(dtypes, per_data_shard(B) * R, D, K, n_heads + 2 * G, tp):
        from kernels import flash_cache_mgpu
        kernel = functools.partial(flash_cache_mgpu.flash_cache_mgpu, n_heads=n_heads, tp=tp)
    else:
        kernel = functools.partial(flash_cache_pallas, n_heads=n_heads, tp=tp,
                                   interpret=jax.default_backend() != "gpu")
    fn = shard_kernel(kernel, (rows, PS(), rows, rows, PS(DATA, None), heads, heads),
                      (heads, heads, heads))
    return fn(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK)
