"""Attention of the query rows with the importance as a by-product (kernels/window_attention.py):
the reference against the model's attention and against importance computed row by row in
float64; the Pallas kernel in interpret mode against the reference; its Triton IR through
MLIR's verifier; the kernel on the GPU (`-m gpu`); bad shapes refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import window_attention as wa
from kernels.window_attention import (BlockSizes, window_attention_pallas,
                                      window_attention_ref, window_attention_two_pass)
from lacache_jax.model import attention
from tests.conftest import assert_valid_triton


def operands(B, R, T, H, G, K, W, dtype=jnp.float32, seed=0):
    """Random q/k/v; the first keys of row b masked (left padding of b tokens); weights of
    the first W rows 1 / (rows x H) with the last window row of row 0 unused (weight 0), as
    flash.py's mean over the window rows actually present."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype)
               for shape in ((B, R, H, K), (B, T, G, K), (B, T, G, K)))
    mask = jnp.asarray(np.arange(T)[None, :] >= np.arange(B)[:, None])
    win = np.ones((B, W))
    win[0, -1] = 0
    w = jnp.asarray(win / (win.sum(-1, keepdims=True) * H), jnp.float32)
    return q, k, v, mask, w


def test_reference_is_attention_plus_the_mean_raw_score():
    """o equals the model's attention (jax.nn.dot_product_attention, used before); scores
    equal the float64 mean over weighted rows and heads of q.k, 0 on masked keys."""
    B, R, T, H, G, K, W = 3, 7, 11, 4, 2, 16, 3
    q, k, v, mask, w = operands(B, R, T, H, G, K, W)
    o, scores = jax.jit(window_attention_ref)(q, k, v, mask, w)
    # Same fp32 products; XLA may fuse the softmax differently: a few ulps of O(1) outputs.
    np.testing.assert_allclose(np.asarray(o), np.asarray(jax.jit(attention)(q, k, v, mask)),
                               rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(jax.jit(window_attention_ref)(q, k, v, mask)), o)
    qn, kn, wn = (np.asarray(a, np.float64) for a in (q, k, w))
    raw = np.einsum("brhk,bthk->brht", qn, np.repeat(kn, H // G, axis=2))
    want = np.einsum("brht,br->bt", raw[:, :W], wn) * np.asarray(mask)
    # fp32 dots of K = 16 unit normals (|q.k| ~ 4), summed over <= 12 terms: ~1e-6 absolute.
    np.testing.assert_allclose(np.asarray(scores), want, rtol=0, atol=1e-5)
    assert (np.asarray(scores)[~np.asarray(mask)] == 0).all() and (want != 0).sum() > 20


def test_two_passes_match_the_reference():
    """The library attention and the scores from the summed window queries: the same fp32
    products as the reference, summed in another order."""
    B, R, T, H, G, K, W = 3, 7, 11, 4, 2, 16, 3
    q, k, v, mask, w = operands(B, R, T, H, G, K, W)
    o_r, s_r = jax.jit(window_attention_ref)(q, k, v, mask, w)
    o, s = jax.jit(window_attention_two_pass)(q, k, v, mask, w)
    # Both softmaxes in fp32 over the same logits: a few ulps of O(1) outputs. Scores: sums
    # of <= 12 terms of |q.k| x weight ~ 4 / 12 in another order: ~1e-6.
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_r), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_r), rtol=0, atol=1e-5)
    assert (np.asarray(s)[~np.asarray(mask)] == 0).all()
    np.testing.assert_array_equal(np.asarray(window_attention_two_pass(q, k, v, mask)),
                                  np.asarray(o))


def test_dispatch_by_query_rows(monkeypatch):
    """The kernel for few query rows, the two passes for many (H200 measurements), the
    reference off the GPU; a forced choice wins, an unknown one is refused."""
    monkeypatch.setattr(wa.jax, "default_backend", lambda: "gpu")
    assert wa.default_choice(128) == "pallas" == wa.default_choice(wa.KERNEL_MAX_ROWS)
    assert wa.default_choice(wa.KERNEL_MAX_ROWS + 1) == "two_pass"
    monkeypatch.setattr(wa.jax, "default_backend", lambda: "cpu")
    assert wa.default_choice(32 * 128) == "ref"
    q, k, v, mask, w = operands(2, 5, 9, 2, 2, 8, 2)
    with wa.implementation("two_pass"):
        o, s = wa.window_attention(q, k, v, mask, w)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(window_attention_two_pass(
        q, k, v, mask, w)[1]))
    with pytest.raises(ValueError, match="must be one of"):
        with wa.implementation("cudnn"):
            pass


CASES = {  # B, R, T, H, G, K, W, tile: rows and keys padded to whole tiles
    "gqa_ragged_tiles": (3, 21, 37, 4, 2, 16, 5, BlockSizes(q=16, k=16)),
    "mha_window_over_two_tiles": (2, 40, 32, 2, 2, 16, 20, BlockSizes(q=16, k=16)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference_interpret(case):
    B, R, T, H, G, K, W, block = CASES[case]
    q, k, v, mask, w = operands(B, R, T, H, G, K, W, seed=R)
    o_r, s_r = window_attention_ref(q, k, v, mask, w)
    o, s = window_attention_pallas(q, k, v, mask, w, block=block, interpret=True)
    # fp32 online softmax over 16-key tiles vs the dense softmax: a few ulps of O(1) values;
    # scores: the same fp32 products summed in another order (|terms| ~ 4 x weight).
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_r), rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_r), rtol=0, atol=1e-5)
    if case == "mha_window_over_two_tiles":  # the variant without the score output
        o_only = window_attention_pallas(q, k, v, mask, block=block, interpret=True)
        np.testing.assert_array_equal(np.asarray(o_only), np.asarray(o))


def test_triton_ir_verifies():
    q, k, v, mask, w = operands(2, 40, 50, 4, 2, 32, 16, dtype=jnp.bfloat16)
    for weight in (w, None):
        assert_valid_triton(lambda *a: window_attention_pallas(*a),
                            q, k, v, mask, *(() if weight is None else (weight,)))


def test_bad_shapes_are_refused():
    q, k, v, mask, w = operands(2, 5, 9, 4, 2, 16, 3)
    with pytest.raises(ValueError, match="k/v must be"):
        window_attention_ref(q, k, v[:, :4], mask, w)
    with pytest.raises(ValueError, match="not divisible by kv heads"):
        window_attention_ref(q[:, :, :3], k, v, mask, w)
    with pytest.raises(ValueError, match="key_mask must be"):
        window_attention_ref(q, k, v, mask[:, :4], w)
    with pytest.raises(ValueError, match="weight must be"):
        window_attention_pallas(q, k, v, mask, jnp.ones((2, 6)), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("B,R,W", [(1, 128, 16), (4, 128, 16), (3, 70, 16)])
def test_kernel_on_gpu(B, R, W):
    """LLaDA-8B head shapes (H = G = 32, K = 128), T = 768 keys."""
    q, k, v, mask, w = operands(B, R, 768, 32, 32, 128, W, dtype=jnp.bfloat16, seed=B)
    o_r, s_r = window_attention_ref(q, k, v, mask, w)
    o, s = window_attention_pallas(q, k, v, mask, w)
    # bf16 outputs: the tiled softmax rounds unnormalised probabilities to bf16 where the
    # reference rounds normalised ones, so the fp32 results differ by far less than an ulp, but
    # their bf16 roundings may land one ulp apart: one ulp of the largest |o|, at most 2^-7 of
    # it (8 significant bits; 2^-8 was too tight: 2^-9 apart at |o| = 0.38 in interpret mode
    # at B 4). Scores: fp32 sums of bf16 products in another order, ~1e-5 of |q.k| ~ 11.
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_r, np.float32),
                               rtol=0, atol=2.0 ** -7 * float(jnp.abs(o_r).max()))
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_r), rtol=0, atol=1e-3)


@pytest.mark.gpu
def test_two_passes_on_gpu():
    """Batch 32 at LLaDA-8B head shapes (the two passes' regime): cuDNN against the
    reference."""
    q, k, v, mask, w = operands(32, 128, 768, 32, 32, 128, 16, dtype=jnp.bfloat16, seed=32)
    o_r, s_r = window_attention_ref(q, k, v, mask, w)
    o, s = jax.jit(window_attention_two_pass)(q, k, v, mask, w)
    # cuDNN's bf16 output vs the reference's: as in test_kernel_on_gpu, one bf16 ulp of the
    # largest |o|. Scores: the weighted queries are summed in fp32 before the dot (the
    # reference sums the weighted bf16 products), the same ~1e-5 relative reordering.
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_r, np.float32),
                               rtol=0, atol=2.0 ** -7 * float(jnp.abs(o_r).max()))
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_r), rtol=0, atol=1e-3)
