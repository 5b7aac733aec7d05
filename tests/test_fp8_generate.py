"""`fp8_ffn=True` really runs the per-group FP8 FFN inside generation, and what it runs is the
per-group product of REFERENCE.md §7: an independent restatement of the FFN (quantise, then
dequantise, in plain jnp) is swapped in for the engine's and must give the same logits and
tokens, while the full-precision FFN must not."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kernels.fp8_matmul as fp8_module
import lacache_jax as lj
from lacache_jax import quant
from tests.conftest import rel_err

CFG = lj.tiny(d_model=128, d_ff=256, n_heads=4, n_kv_heads=2, n_layers=3)
PROMPTS = [[5, 6, 7, 8], list(range(20, 31))]


@pytest.fixture(scope="module")
def params():
    # std 0.02 weights: near-uniform logits, so FP8 rounding moves argmaxes.
    return lj.quantize_ffn(lj.init_params(CFG, jax.random.key(0), jnp.float32))


def _qdq(a, axis_groups):
    """Round to float8_e4m3fn with one scale (amax / 448) per group, back to float32."""
    amax = jnp.abs(a).max(axis=axis_groups, keepdims=True)
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    q = jnp.clip(a / scale, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(jnp.float32) * scale


def _ffn_restated(x_BLD, norm_D, eps, w: quant.FP8FFN):
    """The per-group FFN from its definition: 1 x 128 activation groups, 128 x 128 weight
    blocks (rebuilt from the stored FP8 bytes and block scales), fp32 products."""
    B, L, D = x_BLD.shape
    x = x_BLD.astype(jnp.float32)
    h = (x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps)) * norm_D

    def act(a):  # [B, L, K] in 1 x 128 groups
        return _qdq(a.reshape(B, L, -1, 128), -1).reshape(a.shape)

    def weight(q_NK, s):  # [N, K] fp8 with [N/128, K/128] scales -> [K, N]
        N, K = q_NK.shape
        blocks = q_NK.astype(jnp.float32).reshape(N // 128, 128, K // 128, 128)
        return (blocks * s[:, None, :, None]).reshape(N, K).T
    hi = jax.lax.Precision.HIGHEST
    gate, up = jnp.split(jnp.matmul(act(h), weight(w.gate_up, w.gate_up_scale), precision=hi),
                         2, -1)
    out = jnp.matmul(act(jax.nn.silu(gate) * up), weight(w.down, w.down_scale), precision=hi)
    return out.astype(x_BLD.dtype)


def _without_fp8(params):
    return dataclasses.replace(
        params, layers=[dataclasses.replace(layer, ffn8=None) for layer in params.layers])


def _counting_fp8_gemm(monkeypatch):
    """Count traced calls of the FP8 GEMM (the CPU dispatch runs the reference)."""
    calls = []
    real = fp8_module.fp8_matmul_ref

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)
    monkeypatch.setattr(fp8_module, "fp8_matmul_ref", counted)
    jax.clear_caches()  # programs traced before must not hide the calls
    return calls


def test_forward_equals_the_restated_per_group_ffn(params, monkeypatch):
    tokens = np.random.default_rng(0).integers(0, 300, (2, 40))
    fp8 = lj.forward(params, CFG, tokens)
    plain = lj.forward(_without_fp8(params), CFG, tokens)
    monkeypatch.setattr(quant, "ffn_fp8", _ffn_restated)
    jax.clear_caches()
    restated = lj.forward(params, CFG, tokens)
    jax.clear_caches()
    # Same quantised operands; only fp32 summation order differs (~1e-7 relative), which can
    # flip an FP8 rounding of an activation very rarely (one flip moves a logit by ~1e-4).
    assert rel_err(fp8, restated) <= 1e-4
    # The FP8 FFN is not the full-precision one: e4m3 rounding moves the logits by a few %.
    assert rel_err(fp8, plain) > 1e-3


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_generate_runs_the_fp8_ffn(params, monkeypatch, cache):
    gen = lj.GenerationConfig(gen_length=16, block_length=8, steps=16, cache=cache,
                              fp8_ffn=True, stop_at_eos=False)
    calls = _counting_fp8_gemm(monkeypatch)
    fp8 = np.asarray(lj.generate(params, CFG, PROMPTS, gen).tokens)
    # Two GEMMs (gate/up, down) per FP8 layer (all but the first) per traced forward.
    assert len(calls) >= 2 * (CFG.n_layers - 1) and len(calls) % (2 * (CFG.n_layers - 1)) == 0
    calls.clear()
    off = dataclasses.replace(gen, fp8_ffn=False)
    bf16 = np.asarray(lj.generate(params, CFG, PROMPTS, off).tokens)
    assert calls == []  # fp8_ffn=False never reaches the FP8 GEMM, though params carry it
    assert (fp8 != bf16).any()
    monkeypatch.setattr(quant, "ffn_fp8", _ffn_restated)
    jax.clear_caches()
    restated = np.asarray(lj.generate(params, CFG, PROMPTS, gen).tokens)
    jax.clear_caches()
    np.testing.assert_array_equal(fp8, restated)
