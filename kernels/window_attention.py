"""Attention of Flash-dLLM's query rows that also emits the importance of every key
(REFERENCE.md §8): one pass over the keys computes the raw scores q.k, from which both the
attention output and the weighted sum of those raw scores over query rows and heads come.

The importance of a key is the raw q.k (before the 1/sqrt(K) scale and the softmax) of the
window queries, averaged over those queries and the query heads. With per-row weights w
(1 / (window rows x H) on the window rows, 0 elsewhere: the caller's choice) that is
scores[b, t] = sum over r < W, h of w[b, r] * q[b, r, h] . k[b, t, g(h)]: a by-product of
the scores the attention computes anyway, so no second pass over the keys (and no [B, H, R, T]
score tensor in HBM in the kernel). Masked keys attend nothing and score 0.

Shapes: q [B, R, H, K] (rotated queries of the step's rows, window rows first), k/v
[B, T, G, K] (the cache after this step's writes; GQA: H % G == 0), key_mask [B, T] bool,
weight [B, W] fp32 (W <= R: weights of the first W rows), or None for the attention alone.
Returns o [B, R, H, K] and, with a weight, scores [B, T] fp32. `window_attention_ref` is the
pure-jnp reference (dense scores); `window_attention_pallas` the kernel (Triton lowering:
FlashAttention over key tiles, each program also writing its tile's weighted column sums of
the raw scores, summed over query tiles and heads outside); `window_attention_two_pass` the
library attention (cuDNN on the GPU) and a second, cheap pass over the keys for the scores
(the weighted window queries summed first: one [B, G, K] query per key head);
`window_attention` dispatches: the kernel for few query rows, where it is 1.34x faster than
either alternative, the two passes for many, where the kernel's column sums cost more than
reading the keys again (H200, LLaDA-8B heads, R 128, T 768: kernel 38.8 us vs 52.1 at batch
1, 448.9 vs 303.1 at batch 32; benchmarks/RESULTS.md, third session).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels.cached_attention import LOG2E, MASKED, online_softmax_step
from kernels.forced import Forced


def _check(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW):
    B, R, H, K = q_BRHK.shape
    if k_BTGK.ndim != 4 or k_BTGK.shape != v_BTGK.shape or k_BTGK.shape[0] != B \
            or k_BTGK.shape[3] != K:
        raise ValueError(f"k/v must be [B={B}, T, G, K={K}] alike, got {k_BTGK.shape}, "
                         f"{v_BTGK.shape}")
    if H % k_BTGK.shape[2]:
        raise ValueError(f"query heads {H} not divisible by kv heads {k_BTGK.shape[2]}")
    if key_mask_BT.shape != k_BTGK.shape[:2]:
        raise ValueError(f"key_mask must be {k_BTGK.shape[:2]}, got {key_mask_BT.shape}")
    if weight_BW is not None and (weight_BW.ndim != 2 or weight_BW.shape[0] != B
                                  or weight_BW.shape[1] > R):
        raise ValueError(f"weight must be [B={B}, W <= R={R}], got {weight_BW.shape}")


# --- reference ----------------------------------------------------------------------------

def window_attention_ref(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW=None):
    """Dense scores [B, G, H/G, R, T] in fp32, then both results from them (the softmax and
    output as jax.nn.dot_product_attention's XLA path computes them)."""
    _check(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW)
    B, R, H, K = q_BRHK.shape
    G = k_BTGK.shape[2]
    q = q_BRHK.reshape(B, R, G, H // G, K)
    raw = jnp.einsum("brgjk,btgk->bgjrt", q, k_BTGK, preferred_element_type=jnp.float32)
    ok = key_mask_BT[:, None, None, None, :]
    logits = jnp.where(ok, raw * jnp.float32(1.0 / math.sqrt(K)), jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(logits, axis=-1)
    o = jnp.einsum("bgjrt,btgk->brgjk", p.astype(v_BTGK.dtype), v_BTGK)
    o = o.reshape(B, R, H, K).astype(q_BRHK.dtype)
    if weight_BW is None:
        return o
    W = weight_BW.shape[1]
    scores = jnp.einsum("bgjwt,bw->bt", raw[..., :W, :], weight_BW.astype(jnp.float32))
    return o, jnp.where(key_mask_BT, scores, 0.0)


def window_attention_two_pass(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW=None):
    """The model's attention (`lacache_jax.model.attention`: cuDNN for half types on the GPU,
    XLA elsewhere), then the scores as sum_g (sum_{r, j} w[b, r] q[b, r, g, j]) . k[b, t, g]:
    the reference's sum in another order (fp32, full-precision dots). Under a mesh that splits
    the heads XLA may sum the scores' partial products in another order than on one device: the
    last-bit differences can flip near-ties of the tracked set (seen on fake CPU devices with a
    tiny model, where the reference happens to partition bit-exactly; the dispatch picks this
    path on GPUs only, whose bf16 steps promise no bit-equality across meshes either)."""
    from lacache_jax.model import attention  # the model imports this package's kernels
    _check(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW)
    B, R, H, K = q_BRHK.shape
    G = k_BTGK.shape[2]
    o = attention(q_BRHK, k_BTGK, v_BTGK, key_mask_BT)
    if weight_BW is None:
        return o
    W = weight_BW.shape[1]
    qw = q_BRHK[:, :W].astype(jnp.float32) * weight_BW.astype(jnp.float32)[:, :, None, None]
    q_BGK = qw.reshape(B, W, G, H // G, K).sum(axis=(1, 3))
    scores = jnp.einsum("bgk,btgk->bt", q_BGK, k_BTGK.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    return o, jnp.where(key_mask_BT, scores, 0.0)


# --- Pallas kernel ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles: `q` query rows and `k` keys per step of a program; Triton's `warps`/`stages`."""
    q: int = 64
    k: int = 64
    warps: int = 4
    stages: int = 2

    @classmethod
    def get_default(cls, B: int, R: int, H: int) -> "BlockSizes":
        # Programs = query tiles x B x H: halve the query tile when 64-row tiles would leave
        # most of an H200's 132 SMs idle (batch 1: 2 x 32 programs).
        q = 32 if pl.cdiv(R, 64) * B * H < 264 else 64
        return cls(q=q)


def _kernel(q_ref, k_ref, v_ref, mask_ref, w_ref, o_ref, *s_ref, scale, block_k, n_k_tiles):
    """Program (query tile, batch row, head): FlashAttention of the tile over every key
    tile; with a score output, also the tile's weighted column sums of the raw scores."""
    q = q_ref[...]
    # fp32 inputs: full-precision dots (Triton would otherwise use TF32).
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    w = w_ref[...]

    def body(t, carry):
        keys = pl.ds(t * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        ok = mask_ref[keys] != 0
        raw = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision)
        if s_ref:
            s_ref[0][keys] = jnp.where(ok, jnp.sum(raw * w[:, None], axis=0), 0.0)
        return online_softmax_step(carry, raw * scale, ok, v, precision)
    bq, K = q.shape
    carry = (jnp.zeros((bq, K), jnp.float32), jnp.full((bq,), MASKED, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    # Constant bound outside the carry: the form kernels/cached_attention.py found to lower
    # to Triton with consistent loop-bound types.
    hi = jnp.int32(n_k_tiles)
    _, (acc, _, l) = jax.lax.while_loop(lambda c: c[0] < hi,
                                        lambda c: (c[0] + 1, body(c[0], c[1])),
                                        (jnp.int32(0), carry))
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def window_attention_pallas(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW=None, *,
                            block: BlockSizes | None = None, interpret: bool = False):
    """The kernel; same contract as `window_attention_ref`."""
    out = _pallas_heads(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW, block=block,
                        interpret=interpret)
    return out if weight_BW is None else (out[0], out[1].sum(axis=1))


def _pallas_heads(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW=None, *,
                  block: BlockSizes | None = None, interpret: bool = False):
    """The kernel with its scores still per head ([B, H, T]): under a mesh the heads are
    split over devices, and their sum is taken outside the per-device call. Rows and keys
    are padded to whole tiles (padded keys masked, padded rows weighted 0); each (query tile,
    batch row, head) program writes one [T] row of scores, summed here over query tiles."""
    _check(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW)
    B, R, H, K = q_BRHK.shape
    T, G = k_BTGK.shape[1:3]
    block = block or BlockSizes.get_default(B, R, H)
    Rp, Tp = pl.cdiv(R, block.q) * block.q, pl.cdiv(T, block.k) * block.k
    q = jnp.pad(q_BRHK, [(0, 0), (0, Rp - R), (0, 0), (0, 0)])
    kv_pad = [(0, 0), (0, Tp - T), (0, 0), (0, 0)]
    k, v = jnp.pad(k_BTGK, kv_pad), jnp.pad(v_BTGK, kv_pad)
    mask = jnp.pad(key_mask_BT.astype(jnp.int32), [(0, 0), (0, Tp - T)])
    scored = weight_BW is not None
    w = jnp.zeros((B, Rp), jnp.float32)
    if scored:
        w = w.at[:, :weight_BW.shape[1]].set(weight_BW.astype(jnp.float32))
    rep, nq = H // G, Rp // block.q
    tile = pl.BlockSpec((None, block.q, None, K), lambda i, b, h: (b, i, h, 0))
    kv = pl.BlockSpec((None, Tp, None, K), lambda i, b, h: (b, 0, h // rep, 0))
    out_shape = [jax.ShapeDtypeStruct((B, Rp, H, K), q.dtype)]
    out_specs = [tile]
    if scored:
        out_shape.append(jax.ShapeDtypeStruct((nq, B, H, Tp), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, None, Tp), lambda i, b, h: (i, b, h, 0)))
    from jax.experimental.pallas import triton as plgpu
    outs = pl.pallas_call(
        functools.partial(_kernel, scale=LOG2E / math.sqrt(K), block_k=block.k,
                          n_k_tiles=Tp // block.k),
        grid=(nq, B, H),
        in_specs=[tile, kv, kv, pl.BlockSpec((None, Tp), lambda i, b, h: (b, 0)),
                  pl.BlockSpec((None, block.q), lambda i, b, h: (b, i))],
        out_specs=out_specs, out_shape=out_shape, interpret=interpret,
        name="window_attention_scored" if scored else "window_attention",
        compiler_params=plgpu.CompilerParams(num_warps=block.warps, num_stages=block.stages),
    )(q, k, v, mask, w)
    o = outs[0][:, :R]
    return o if not scored else (o, outs[1].sum(axis=0)[..., :T])


# Benchmarks force an implementation while tracing (kernels/forced.py).
implementation = Forced("window_attention", choices=("pallas", "ref", "two_pass"))

# Up to this many query rows (B R, per device) the kernel, above it the two passes (measured
# at 128 and 4096 rows; the crossing between is not measured).
KERNEL_MAX_ROWS = 512


def default_choice(M: int) -> str:
    """The implementation `window_attention` runs for M = B R query rows."""
    if jax.default_backend() != "gpu":
        return "ref"
    return "pallas" if M <= KERNEL_MAX_ROWS else "two_pass"


def window_attention(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW=None):
    """Dispatch (`default_choice`): on the GPU the Pallas kernel (per (row shard, head
    shard) under a mesh, the per-head scores summed over heads by XLA outside it) or the two
    passes, the reference elsewhere."""
    from jax.sharding import PartitionSpec as PS

    from lacache_jax.sharding import DATA, MODEL, per_data_shard, shard_kernel
    # The rows one device runs (per data shard under a mesh).
    use = implementation.choice(default_choice(per_data_shard(q_BRHK.shape[0])
                                               * q_BRHK.shape[1]))
    if use == "ref":
        return window_attention_ref(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW)
    if use == "two_pass":
        return window_attention_two_pass(q_BRHK, k_BTGK, v_BTGK, key_mask_BT, weight_BW)
    heads, rows = PS(DATA, None, MODEL, None), PS(DATA, None)
    scored = weight_BW is not None
    kernel = functools.partial(_pallas_heads, interpret=jax.default_backend() != "gpu")
    args = (q_BRHK, k_BTGK, v_BTGK, key_mask_BT) + ((weight_BW,) if scored else ())
    fn = shard_kernel(kernel, (heads, heads, heads, rows, rows)[:len(args)],
                      (heads, PS(DATA, MODEL, None)) if scored else heads)
    out = fn(*args)
    return out if not scored else (out[0], out[1].sum(axis=1))
