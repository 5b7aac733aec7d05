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
    `programs`: 0 for one program per (row tile, head part), else the (head part, depth
    chunk) work of each row tile dealt in equal contiguous runs to that many programs (a
    head cut between programs is summed from fp32 partials by the last of them to finish:
    `Stream`). A batch-1 step of LLaDA-8B has one row tile and 96 heads: one program per
    head leaves 36 of the H200's 132 SMs idle, yet 132 programs ran slower than 96 at every
    tile (0.93-1.07x the unfused ops against 1.19x; RESULTS.md, twentieth session), and 192
    or 384 at 64-row tiles too (0.87-1.02x against 1.22x; thirty-fourth), so the default
    stays 0. Programs run row tile fastest, so the row tiles of one head's weight columns
    follow each other and share them in L2."""
    rows: int = 64
    depth: int = 64
    warps: int = 4
    stages: int = 2
    splits: int = 1
    programs: int = 0

    @classmethod
    def get_default(cls, M: int, D: int) -> "BlockSizes":
        # Above 128 rows, 128-row tiles: at R 128, D 4096 on the H200, 128-deep chunks with 3
        # stages ran 49.1 and 49.3 us where 64-deep with 4 stages ran 53.5 and 51.4-53.4
        # (sixth and tenth sessions). At 65-128 rows (a batch-1 flash step) two 64-row tiles,
        # 64 deep, 4 stages: faster than one 128-row tile in 5 of 6 same-run comparisons at
        # 128 rows (means 0.5-14% where they won, 3.5% slower once; round medians 1-2%;
        # fifteenth and twentieth sessions, benchmarks/RESULTS.md; the sixth after the
        # switch). Smaller tiles keep 64-deep chunks with 4 stages.
        rows = min(64 if M <= 128 else 128, max(16, 1 << max(M - 1, 0).bit_length()))
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


@dataclasses.dataclass(frozen=True)
class Stream:
    """How a row tile's work is dealt to programs: unit hs C + c is head part hs's depth
    chunk c (`heads` parts of `chunks` chunks), and program p takes units [p per, p per +
    per). `segments`: the most head parts one program touches; `pieces`: the most
    programs one head part is cut between (1: no partials)."""
    heads: int
    chunks: int
    per: int

    @classmethod
    def of(cls, heads: int, chunks: int, programs: int) -> "Stream":
        """`programs` 0: one program per head part (per = chunks)."""
        return cls(heads, chunks, pl.cdiv(heads * chunks, programs) if programs else chunks)

    @property
    def programs(self) -> int:
        return pl.cdiv(self.heads * self.chunks, self.per)

    @property
    def segments(self) -> int:
        C, per, U = self.chunks, self.per, self.heads * self.chunks
        return max((min(p * per + per, U) - 1) // C - p * per // C + 1
                   for p in range(self.programs))

    @property
    def pieces(self) -> int:
        C, per = self.chunks, self.per
        return max((j * C + C - 1) // per - j * C // per + 1 for j in range(self.heads))


def _kernel(h_ref, w_ref, cos_ref, sin_ref, idx_ref, k_in, v_in, *refs,
            n_heads, n_kv, tp, K, rows, depth, splits, stream, n_valid, interpret):
    """Program (row tile i, p) projects the tile's rows onto its units' columns (both K/2
    halves of a head part, so RoPE pairs stay in registers), head part by head part: hs =
    head j's part `splits`, j < H a query head, then G key heads, then G value heads. A head
    part whole in the program is finished at once: rotate q and k, store q, or scatter k /
    v rows into the cache at their flat row index (rows at index n_valid, padding, are
    masked). A head part cut between programs leaves an fp32 partial; the last of them to
    finish (an atomic count) sums the partials in program order (the same bits run to run)
    and finishes it."""
    del k_in, v_in  # aliased to k_ref / v_ref: only the queried rows are overwritten
    if stream.pieces > 1:
        count_in, q_ref, k_ref, v_ref, part_ref, count_ref = refs
        del count_in  # aliased to count_ref
    else:
        q_ref, k_ref, v_ref = refs
    i32 = jnp.int32  # explicit: weak-typed Python ints in a select lower badly to Triton
    i, p = pl.program_id(0), pl.program_id(1)
    C, per = i32(stream.chunks), i32(stream.per)
    first, end = p * per, jnp.minimum(p * per + per, C * stream.heads)
    half = K // 2
    width_s = half // splits  # the part's columns in each half
    r = pl.ds(i * rows, rows)
    hq, hk = n_heads // tp, n_kv // tp
    width = (hq + 2 * hk) * K
    for seg in range(stream.segments):
        hs = jax.lax.div(first, C) + seg
        c0 = jnp.maximum(first - hs * C, 0)
        c1 = jnp.maximum(jnp.minimum(end - hs * C, C), c0)  # c0 == c1: past the program's end
        j, part = jax.lax.div(hs, i32(splits)), jax.lax.rem(hs, i32(splits))
        off = part * width_s
        # Column of head j in w_qkv: `tp` groups of [q heads | k heads | v heads] (Layer.tp).
        is_q, is_k = j < n_heads, (j >= n_heads) & (j < n_heads + n_kv)
        local = j - jnp.where(is_q, i32(0), jnp.where(is_k, i32(n_heads), i32(n_heads + n_kv)))
        per_g = jnp.where(is_q, i32(hq), i32(hk))
        first_g = jnp.where(is_q, i32(0), jnp.where(is_k, i32(hq), i32(hq + hk)))
        # Non-negative operands: C division (lax) is floor division here, and lowers to Triton.
        col = jax.lax.div(local, per_g) * width + (first_g + jax.lax.rem(local, per_g)) * K + off

        def step(d, acc, col=col):
            a1, a2 = acc
            dd = pl.ds(d * depth, depth)
            h = h_ref[r, dd]
            w1 = w_ref[dd, pl.ds(col, width_s)]
            w2 = w_ref[dd, pl.ds(col + half, width_s)]
            return (a1 + jnp.dot(h, w1, preferred_element_type=jnp.float32),
                    a2 + jnp.dot(h, w2, preferred_element_type=jnp.float32))
        zero = jnp.zeros((rows, width_s), jnp.float32)
        x1, x2 = jax.lax.fori_loop(c0, c1, step, (zero, zero))
        finish = functools.partial(_rotate_and_write, h_ref, cos_ref, sin_ref, idx_ref, q_ref,
                                   k_ref, v_ref, j=j, r=r, off=off, width_s=width_s,
                                   half=half, K=K, n_heads=n_heads, n_kv=n_kv,
                                   n_valid=n_valid)
        live = c0 < c1
        if stream.pieces == 1:
            pl.when(live)(lambda finish=finish, x1=x1, x2=x2: finish(x1, x2))
            continue
        lead = jax.lax.div(hs * C, per)  # the head part's first program
        n_pieces = jax.lax.div(hs * C + C - 1, per) - lead + 1
        pl.when(live & (n_pieces == 1))(lambda finish=finish, x1=x1, x2=x2: finish(x1, x2))
        pl.when(live & (n_pieces > 1))(functools.partial(
            _cut, part_ref, count_ref, finish, x1, x2, piece=p - lead, n_pieces=n_pieces,
            tile=i * i32(stream.heads) + hs, r=r,
            pcols=[pl.ds(hs * (2 * width_s) + lo, width_s) for lo in (0, width_s)],
            max_pieces=stream.pieces, interpret=interpret))


def _cut(part_ref, count_ref, finish, x1, x2, *, piece, n_pieces, tile, r, pcols, max_pieces,
         interpret):
    """A head part cut between programs: leave this program's fp32 partial; the last of its
    n_pieces programs to count itself in sums them in piece order and finishes."""
    part_ref[piece, r, pcols[0]] = x1
    part_ref[piece, r, pcols[1]] = x2
    if not interpret:  # one program at a time there, and no rule for the barrier
        plgpu.debug_barrier()  # every thread's partial stored before the count is released
    done = plgpu.atomic_add(count_ref, (tile,), jnp.int32(1))

    @pl.when(done == n_pieces - 1)
    def _():
        # volatile: read from L2, where the other programs put their partials (no stale L1
        # line); the lowering of cache_modifier=".cg" fails in jax 0.10.2. Slots past
        # n_pieces hold another head's partial or nothing: selected away, never summed.
        def total(c):
            y = plgpu.load(part_ref.at[jnp.int32(0), r, c], volatile=True)
            for s in range(1, max_pieces):
                y_s = plgpu.load(part_ref.at[jnp.int32(s), r, c], volatile=True)
                y = y + jnp.where(s < n_pieces, y_s, 0.0)
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
    if block.programs < 0:
        raise ValueError(f"block.programs={block.programs} must be >= 0 (0: one a head part)")
    Mp = pl.cdiv(M, block.rows) * block.rows
    h, idx = flat_rows(h_BRD, cols_BR, T, Mp)
    cos, sin = (jnp.pad(x.reshape(M, K // 2), [(0, Mp - M), (0, 0)]) for x in (cos_BRk, sin_BRk))
    NH = n_heads + 2 * G
    stream = Stream.of(NH * block.splits, D // block.depth, block.programs)
    kernel = functools.partial(_kernel, n_heads=n_heads, n_kv=G, tp=tp, K=K, rows=block.rows,
                               depth=block.depth, splits=block.splits, stream=stream,
                               n_valid=B * T, interpret=interpret)
    grid = (Mp // block.rows, stream.programs)
    out_shape = [jax.ShapeDtypeStruct((Mp, n_heads * K), h.dtype),
                 jax.ShapeDtypeStruct((B * T, G * K), k_BTGK.dtype),
                 jax.ShapeDtypeStruct((B * T, G * K), v_BTGK.dtype)]
    extra, aliases = (), {5: 1, 6: 2}
    if stream.pieces > 1:  # the partials, and per row tile and head part a count of pieces
        n_counts = grid[0] * stream.heads
        out_shape += [jax.ShapeDtypeStruct((stream.pieces, Mp, NH * K), jnp.float32),
                      jax.ShapeDtypeStruct((n_counts,), jnp.int32)]
        extra, aliases = (jnp.zeros((n_counts,), jnp.int32),), {5: 1, 6: 2, 7: 4}
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
