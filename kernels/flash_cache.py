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
reference with the same signature; `flash_cache` dispatches (Pallas on GPU, reference
elsewhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def flash_cache(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK, *, n_heads: int,
                tp: int = 1):
    """Dispatch: the reference everywhere for now (the Pallas kernel is added below)."""
    return flash_cache_ref(h_BRD, w_qkv_DN, cos_BRk, sin_BRk, cols_BR, k_BTGK, v_BTGK,
                           n_heads=n_heads, tp=tp)
