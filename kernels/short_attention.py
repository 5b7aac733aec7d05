"""Attention of a few query rows (a dual-cache step's block, 32 rows) over a whole canvas of
keys, with the keys split over many programs (flash-decoding).

cuDNN gives each (batch, head) one program per 64 query rows: at batch 1 a 32-row block over
768 keys is 32 programs on 132 SMs, each streaming every key tile in turn (25.8 us on the
H200, against 3.6 us to read q, K and V and 8.4 us for this kernel: RESULTS.md,
twenty-third session). Here programs (b, h, i, j) each take the i-th tile of `ROW_TILE`
query rows (one tile up to 64 rows) and the j-th share of the key tiles (`stream_keys`, the
online softmax of FACache's kernel) and write its partial state; `merge_partials` combines
them in log2 space after the kernel, or (`merge="kernel"`) the last share of each (batch,
head, row tile) to finish does, in the kernel. Base-2 online softmax in fp32, probabilities
rounded to the inputs' type before P @ V, as in FACache's Triton kernel.

Shapes: q [B, L, H, K] (L query rows), k/v [B, S, G, K] (GQA: H % G == 0), key_mask [B, S]
(masked keys get no weight; a row needs one unmasked key); S need not be a whole number of
key tiles (a prompt of any length): the last tile is read ending at the last key, its keys of
the tile before masked out. `short_attention_ref` is the dense reference of the same
signature; `takes` says where the kernel applies; `lacache_jax.model.attention` dispatches
(this kernel where it takes the call on a GPU in bf16/f16, else cuDNN or XLA).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels.cached_attention import LOG2E, empty_state, merge_partials, stream_keys

MAX_ROWS = 256  # query rows `takes` may give it; beyond ROW_TILE only while every row tile
                # keeps two shares of keys in one wave (batch 1: cuDNN's one program per 64
                # rows per head streams all the keys; at batch 8 cuDNN's grid is full: its own)
ROW_TILE = 64   # query rows of a program beyond 64 (a 64 x 128 fp32 accumulator: 4 warps)
BLOCK_K = 64    # key tile (FACache's Triton default)
PROGRAMS = 256  # aimed-at programs, a wave as `shares` counts it (264, two per SM, gave batch 8's
                # dual block two shares a head: 2% slower than one, thirty-sixth session)
# Whether the default merges the key shares' states in the kernel (the last share of each
# (batch, head, row tile) to finish merges them: `merge="kernel"`) instead of XLA's three
# fusions after it (1.8 + 1.3 + 1.9 us a layer at the dual step's block, RESULTS.md
# twenty-fourth session). Off: on an H100 (thirty-second session) it passes its GPU tests but
# takes 12.1 us a call against 8.4 for the kernel + XLA's merge at batch 1's 32 rows, and the
# dual step is 0.5% slower with it. Read when a caller is traced: set it before the first call.
MERGE_IN_KERNEL = 0


def short_attention_ref(q_BLHK, k_BSGK, v_BSGK, key_mask_BS):
    """Dense softmax attention in fp32, scale 1/sqrt(K), cast to q's type."""
    rep = q_BLHK.shape[2] // k_BSGK.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), rep, axis=2) for x in (k_BSGK, v_BSGK))
    scores = jnp.einsum("blhk,bshk->bhls", q_BLHK.astype(jnp.float32), k,
                        precision="highest") / math.sqrt(q_BLHK.shape[-1])
    scores = jnp.where(key_mask_BS.astype(bool)[:, None, None, :], scores, -jnp.inf)
    out = jnp.einsum("bhls,bshk->blhk", jax.nn.softmax(scores, -1), v, precision="highest")
    return out.astype(q_BLHK.dtype)


def takes(q_BLHK, k_BSGK) -> bool:
    """Whether the kernel runs this call: fewer query rows than keys, at most `ROW_TILE` or at
    most `MAX_ROWS` in row tiles whose programs with two shares of keys fit one wave, at least
    one key tile, a head dim Triton's blocks take (a power of two from 16)."""
    B, L, H, K = q_BLHK.shape
    S = k_BSGK.shape[1]
    rows = L <= ROW_TILE or (
        L <= MAX_ROWS and shares(B, H, pl.cdiv(L, ROW_TILE), pl.cdiv(S, BLOCK_K)) >= 2)
    return rows and L < S and S >= BLOCK_K and K >= 16 and K & (K - 1) == 0


def shares(B: int, H: int, row_tiles: int, n_k_tiles: int) -> int:
    """Default shares of each (batch, head, row tile)'s key tiles, at least one. One row tile
    (a dual step's block): about `PROGRAMS` programs, rounded up (at batch 1 and 8 the best
    or within 10% of it: RESULTS.md, twenty-third session; batch 8's one share a head, no
    merge, 11.19-11.22 ms a dual step against two's 11.41-11.45, thirty-sixth). Row tiles
    (a prefix step's block of 65-256 rows): at most one wave of `PROGRAMS`, where 3 shares of
    160 or 256 rows (288 and 384 programs) took 28.5-28.7 us, 2 shares 20.8-22.1, cuDNN
    29.3-29.7 (thirtieth session)."""
    programs = B * H * row_tiles
    n = pl.cdiv(PROGRAMS, programs) if row_tiles == 1 else PROGRAMS // programs
    return max(1, min(n_k_tiles, n))


def _share_state(q_ref, k_ref, v_ref, mask_ref, *, scale, block_k, per, n_k_tiles):
    """Program (b, h, i, j)'s online-softmax state (acc, m, l) over the j-th share of the key
    tiles."""
    lo = pl.program_id(3) * per
    return stream_keys(q_ref[...], k_ref, v_ref, mask_ref, 0, 0, lo,
                       jnp.minimum(lo + per, n_k_tiles), "all",
                       empty_state(q_ref.shape[0], q_ref.shape[1]), scale=scale,
                       block_k=block_k)


def _kernel(q_ref, k_ref, v_ref, mask_ref, acc_out, m_out, l_out, **share):
    acc_out[...], m_out[...], l_out[...] = _share_state(q_ref, k_ref, v_ref, mask_ref, **share)


def _kernel_merged(q_ref, k_ref, v_ref, mask_ref, count_in, o_ref, count_ref, acc_p, m_p, l_p,
                   *, n, heads, row_tiles, interpret, **share):
    """`_kernel` whose share also stores its state into the partials; the last of the n
    shares of a (batch, head, row tile) to count itself in merges them in share order (as
    `merge_partials`, in log2 space) and writes the output rows."""
    from jax.experimental.pallas import triton as plgpu
    del count_in  # aliased to count_ref
    b, h, i, j = (pl.program_id(a) for a in range(4))
    acc, m, l = _share_state(q_ref, k_ref, v_ref, mask_ref, **share)
    R = q_ref.shape[0]
    rows = pl.ds(i * R, R)
    acc_p[j, b, rows, h, :], m_p[j, b, h, rows], l_p[j, b, h, rows] = acc, m, l
    if not interpret:  # one program at a time there, and no rule for the barrier
        plgpu.debug_barrier()  # every thread's state stored before the count is released
    slot = (b * heads + h) * row_tiles + i
    done = plgpu.atomic_add(count_ref, (slot,), jnp.int32(1))

    @pl.when(done == n - 1)
    def _():
        def load(ref, s, *index):  # volatile: from L2, where the other shares put them
            return plgpu.load(ref.at[jnp.int32(s), *index], volatile=True)
        ms = [load(m_p, s, b, h, rows) for s in range(n)]
        m_all = functools.reduce(jnp.maximum, ms)
        acc_all = l_all = None
        for s, m_s in enumerate(ms):
            w = jnp.exp2(m_s - m_all)
            l_s = load(l_p, s, b, h, rows) * w
            a_s = load(acc_p, s, b, rows, h, slice(None)) * w[:, None]
            l_all, acc_all = (l_s, a_s) if s == 0 else (l_all + l_s, acc_all + a_s)
        o_ref[b, rows, h, :] = (acc_all / l_all[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_k", "splits", "merge", "interpret"))
def short_attention_pallas(q_BLHK, k_BSGK, v_BSGK, key_mask_BS, *, block_k: int = BLOCK_K,
                           splits: int | None = None, merge: str | None = None,
                           interpret: bool = False):
    """The split-keys kernel; at most `splits` (default: `shares`)
    shares of the key tiles per (batch, head, tile of `ROW_TILE` query rows), each of
    ceil(tiles / splits) tiles, so fewer where that leaves a share empty. `merge`: "xla"
    (the shares' states merged by `merge_partials` after the kernel) or "kernel" (by the last
    share to finish: `_kernel_merged`); default by `MERGE_IN_KERNEL`."""
    B, L, H, K = q_BLHK.shape
    S, G = k_BSGK.shape[1], k_BSGK.shape[2]
    if k_BSGK.shape != v_BSGK.shape or k_BSGK.shape[0] != B or k_BSGK.shape[3] != K:
        raise ValueError(f"k/v must be [B, S, G, K] for q {q_BLHK.shape}, got "
                         f"{k_BSGK.shape}, {v_BSGK.shape}")
    if H % G:
        raise ValueError(f"query heads {H} not divisible by kv heads {G}")
    if key_mask_BS.shape != (B, S):
        raise ValueError(f"key_mask must be [B, S] = {(B, S)}, got {key_mask_BS.shape}")
    if S < block_k:
        raise ValueError(f"keys {S} must be at least block_k {block_k}")
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    merge = merge or ("kernel" if MERGE_IN_KERNEL else "xla")
    if merge not in ("xla", "kernel"):
        raise ValueError(f"merge must be 'xla' or 'kernel', got {merge!r}")
    n_k_tiles = pl.cdiv(S, block_k)  # a ragged last tile re-reads the one before, masked
    # Triton's dots take power-of-two rows from 16: the padded rows are dropped afterwards.
    R = max(16, 1 << (L - 1).bit_length()) if L <= ROW_TILE else ROW_TILE
    r = pl.cdiv(L, R)
    per = pl.cdiv(n_k_tiles, splits or shares(B, H, r, n_k_tiles))
    n = pl.cdiv(n_k_tiles, per)  # no program without keys
    q = jnp.pad(q_BLHK, ((0, 0), (0, r * R - L), (0, 0), (0, 0)))
    rep = H // G
    kv_spec = pl.BlockSpec((None, S, None, K), lambda b, h, i, j: (b, 0, h // rep, 0))
    row_spec = pl.BlockSpec((None, None, None, R), lambda b, h, i, j: (j, b, h, i))
    from jax.experimental.pallas import triton as plgpu
    in_specs = [pl.BlockSpec((None, R, None, K), lambda b, h, i, j: (b, i, h, 0)), kv_spec,
                kv_spec, pl.BlockSpec((None, S), lambda b, h, i, j: (b, 0))]
    mask = key_mask_BS.astype(bool).astype(jnp.int32)
    states = [jax.ShapeDtypeStruct((n, B, r * R, H, K), jnp.float32),
              jax.ShapeDtypeStruct((n, B, H, r * R), jnp.float32),
              jax.ShapeDtypeStruct((n, B, H, r * R), jnp.float32)]
    share = dict(scale=LOG2E / math.sqrt(K), block_k=block_k, per=per, n_k_tiles=n_k_tiles)
    if merge == "kernel":
        whole, counts = pl.no_block_spec, B * H * r
        out, *_ = pl.pallas_call(
            functools.partial(_kernel_merged, n=n, heads=H, row_tiles=r, interpret=interpret,
                              **share),
            grid=(B, H, r, n), in_specs=in_specs + [whole], out_specs=[whole] * 5,
            out_shape=[jax.ShapeDtypeStruct((B, r * R, H, K), q_BLHK.dtype),
                       jax.ShapeDtypeStruct((counts,), jnp.int32), *states],
            input_output_aliases={4: 1}, interpret=interpret, name="short_attention_merged",
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        )(q, k_BSGK, v_BSGK, mask, jnp.zeros((counts,), jnp.int32))
        return out[:, :L]
    acc, m, l = pl.pallas_call(
        functools.partial(_kernel, **share),
        grid=(B, H, r, n), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, R, None, K), lambda b, h, i, j: (j, b, i, h, 0)),
                   row_spec, row_spec],
        out_shape=states, interpret=interpret, name="short_attention",
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    )(q, k_BSGK, v_BSGK, mask)
    return merge_partials(acc, m, l)[:, :L].astype(q_BLHK.dtype)
