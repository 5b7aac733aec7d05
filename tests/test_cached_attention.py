"""FACache kernel (Pallas, interpret mode on CPU) and its reference against dense softmax
attention: fill, reuse, any block alignment, GQA, key padding, poisoned outputs."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.cached_attention import cached_attention_pallas, cached_attention_ref
from kernels.short_attention import short_attention_ref
from tests.conftest import assert_valid_triton, rel_err


def dense_attention(q, k, v, key_mask):
    """Dense softmax attention in fp32 (the split-keys kernel's reference, q taken as fp32)."""
    return short_attention_ref(q.astype(jnp.float32), k, v, key_mask)


def inputs(seed, B, L, H, G, K, pads, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, L, H, K), dtype)
    k = jax.random.normal(ks[1], (B, L, G, K), dtype)
    v = jax.random.normal(ks[2], (B, L, G, K), dtype)
    key_mask = jnp.arange(L)[None, :] >= jnp.asarray(pads)[:, None]
    return q, k, v, key_mask


CASES = [  # B, L, H, G, K, pads, s, e, tile
    (1, 64, 2, 2, 16, [0], 16, 32, 16),       # block aligned to tiles
    (2, 100, 4, 2, 32, [0, 13], 37, 69, 16),  # unaligned, straddles tiles; GQA; padding
    (1, 90, 4, 1, 16, [5], 0, 24, 32),        # block at the start; MQA
    (2, 77, 2, 2, 16, [3, 0], 45, 77, 16),    # block at the end; L not a tile multiple
    (1, 48, 2, 2, 16, [0], 20, 28, 64),       # one tile larger than everything
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[1]}-s{c[6]}-e{c[7]}-t{c[8]}")
def test_fill_and_reuse_fp32(case):
    B, L, H, G, K, pads, s, e, tile = case
    q, k, v, key_mask = inputs(0, B, L, H, G, K, pads)
    kw = dict(block_q=tile, block_k=tile, interpret=True, poison=True)
    o, state = cached_attention_pallas(q, k, v, key_mask, s, e, mode="fill", **kw)
    dense = dense_attention(q, k, v, key_mask)
    # fp32 with fp32 accumulation; only the summation order differs from dense softmax.
    assert rel_err(o, dense) <= 1e-5
    o_ref, state_ref = cached_attention_ref(q, k, v, key_mask, s, e, mode="fill")
    assert rel_err(o_ref, dense) <= 1e-5
    assert rel_err(state.acc, state_ref.acc) <= 1e-5 and rel_err(state.l, state_ref.l) <= 1e-5
    np.testing.assert_allclose(state.m, state_ref.m, rtol=1e-6)
    # Reuse on unchanged inputs: same tiles, same order of summation -> identical bits.
    again = cached_attention_pallas(q, k, v, key_mask, s, e, state, mode="reuse", **kw)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(o))
    # The uncached baseline sums in the same order too; it only skips writing the state.
    full = cached_attention_pallas(q, k, v, key_mask, s, e, mode="full", **kw)
    np.testing.assert_array_equal(np.asarray(full), np.asarray(o))
    # The block's tokens change (new q/k/v rows in [s, e)): reuse == recompute.
    q2, k2, v2, _ = inputs(1, B, L, H, G, K, pads)
    block = (jnp.arange(L) >= s) & (jnp.arange(L) < e)
    sel = lambda new, old: jnp.where(block[None, :, None, None], new, old)
    q2, k2, v2 = sel(q2, q), sel(k2, k), sel(v2, v)
    reused = cached_attention_pallas(q2, k2, v2, key_mask, s, e, state, mode="reuse", **kw)
    fresh, _ = cached_attention_pallas(q2, k2, v2, key_mask, s, e, mode="fill", **kw)
    np.testing.assert_array_equal(np.asarray(reused), np.asarray(fresh))
    assert rel_err(reused, dense_attention(q2, k2, v2, key_mask)) <= 1e-5
    ref_reused = cached_attention_ref(q2, k2, v2, key_mask, s, e, state_ref, mode="reuse")
    assert rel_err(ref_reused, dense_attention(q2, k2, v2, key_mask)) <= 1e-5


def random_cases(n: int, seed: int = 0):
    """Seeded random shapes, paddings, block positions and tile sizes."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        G = int(rng.choice([1, 2]))
        H = G * int(rng.choice([1, 2]))
        B, L, tile = int(rng.integers(1, 3)), int(rng.integers(20, 110)), int(rng.choice([16, 32]))
        bl = int(rng.integers(1, min(40, L) + 1))
        s = int(rng.integers(0, L - bl + 1))
        pads = [int(p) for p in rng.integers(0, min(s, L // 3) + 1, B)]
        yield B, L, H, G, 16, pads, s, s + bl, tile


@pytest.mark.parametrize("case", list(random_cases(4)), ids=lambda c: f"L{c[1]}-s{c[6]}-e{c[7]}")
def test_random_shapes_fill_reuse_fp32(case):
    """Fill vs dense softmax, reuse after the block changes vs a fresh fill, at random
    shapes (the fixed cases above cover the edge cases by construction)."""
    B, L, H, G, K, pads, s, e, tile = case
    q, k, v, key_mask = inputs(5, B, L, H, G, K, pads)
    kw = dict(block_q=tile, block_k=tile, interpret=True, poison=True)
    o, state = cached_attention_pallas(q, k, v, key_mask, s, e, mode="fill", **kw)
    assert rel_err(o, dense_attention(q, k, v, key_mask)) <= 1e-5  # as in the fixed cases
    block = ((jnp.arange(L) >= s) & (jnp.arange(L) < e))[None, :, None, None]
    q2, k2, v2, _ = inputs(6, B, L, H, G, K, pads)
    q2, k2, v2 = (jnp.where(block, new, old) for new, old in ((q2, q), (k2, k), (v2, v)))
    reused = cached_attention_pallas(q2, k2, v2, key_mask, s, e, state, mode="reuse", **kw)
    fresh, _ = cached_attention_pallas(q2, k2, v2, key_mask, s, e, mode="fill", **kw)
    np.testing.assert_array_equal(np.asarray(reused), np.asarray(fresh))


@pytest.mark.parametrize("case", CASES + list(random_cases(3, seed=1)),
                         ids=lambda c: f"L{c[1]}-s{c[6]}-e{c[7]}-t{c[8]}")
@pytest.mark.parametrize("splits", [None, 3])
def test_reuse_with_split_block_rows(case, splits):
    """Reuse with `block_len`: the block's query tiles stream their keys in `splits` shares
    (`_rows_kernel`), merged afterwards. Other rows: bit-identical to fill; the block's tiles:
    fp32 rounding of another summation order."""
    B, L, H, G, K, pads, s, e, tile = case
    q, k, v, key_mask = inputs(0, B, L, H, G, K, pads)
    kw = dict(block_q=tile, block_k=tile, interpret=True, poison=True)
    o, state = cached_attention_pallas(q, k, v, key_mask, s, e, mode="fill", **kw)
    split = dict(kw, block_len=e - s + 3, splits=splits)  # any bound >= e - s
    again = cached_attention_pallas(q, k, v, key_mask, s, e, state, mode="reuse", **split)
    rows = np.arange(L) // tile * tile
    in_block_tiles = (rows < e) & (rows + tile > s)
    np.testing.assert_array_equal(np.asarray(again)[:, ~in_block_tiles],
                                  np.asarray(o)[:, ~in_block_tiles])
    assert rel_err(again[:, in_block_tiles], o[:, in_block_tiles]) <= 1e-6
    q2, k2, v2, _ = inputs(1, B, L, H, G, K, pads)
    block = ((jnp.arange(L) >= s) & (jnp.arange(L) < e))[None, :, None, None]
    q2, k2, v2 = (jnp.where(block, new, old) for new, old in ((q2, q), (k2, k), (v2, v)))
    reused = cached_attention_pallas(q2, k2, v2, key_mask, s, e, state, mode="reuse", **split)
    assert rel_err(reused, dense_attention(q2, k2, v2, key_mask)) <= 1e-5


def test_stale_cache_is_really_used():
    """Reuse must read the cached state for rows outside the block: a wrong state shows."""
    q, k, v, key_mask = inputs(2, 1, 64, 2, 2, 16, [0])
    kw = dict(block_q=16, block_k=16, interpret=True)
    o, state = cached_attention_pallas(q, k, v, key_mask, 32, 48, mode="fill", **kw)
    bad = type(state)(state.m, state.l * 2.0, state.acc)
    out = cached_attention_pallas(q, k, v, key_mask, 32, 48, bad, mode="reuse", **kw)
    outside = np.r_[0:32, 48:64]
    assert not np.allclose(np.asarray(out)[:, outside], np.asarray(o)[:, outside])
    np.testing.assert_array_equal(np.asarray(out)[:, 32:48], np.asarray(o)[:, 32:48])


def test_bf16():
    q, k, v, key_mask = inputs(3, 2, 96, 4, 2, 32, [0, 9], jnp.bfloat16)
    o, state = cached_attention_pallas(q, k, v, key_mask, 40, 72, mode="fill", block_q=32,
                                       block_k=32, interpret=True, poison=True)
    assert o.dtype == jnp.bfloat16 and state.acc.dtype == jnp.float32
    # bf16 inputs are exact in the fp32 reference; the kernel rounds the probabilities to
    # bf16 before P@V and the output to bf16 (2^-9 each): ~4e-3 relative, bound 1e-2.
    assert rel_err(o.astype(jnp.float32), dense_attention(q, k, v, key_mask)) <= 1e-2
    again = cached_attention_pallas(q, k, v, key_mask, 40, 72, state, mode="reuse",
                                    block_q=32, block_k=32, interpret=True)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(o))


def test_bad_arguments():
    q, k, v, key_mask = inputs(0, 1, 32, 2, 2, 16, [0])
    with pytest.raises(ValueError, match="mode must be"):
        cached_attention_ref(q, k, v, key_mask, 0, 8, mode="other")
    with pytest.raises(ValueError, match="reuse mode needs the state"):
        cached_attention_ref(q, k, v, key_mask, 0, 8, mode="reuse")
    with pytest.raises(ValueError, match="not divisible by kv heads"):
        cached_attention_ref(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), key_mask,
                             0, 8)
    with pytest.raises(ValueError, match="block_q must equal block_k"):
        cached_attention_pallas(q, k, v, key_mask, 0, 8, block_q=16, block_k=32,
                                interpret=True)


@pytest.mark.parametrize("mode", ["full", "fill", "reuse", "reuse_split"])
def test_lowers_to_valid_triton_ir(mode):
    q, k, v, key_mask = inputs(0, 1, 200, 4, 2, 128, [0], jnp.bfloat16)
    _, state = cached_attention_ref(q, k, v, key_mask, 90, 122, mode="fill")
    kw = dict(mode="reuse", block_len=32) if mode == "reuse_split" else dict(mode=mode)
    fn = lambda q, k, v, s, e, st: cached_attention_pallas(
        q, k, v, key_mask, s, e, st if mode.startswith("reuse") else None, **kw)
    assert_valid_triton(fn, q, k, v, 90, 122, state,
                        n_kernels=2 if mode == "reuse_split" else 1)


def test_dispatch_passes_tile_sizes_only_to_the_kernel(monkeypatch):
    """The reference takes only what defines the result; `cached_attention` (as generate calls
    it) hands tile sizes and `block_len` to the Pallas kernel alone."""
    import inspect

    from kernels import cached_attention as ca
    assert set(inspect.signature(cached_attention_ref).parameters) == {
        "q", "k", "v", "key_mask", "s", "e", "state", "mode"}
    q, k, v, key_mask = inputs(0, 1, 32, 2, 2, 16, [0])
    calls = []
    monkeypatch.setattr(ca, "cached_attention_pallas", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    ca.cached_attention(q, k, v, key_mask, 0, 8, mode="fill", block_len=8)
    assert calls == [dict(mode="fill", block_q=64, block_k=64, block_len=8)]
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    o, _ = ca.cached_attention(q, k, v, key_mask, 0, 8, mode="fill", block_len=8)
    assert rel_err(o, dense_attention(q, k, v, key_mask)) <= 1e-5  # as in the fixed cases
