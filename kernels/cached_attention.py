"""FACache: bidirectional FlashAttention whose online-softmax state over the unchanged keys is
cached across the steps of a semi-autoregressive block (REFERENCE.md §7).

Keys split into the current block C = [s, e) and the unchanged rest U. Every query tile
accumulates U keys first (phase A), then C keys (phase B), in base-2 online softmax:

- `full`:  plain FlashAttention (both phases, no state written): the uncached baseline.
- `fill`:  computes both phases for every tile; returns the output and, per query row, the
           state (m, l, acc) after phase A: row max (log2 units), normaliser, unnormalised
           accumulator. For rows outside C it stays valid while only C's tokens change.
- `reuse`: query tiles wholly outside C start from the cached state and stream only the key
           tiles overlapping C (U-vs-U tiles are skipped), in the same order of summation as
           `fill`: on unchanged inputs their rows reproduce the Triton kernel's fill bit
           for bit (on Hopper in bf16, fill runs the Mosaic GPU kernel, whose summation
           order differs: the same values to fp32/bf16 rounding). The few tiles
           overlapping C recompute everything: by default each in one program (both phases,
           bit for bit as fill too); with a static `block_len` >= e - s, with their keys split
           over many programs and the partial states merged (`_rows_kernel`), so they do not
           stream the whole canvas serially while the rest of the GPU idles.

`s`, `e` are runtime values (no recompilation per block), any alignment: key tiles straddling a
block edge are split exactly by masks. `key_mask` [B, L] masks padded (or dropped) keys.
Shapes: q [B, L, H, K], k/v [B, L, G, K] (GQA: H % G == 0), state m/l [B, H, L], acc
[B, L, H, K], all state in fp32. `cached_attention_ref` is the dense pure-jnp reference (the
kernel's signature less its tile arguments); `cached_attention` dispatches (the Mosaic GPU
kernel for full and fill on Hopper, this Pallas Triton kernel on other GPUs and for reuse,
the reference elsewhere).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

LOG2E = math.log2(math.e)
# Finite stand-in for -inf: keeps exp2(m_prev - m_next) defined when nothing is unmasked yet.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FAState:
    m: jax.Array    # [B, H, L] running max of log2-scaled scores over U keys
    l: jax.Array    # [B, H, L] normaliser
    acc: jax.Array  # [B, L, H, K] unnormalised output


def _check(q, k, v, key_mask, mode, state):
    if mode not in ("full", "fill", "reuse"):
        raise ValueError(f"mode must be 'full', 'fill' or 'reuse', got {mode!r}")
    B, L, H, K = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != L or k.shape[3] != K:
        raise ValueError(f"k/v must be [B, L, G, K] matching q {q.shape}, got {k.shape}, {v.shape}")
    if H % k.shape[2]:
        raise ValueError(f"query heads {H} not divisible by kv heads {k.shape[2]}")
    if key_mask.shape != (B, L):
        raise ValueError(f"key_mask must be {(B, L)}, got {key_mask.shape}")
    if (mode == "reuse") != (state is not None):
        raise ValueError("reuse mode needs the state from fill mode; fill takes none")


# --- reference ----------------------------------------------------------------------------

def cached_attention_ref(q, k, v, key_mask, s, e, state: FAState | None = None, *,
                         mode: str = "fill"):
    """Dense reference: (o, state) in fill mode, o in reuse mode. Rows outside [s, e) take
    the cached state in reuse mode (tile granularity changes which rows recompute, not the
    result, so it takes no tile sizes)."""
    _check(q, k, v, key_mask, mode, state)
    B, L, H, K = q.shape
    rep = H // k.shape[2]
    kr = jnp.repeat(k, rep, axis=2).astype(jnp.float32)
    vr = jnp.repeat(v, rep, axis=2).astype(jnp.float32)
    scores = jnp.einsum("blhk,bshk->bhls", q.astype(jnp.float32), kr,
                        precision=jax.lax.Precision.HIGHEST) * (LOG2E / math.sqrt(K))
    pos = jnp.arange(L)
    in_c = (pos >= s) & (pos < e)
    valid = key_mask.astype(bool)[:, None, None, :]

    def partial(keys_ok):
        sc = jnp.where(keys_ok, scores, MASKED)
        m = jnp.maximum(sc.max(-1), MASKED)
        p = jnp.where(keys_ok, jnp.exp2(sc - m[..., None]), 0.0)
        acc = jnp.einsum("bhls,bshk->blhk", p, vr, precision=jax.lax.Precision.HIGHEST)
        return m, p.sum(-1), acc

    m_a, l_a, acc_a = partial(valid & ~in_c[None, None, None, :])
    if mode == "reuse":
        outside = ~in_c
        m_a = jnp.where(outside[None, None, :], state.m, m_a)
        l_a = jnp.where(outside[None, None, :], state.l, l_a)
        acc_a = jnp.where(outside[None, :, None, None], state.acc, acc_a)
    m_b, l_b, acc_b = partial(valid & in_c[None, None, None, :])
    m = jnp.maximum(m_a, m_b)
    ca, cb = jnp.exp2(m_a - m), jnp.exp2(m_b - m)
    l = l_a * ca + l_b * cb
    acc = acc_a * ca.transpose(0, 2, 1)[..., None] + acc_b * cb.transpose(0, 2, 1)[..., None]
    o = (acc / l.transpose(0, 2, 1)[..., None]).astype(q.dtype)
    return (o, FAState(m_a, l_a, acc_a)) if mode == "fill" else o


# --- Pallas kernel ------------------------------------------------------------------------

def online_softmax_step(carry, qk, ok, v, precision):
    """One key tile of FlashAttention's online softmax (base 2): carry (acc, m, l), qk the
    tile's scaled scores in log2 units [bq, bk], ok its valid keys [bk], v its values."""
    acc, m, l = carry
    qk = jnp.where(ok[None, :], qk, MASKED)
    m_new = jnp.maximum(m, qk.max(axis=-1))
    corr = jnp.exp2(m - m_new)
    p = jnp.where(ok[None, :], jnp.exp2(qk - m_new[:, None]), 0.0)
    l = l * corr + p.sum(axis=-1)
    acc = acc * corr[:, None] + jnp.dot(p.astype(v.dtype), v, precision=precision,
                                        preferred_element_type=jnp.float32)
    return acc, m_new, l


def stream_keys(q, k_ref, v_ref, mask_ref, s, e, lo, hi, keys: str, carry, *, scale, block_k):
    """Online softmax of query tile `q` over key tiles [lo, hi), keeping the keys outside the
    block (`keys="u"`), inside it ("c") or all of them ("all"); carry = (acc, m, l). Where
    the keys are no whole number of tiles (the refs' length S, at least `block_k`), the last
    tile is read from S - block_k, its keys of the tile before masked out."""
    # fp32 inputs: full-precision dots (Triton would otherwise use TF32).
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    n_keys = k_ref.shape[0]
    ragged = n_keys % block_k != 0

    def body(t, carry):
        first = t * block_k
        start = jnp.minimum(first, n_keys - block_k) if ragged else first
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        kpos = start + jnp.arange(block_k)
        in_c = (kpos >= s) & (kpos < e)
        ok = mask_ref[pl.ds(start, block_k)] != 0
        if ragged:
            ok = ok & (kpos >= first)
        if keys != "all":
            ok = ok & (in_c if keys == "c" else ~in_c)
        qk = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision) * scale
        return online_softmax_step(carry, qk, ok, v, precision)
    # A while loop whose bound is a closed-over constant, not a carried value: the Triton
    # lowering turns `fori`-shaped loops (bound in the carry) into scf.for and emits bounds
    # of mismatched types when they are run-time values (seen on jax 0.11.2).
    hi = jnp.asarray(hi, jnp.int32)
    _, carry = jax.lax.while_loop(lambda c: c[0] < hi, lambda c: (c[0] + 1, body(c[0], c[1])),
                                  (jnp.asarray(lo, jnp.int32), carry))
    return carry


def empty_state(block_q, K):
    return (jnp.zeros((block_q, K), jnp.float32), jnp.full((block_q,), MASKED, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))


def _kernel(se_ref, q_ref, k_ref, v_ref, mask_ref, *refs,
            scale, block_q, block_k, n_k_tiles, reuse, write_state, skip_block_tiles,
            n_poisoned):
    if reuse:  # the cached state comes in only in reuse mode
        m_in, l_in, acc_in, *refs = refs
    out_refs = refs[n_poisoned:]  # poisoned inputs alias the outputs; never read
    s, e = se_ref[0], se_ref[1]
    q = q_ref[...]
    q_lo = pl.program_id(0) * block_q
    tile_in_u = (q_lo + block_q <= s) | (q_lo >= e)
    # Integer flags, not scalar selects: the Triton lowering types those selects as i1.
    use_cache = jnp.asarray(reuse & tile_in_u, jnp.int32)
    stream = functools.partial(stream_keys, q, k_ref, v_ref, mask_ref, s, e, scale=scale,
                               block_k=block_k)
    empty = empty_state(block_q, q.shape[-1])
    if reuse:
        cached = (acc_in[...], m_in[...], l_in[...])
        carry = tuple(jnp.where(use_cache != 0, c, z) for c, z in zip(cached, empty))
    else:
        carry = empty
    # Tiles overlapping the block, when `_rows_kernel` computes them: no work here (their
    # output is written over afterwards; until then it is 0 / 0).
    work = use_cache if skip_block_tiles else 1
    # Phase A: U keys, unless this tile's state comes from the cache.
    carry = stream(0, n_k_tiles * (1 - use_cache) * work, "u", carry)
    if write_state:
        acc_out, m_out, l_out = out_refs[1:]
        acc_out[...], m_out[...], l_out[...] = carry
    # Phase B: only the key tiles that overlap [s, e).
    lo = s // block_k
    hi = jnp.minimum((e + block_k - 1) // block_k, n_k_tiles)
    carry = stream(lo, lo + (hi - lo) * work, "c", carry)
    acc, _, l = carry
    out_refs[0][...] = (acc / l[:, None]).astype(out_refs[0].dtype)


def _rows_kernel(se_ref, q_ref, k_ref, v_ref, mask_ref, acc_out, m_out, l_out, *,
                 scale, block_q, block_k, n_k_tiles, n_splits):
    """Reuse mode, the query tiles overlapping the block: all keys, split over programs
    (grid axis 3) so the few block tiles do not stream the whole canvas serially; each
    program writes the partial state of its share of the keys."""
    s, e, start = se_ref[0], se_ref[1], se_ref[2]
    q = q_ref[pl.ds(start + pl.program_id(0) * block_q, block_q), :]
    per = (n_k_tiles + n_splits - 1) // n_splits
    lo = pl.program_id(3) * per
    acc, m, l = stream_keys(q, k_ref, v_ref, mask_ref, s, e, lo,
                            jnp.minimum(lo + per, n_k_tiles), "all",
                            empty_state(block_q, q.shape[-1]), scale=scale, block_k=block_k)
    acc_out[...], m_out[...], l_out[...] = acc, m, l


def _block_rows(se, q_p, k_p, v_p, mask_p, rep, block_len, splits, block_q, interpret):
    """(start row, rows [B, R, H, K]) of the query tiles overlapping [s, e) with e - s <=
    `block_len`, from `_rows_kernel`'s partial states merged in log2 space."""
    B, Lp, H, K = q_p.shape
    n_tiles = Lp // block_q
    R = min(pl.cdiv(block_len, block_q) + 1, n_tiles) * block_q
    S = splits or max(1, min(n_tiles, pl.cdiv(264, (R // block_q) * B * H)))
    start = jnp.minimum((se[0] // block_q) * block_q, Lp - R)
    se3 = jnp.concatenate([se, start[None]])
    row_spec = pl.BlockSpec((None, None, None, block_q), lambda c, b, h, k: (k, b, h, c))
    acc_spec = pl.BlockSpec((None, None, block_q, None, K), lambda c, b, h, k: (k, b, c, h, 0))
    full_q = pl.BlockSpec((None, Lp, None, K), lambda c, b, h, k: (b, 0, h, 0))
    kv_spec = pl.BlockSpec((None, Lp, None, K), lambda c, b, h, k: (b, 0, h // rep, 0))
    from jax.experimental.pallas import triton as plgpu
    acc, m, l = pl.pallas_call(
        functools.partial(_rows_kernel, scale=LOG2E / math.sqrt(K), block_q=block_q,
                          block_k=block_q, n_k_tiles=n_tiles, n_splits=S),
        grid=(R // block_q, B, H, S),
        in_specs=[pl.BlockSpec((3,), lambda c, b, h, k: (0,)), full_q, kv_spec, kv_spec,
                  pl.BlockSpec((None, Lp), lambda c, b, h, k: (b, 0))],
        out_specs=[acc_spec, row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((S, B, R, H, K), jnp.float32),
                   jax.ShapeDtypeStruct((S, B, H, R), jnp.float32),
                   jax.ShapeDtypeStruct((S, B, H, R), jnp.float32)],
        interpret=interpret, name="facache_block_rows",
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    )(se3, q_p, k_p, v_p, mask_p)
    return start, merge_partials(acc, m, l).astype(q_p.dtype)


def merge_partials(acc_nBLHK, m_nBHL, l_nBHL):
    """Attention output [B, L, H, K] (fp32) from the partial online-softmax states of n
    disjoint shares of the keys, merged in log2 space."""
    m_all = m_nBHL.max(0)
    w_nBHL = jnp.exp2(m_nBHL - m_all)
    l_all = (l_nBHL * w_nBHL).sum(0)
    acc_all = (acc_nBLHK * w_nBHL.transpose(0, 1, 3, 2)[..., None]).sum(0)
    return acc_all / l_all.transpose(0, 2, 1)[..., None]


@functools.partial(jax.jit, static_argnames=("mode", "block_q", "block_k", "block_len",
                                             "splits", "interpret", "poison"))
def cached_attention_pallas(q, k, v, key_mask, s, e, state: FAState | None = None, *,
                            mode: str = "fill", block_q: int = 64, block_k: int = 64,
                            block_len: int | None = None, splits: int | None = None,
                            interpret: bool = False, poison: bool = False):
    """The Pallas (Triton lowering) kernel; same contract as `cached_attention_ref`.

    Reuse mode with `block_len` (a static bound on e - s): the query tiles overlapping the
    block are computed by `_rows_kernel` with the keys split over `splits` programs (default:
    enough for ~2 per SM) instead of one serial stream each; their rows then sum in another
    order than fill's (fp32 rounding), the rows outside them stay bit-identical.
    `poison` (tests) makes the outputs NaN-filled buffers first, so an unwritten tile shows."""
    _check(q, k, v, key_mask, mode, state)
    if block_q != block_k:
        raise ValueError("block_q must equal block_k (tiles are padded to one multiple)")
    B, L, H, K = q.shape
    G = k.shape[2]
    rep = H // G
    Lp = pl.cdiv(L, block_q) * block_q
    pad = [(0, 0), (0, Lp - L), (0, 0), (0, 0)]
    q_p, k_p, v_p = (jnp.pad(x, pad) for x in (q, k, v))
    mask_p = jnp.pad(key_mask.astype(jnp.int32), [(0, 0), (0, Lp - L)])
    reuse, write_state = mode == "reuse", mode == "fill"
    state_in = [] if not reuse else [
        jnp.pad(state.m, [(0, 0), (0, 0), (0, Lp - L)]),
        jnp.pad(state.l, [(0, 0), (0, 0), (0, Lp - L)]), jnp.pad(state.acc, pad)]
    se = jnp.stack([jnp.asarray(s, jnp.int32), jnp.asarray(e, jnp.int32)])

    row_spec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
    tile_spec = pl.BlockSpec((None, block_q, None, K), lambda i, b, h: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, Lp, None, K), lambda i, b, h: (b, 0, h // rep, 0))
    in_specs = [pl.BlockSpec((2,), lambda i, b, h: (0,)), tile_spec, kv_spec, kv_spec,
                pl.BlockSpec((None, Lp), lambda i, b, h: (b, 0))]
    in_specs += [row_spec, row_spec, tile_spec][:len(state_in)]
    out_shape = [jax.ShapeDtypeStruct((B, Lp, H, K), q.dtype)]
    out_specs = [tile_spec]
    if write_state:
        out_shape += [jax.ShapeDtypeStruct((B, Lp, H, K), jnp.float32),
                      jax.ShapeDtypeStruct((B, H, Lp), jnp.float32),
                      jax.ShapeDtypeStruct((B, H, Lp), jnp.float32)]
        out_specs += [tile_spec, row_spec, row_spec]
    poisoned = [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape] if poison else []
    split_rows = reuse and block_len is not None
    kernel = functools.partial(_kernel, scale=LOG2E / math.sqrt(K), block_q=block_q,
                               block_k=block_k, n_k_tiles=Lp // block_k, reuse=reuse,
                               write_state=write_state, skip_block_tiles=split_rows,
                               n_poisoned=len(poisoned))
    from jax.experimental.pallas import triton as plgpu
    outs = pl.pallas_call(
        kernel, grid=(Lp // block_q, B, H), in_specs=in_specs + out_specs[:len(poisoned)],
        out_specs=out_specs, out_shape=out_shape, interpret=interpret,
        input_output_aliases={len(in_specs) + j: j for j in range(len(poisoned))},
        name=f"facache_{mode}",
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    )(se, q_p, k_p, v_p, mask_p, *state_in, *poisoned)
    o = outs[0]
    if split_rows:
        start, rows = _block_rows(se, q_p, k_p, v_p, mask_p, rep, block_len, splits, block_q,
                                  interpret)
        tile = (start + jnp.arange(rows.shape[1])) // block_q * block_q
        overlaps = ((tile < e) & (tile + block_q > s))[None, :, None, None]
        old = jax.lax.dynamic_slice_in_dim(o, start, rows.shape[1], axis=1)
        o = jax.lax.dynamic_update_slice_in_dim(o, jnp.where(overlaps, rows, old), start, 1)
    o = o[:, :L]
    if not write_state:
        return o
    acc, m, l = outs[1][:, :L], outs[2][..., :L], outs[3][..., :L]
    return o, FAState(m, l, acc)


def takes_row_bounds(q, mode: str) -> bool:
    """Whether `cached_attention` runs the Mosaic GPU kernel here, which takes per-row bounds
    s, e [B] itself: Hopper, and settings that kernel takes at its defaults (full or fill,
    bf16/f16, a head dim its shared memory holds: `cached_attention_mgpu.refusal`).
    Otherwise callers with per-row bounds run it row by row (vmapped)."""
    if jax.default_backend() != "gpu":
        return False
    from kernels.cached_attention_mgpu import refusal
    if refusal(q.dtype, q.shape[-1], mode) is not None:
        return False
    from kernels.fp8_matmul import compute_capability
    return compute_capability()[0] == 9


def cached_attention(q, k, v, key_mask, s, e, state: FAState | None = None, *,
                     mode: str = "fill", block_q: int = 64, block_k: int = 64,
                     block_len: int | None = None):
    """Dispatch: full and fill on Hopper in bf16/f16 (`takes_row_bounds`) to the Mosaic GPU
    kernel (`kernels/cached_attention_mgpu.py`: 1.8-2.1x the Triton kernel's speed at L
    1024-4096 on the H200, 1.3-1.4x at 512, RESULTS.md's eighteenth session; `block_len`
    sizes its phase-B window); other GPU cases to the Pallas Triton kernel (with the tile sizes and
    `block_len`, which change only how the kernel splits the work); the dense reference
    elsewhere."""
    if takes_row_bounds(q, mode):
        from kernels.cached_attention_mgpu import cached_attention_mgpu
        return cached_attention_mgpu(q, k, v, key_mask, s, e, mode=mode, block_len=block_len)
    if jax.default_backend() == "gpu":
        return cached_attention_pallas(q, k, v, key_mask, s, e, state, mode=mode,
                                       block_q=block_q, block_k=block_k, block_len=block_len)
    return cached_attention_ref(q, k, v, key_mask, s, e, state, mode=mode)
