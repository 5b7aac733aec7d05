"""The split-keys attention of a few query rows (kernels/short_attention.py) in Pallas's
interpret mode against its dense reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.short_attention import shares, short_attention_pallas, short_attention_ref, takes
from tests.conftest import assert_valid_triton, rel_err

CASES = [  # B, L, S, H, G, K, pads, splits
    (1, 32, 256, 4, 4, 32, [0], None),       # the dual step's block: keys over 4 programs
    (2, 8, 192, 4, 2, 16, [0, 70], 2),       # rows padded to 16; GQA; a padded prompt
    (2, 20, 128, 2, 1, 16, [3, 0], 1),       # one program for all keys; MQA
    (1, 64, 320, 2, 2, 32, [0], 3),          # shares of unequal length (5 tiles over 3)
    (2, 32, 200, 2, 2, 16, [0, 30], None),   # keys no whole number of tiles (200 = 3 x 64 + 8)
    (1, 8, 70, 2, 2, 16, [2], 2),            # the ragged tile alone in the second share
    (1, 100, 256, 2, 2, 16, [0], None),      # two row tiles (the second padded), 4 shares
    (2, 130, 320, 2, 1, 16, [0, 50], 2),     # three row tiles, two shares of keys
    (2, 32, 384, 2, 2, 16, [0, 200], 3),     # a share with every key masked (a long pad)
]


def inputs(seed, B, L, S, H, G, K, pads, dtype):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, L, H, K), dtype)
    k = jax.random.normal(ks[1], (B, S, G, K), dtype)
    v = jax.random.normal(ks[2], (B, S, G, K), dtype)
    # masked keys spread through the canvas (a dropped suffix, a padded prompt)
    mask = (jnp.arange(S)[None, :] >= jnp.asarray(pads)[:, None]) & (jnp.arange(S) % 7 != 3)
    return q, k, v, mask


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-L{c[1]}-S{c[2]}-n{c[7]}")
@pytest.mark.parametrize("merge", ["xla", "kernel"])
def test_fp32(case, merge):
    """Both merges of the key shares' states: XLA's after the kernel, and the last share's
    (an atomic count per (batch, head, row tile); several row tiles and batch rows here)."""
    B, L, S, H, G, K, pads, splits = case
    q, k, v, mask = inputs(0, B, L, S, H, G, K, pads, jnp.float32)
    out = short_attention_pallas(q, k, v, mask, splits=splits, merge=merge, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    # fp32 throughout (HIGHEST-precision dots): only the order of summation differs, ~1e-6.
    assert rel_err(out, short_attention_ref(q, k, v, mask)) <= 1e-5


@pytest.mark.parametrize("merge", ["xla", "kernel"])
def test_bf16(merge):
    q, k, v, mask = inputs(1, 2, 32, 256, 4, 4, 32, [0, 40], jnp.bfloat16)
    out = short_attention_pallas(q, k, v, mask, merge=merge, interpret=True)
    ref = short_attention_ref(q, k, v, mask).astype(jnp.float32)
    assert out.dtype == jnp.bfloat16
    # bf16 inputs are exact in the fp32 reference; the kernel rounds the probabilities to
    # bf16 before P @ V and the output to bf16 (2^-9 each): ~4e-3 relative, bound 1e-2.
    assert rel_err(out.astype(jnp.float32), ref) <= 1e-2


def test_masked_keys_get_no_weight():
    """Changing masked keys' values (to huge ones) changes nothing; a mask of another dtype
    keeps what is nonzero (as `astype(bool)`: the reference's and cuDNN's reading)."""
    q, k, v, mask = inputs(2, 1, 16, 128, 2, 2, 16, [10], jnp.float32)
    out = short_attention_pallas(q, k, v, mask, splits=2, interpret=True)
    halves = short_attention_pallas(q, k, v, mask * 0.5, splits=2, interpret=True)
    np.testing.assert_array_equal(np.asarray(halves), np.asarray(out))
    far = ~mask[:, :, None, None]
    again = short_attention_pallas(q, jnp.where(far, 1e4, k), jnp.where(far, -1e4, v), mask,
                                   splits=2, interpret=True)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))


def _pallas_call(jaxpr):
    """The first pallas_call equation in a jaxpr, looking into nested jaxprs (jit)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            found = inner is not None and _pallas_call(getattr(inner, "jaxpr", inner))
            if found:
                return found
    return None


@pytest.mark.parametrize("L,grid_rows", [(32, 1), (64, 1), (100, 2), (256, 4)])
def test_query_rows_in_tiles_of_64(L, grid_rows):
    """Beyond 64 rows (a prefix step's blocks) each program takes a 64-row tile, so its fp32
    accumulator stays 64 x K (a 256-row one spills registers), and the row tiles add programs."""
    from kernels.short_attention import ROW_TILE
    q, k, v, mask = inputs(0, 1, L, 768, 2, 2, 16, [0], jnp.float32)
    eqn = _pallas_call(jax.make_jaxpr(
        lambda *a: short_attention_pallas(*a, interpret=True))(q, k, v, mask).jaxpr)
    grid = eqn.params["grid_mapping"].grid
    q_rows = eqn.params["grid_mapping"].block_mappings[0].block_shape[1].block_size
    assert grid[2] == grid_rows and q_rows == min(ROW_TILE, max(16, L)), (grid, q_rows)


def test_takes_and_bad_arguments():
    q, k, v, mask = inputs(0, 1, 32, 128, 2, 2, 16, [0], jnp.float32)
    assert takes(q, k)
    assert takes(jnp.zeros((1, 100, 2, 16)), jnp.zeros((1, 128, 2, 16)))   # two row tiles
    assert not takes(jnp.zeros((1, 100, 2, 16)), jnp.zeros((1, 100, 2, 16)))  # no fewer keys
    # beyond 64 rows while two shares of every row tile fit one wave: batch 1's 256 rows
    # over LLaDA's 32 heads (256 programs), not 257 rows, not batch 2's 256 (512): cuDNN's
    assert takes(jnp.zeros((1, 256, 32, 16)), jnp.zeros((1, 768, 32, 16)))
    assert not takes(jnp.zeros((1, 257, 32, 16)), jnp.zeros((1, 768, 32, 16)))
    assert not takes(jnp.zeros((2, 256, 32, 16)), jnp.zeros((2, 768, 32, 16)))
    assert not takes(jnp.zeros((1, 257, 2, 16)), jnp.zeros((1, 768, 2, 16)))  # MAX_ROWS
    assert takes(jnp.zeros((1, 128, 64, 16)), jnp.zeros((1, 768, 64, 16)))  # 256: one wave
    assert not takes(jnp.zeros((1, 128, 65, 16)), jnp.zeros((1, 768, 65, 16)))  # 260
    assert takes(jnp.zeros((8, 64, 32, 16)), jnp.zeros((8, 768, 32, 16)))  # one row tile
    assert takes(q, k[:, :100])                                            # a ragged tile
    assert not takes(jnp.zeros((1, 8, 2, 16)), k[:, :40])                  # under one tile
    assert not takes(q, k[:, :32])                                         # no fewer keys
    assert not takes(jnp.zeros((1, 8, 2, 96)), jnp.zeros((1, 128, 2, 96)))  # head dim 96
    with pytest.raises(ValueError, match="splits must be"):
        short_attention_pallas(q, k, v, mask, splits=0, interpret=True)
    with pytest.raises(ValueError, match="at least block_k"):
        short_attention_pallas(q, k[:, :40], v[:, :40], mask[:, :40], interpret=True)
    with pytest.raises(ValueError, match="not divisible by kv heads"):
        short_attention_pallas(q[:, :, :1].repeat(3, 2), k, v, mask, interpret=True)
    with pytest.raises(ValueError, match="key_mask must be"):
        short_attention_pallas(q, k, v, mask[:, :64], interpret=True)
    with pytest.raises(ValueError, match="merge must be 'xla' or 'kernel'"):
        short_attention_pallas(q, k, v, mask, merge="host", interpret=True)


@pytest.mark.parametrize("L,S,merge", [(32, 256, "xla"), (24, 200, "xla"), (256, 768, "xla"),
                                       (32, 768, "kernel"), (256, 768, "kernel")])
def test_kernel_lowers_to_valid_triton_ir(L, S, merge):
    """Whole key tiles, a ragged last tile with query rows padded to a power of two, and a
    prefix step's 256 rows in row tiles, at LLaDA's head width, in bf16; the merge in the
    kernel at a dual step's block and in row tiles."""
    q, k, v, mask = inputs(0, 1, L, S, 2, 2, 128, [0], jnp.bfloat16)
    assert_valid_triton(lambda q, k, v, m: short_attention_pallas(q, k, v, m, merge=merge),
                        q, k, v, mask)


@pytest.mark.parametrize("B,H,row_tiles,n_k_tiles,want", [
    (1, 32, 1, 12, 8),   # the dual step's block: 8 shares asked (6 of 2 tiles run), 192
    (8, 32, 1, 12, 1),   # batch 8's block: 256 programs, one share each (no merge)
    (1, 32, 3, 12, 2),   # a 160-row prefix block: 3 shares would be 288 programs, two waves
    (1, 32, 4, 12, 2),   # 256 rows: 256 programs
    (1, 32, 2, 12, 4),   # 96-128 rows: 256 programs
    (1, 2, 1, 3, 3),     # never more shares than key tiles
])
def test_default_shares(B, H, row_tiles, n_k_tiles, want):
    from kernels.short_attention import PROGRAMS
    got = shares(B, H, row_tiles, n_k_tiles)
    assert got == want
    assert row_tiles == 1 or B * H * row_tiles * got <= PROGRAMS  # row tiles: one wave
