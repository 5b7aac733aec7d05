"""FP8 GEMM and fused quantisation kernels (Pallas, interpret mode on CPU) against their
pure-jnp references and the dequantised fp32 math; Triton IR checked by MLIR's verifier."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.fp8_matmul import (fp8_matmul_mgpu, fp8_matmul_pallas, fp8_matmul_ref,
                                k_splits, row_tile)
from kernels.fused_quant import (quantize_groups, rmsnorm_quant_pallas, rmsnorm_quant_ref,
                                 rms_normed, swiglu_quant_pallas, swiglu_quant_ref)
from lacache_jax.quant import dequantize_act, dequantize_weight, quantize_weight
from tests.conftest import assert_valid_triton, rel_err

FP8_REL = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: round-to-nearest error <= 2^-4 relative


def operands(M, K, N, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (M, K), jnp.float32)
    w = jax.random.normal(kw, (K, N), jnp.float32) * K ** -0.5
    return x, w, quantize_groups(x), quantize_weight(w)


@pytest.mark.parametrize("M,K,N", [(1, 128, 128), (5, 256, 384), (33, 384, 256),
                                   (130, 256, 128)])
def test_gemm_matches_dequantised_fp32(M, K, N):
    x, w, (xq, xs), (wq, ws) = operands(M, K, N)
    out = fp8_matmul_pallas(xq, xs, wq, ws, jnp.float32, interpret=True, poison=True)
    assert out.shape == (M, N) and np.isfinite(np.asarray(out)).all()
    exact = jnp.matmul(dequantize_act(xq, xs), dequantize_weight(wq, ws), precision="highest")
    # FP8 products are exact in fp32 and each group's sum is rescaled once: what remains is
    # fp32 summation order over K (~K * 2^-24), far below 1e-5.
    assert rel_err(out, exact) <= 1e-5
    assert rel_err(fp8_matmul_ref(xq, xs, wq, ws, jnp.float32), exact) <= 1e-5
    # Against the unquantised matmul: both operands carry <= 2^-4 relative rounding.
    assert rel_err(out, x @ w) <= 2 * FP8_REL


def test_gemm_bf16_output_row_tiles_and_k_splits():
    _, _, (xq, xs), (wq, ws) = operands(40, 512, 256, seed=1)
    ref = fp8_matmul_ref(xq, xs, wq, ws, jnp.float32)
    for bm, bn, splits in ((16, 128, 1), (64, 256, 2), (32, 256, 4)):
        out = fp8_matmul_pallas(xq, xs, wq, ws, block_m=bm, block_n=bn, splits=splits,
                                interpret=True, poison=True)
        assert out.dtype == jnp.bfloat16
        assert rel_err(out.astype(jnp.float32), ref) <= 2.0 ** -8  # one bf16 rounding
    with pytest.raises(ValueError, match="splits 3 must divide"):
        fp8_matmul_pallas(xq, xs, wq, ws, splits=3, interpret=True)
    with pytest.raises(ValueError, match="block_n 384"):
        fp8_matmul_pallas(xq, xs, wq, ws, block_n=384, interpret=True)
    assert [row_tile(m) for m in (1, 16, 17, 100, 5000)] == [16, 16, 32, 64, 64]
    # Decode shapes split K until ~2 programs per SM; big M never splits.
    assert k_splits(1, 32, 96) == 12 and k_splits(1, 192, 32) == 2 and k_splits(128, 192, 32) == 1


def test_gemm_rejects_bad_shapes():
    _, _, (xq, xs), (wq, ws) = operands(4, 256, 128)
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_matmul_ref(xq[:, :200], xs, wq[:, :200], ws)
    with pytest.raises(ValueError, match="scales"):
        fp8_matmul_pallas(xq, xs[:, :1], wq, ws, interpret=True)


@pytest.mark.parametrize("M,D", [(3, 256), (40, 384)])
def test_rmsnorm_quant(M, D):
    kx, kw = jax.random.split(jax.random.key(M))
    x = (jax.random.normal(kx, (M, D)) * 3).astype(jnp.bfloat16)
    w = (1 + 0.2 * jax.random.normal(kw, (D,))).astype(jnp.bfloat16)
    q, s = rmsnorm_quant_pallas(x, w, 1e-5, interpret=True, poison=True)
    qr, sr = rmsnorm_quant_ref(x, w, 1e-5)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (M, D) and s.shape == (M, D // 128)
    # Same statistics (`rms_rstd`), but XLA may keep excess precision (skip the bf16 rounding
    # of the normed value) inside jitted code, which the kernel never does: the normed values
    # agree to one bf16 rounding (2^-8 relative), so scales do too; an FP8 code then flips by
    # one step (<= 2^-3 relative) where a value lies near a rounding boundary.
    np.testing.assert_allclose(s, sr, rtol=2.0 ** -7)
    assert rel_err(dequantize_act(q, s), dequantize_act(qr, sr)) <= 2.0 ** -5
    assert rel_err(dequantize_act(q, s), rms_normed(x, w, 1e-5).astype(jnp.float32)) <= FP8_REL


@pytest.mark.parametrize("M,F", [(2, 128), (35, 384)])
def test_swiglu_quant(M, F):
    gu = (jax.random.normal(jax.random.key(F), (M, 2 * F)) * 2).astype(jnp.bfloat16)
    q, s = swiglu_quant_pallas(gu, interpret=True, poison=True)
    qr, sr = swiglu_quant_ref(gu)
    # Same fp32 arithmetic per element; only exp's implementation may differ in the last bit.
    np.testing.assert_allclose(s, sr, rtol=1e-6)
    assert rel_err(dequantize_act(q, s), dequantize_act(qr, sr)) <= 1e-3
    gate, up = jnp.split(gu.astype(jnp.float32), 2, axis=-1)
    assert rel_err(dequantize_act(q, s), jax.nn.silu(gate) * up) <= FP8_REL


def test_zero_groups_and_clipping():
    x = jnp.zeros((2, 256), jnp.bfloat16).at[1, 128:].set(1e4)
    q, s = swiglu_quant_pallas(jnp.concatenate([x, jnp.ones_like(x)], 1), interpret=True)
    assert float(s[0, 0]) == 1.0 and not np.asarray(q[0].astype(jnp.float32)).any()
    assert float(jnp.abs(q.astype(jnp.float32)).max()) == 448.0


def test_kernels_lower_to_valid_triton_ir(monkeypatch):
    _, _, (xq, xs), (wq, ws) = operands(32, 512, 256)
    for bn in (128, 256):
        assert_valid_triton(lambda *a: fp8_matmul_pallas(*a, block_n=bn), xq, xs, wq, ws,
                            monkeypatch=monkeypatch)
    x = jnp.ones((20, 512), jnp.bfloat16)
    assert_valid_triton(lambda x, w: rmsnorm_quant_pallas(x, w, 1e-5), x, x[0],
                        monkeypatch=monkeypatch)
    assert_valid_triton(swiglu_quant_pallas, x, monkeypatch=monkeypatch)


def test_ffn_through_the_kernels_matches_the_reference_path(monkeypatch):
    """`quant.ffn_fp8` as it runs on a GPU (every op through a Pallas kernel, here in
    interpret mode) against the same function on the references (the CPU dispatch)."""
    import functools

    from kernels import fp8_matmul as fm
    from kernels import fused_quant as fq
    from lacache_jax import quant
    k = jax.random.split(jax.random.key(3), 4)
    D, F = 256, 384
    w = quant.FP8FFN(*quantize_weight(jax.random.normal(k[0], (D, 2 * F)) * D ** -0.5),
                     *quantize_weight(jax.random.normal(k[1], (F, D)) * F ** -0.5))
    x = jax.random.normal(k[2], (2, 9, D)).astype(jnp.bfloat16)
    norm = (1 + 0.1 * jax.random.normal(k[3], (D,))).astype(jnp.bfloat16)
    ref = quant.ffn_fp8(x, norm, 1e-5, w)
    monkeypatch.setattr(quant, "fp8_matmul",
                        functools.partial(fm.fp8_matmul_pallas, interpret=True))
    monkeypatch.setattr(quant, "rmsnorm_quant",
                        functools.partial(fq.rmsnorm_quant_pallas, interpret=True))
    monkeypatch.setattr(quant, "swiglu_quant",
                        functools.partial(fq.swiglu_quant_pallas, interpret=True))
    out = quant.ffn_fp8(x, norm, 1e-5, w)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    # The paths differ where the fused RMSNorm rounds an activation to the other FP8 neighbour
    # (see test_rmsnorm_quant): each path is within FP8's error of the exact FFN on the same
    # quantised weights, and they are closer to each other than to it.
    h = rms_normed(x, norm, 1e-5).astype(jnp.float32)
    gate, up = jnp.split(h @ dequantize_weight(w.gate_up, w.gate_up_scale), 2, axis=-1)
    exact = (jax.nn.silu(gate) * up) @ dequantize_weight(w.down, w.down_scale)
    err_ref = rel_err(ref.astype(jnp.float32), exact)
    err_out = rel_err(out.astype(jnp.float32), exact)
    assert err_ref <= 2 * FP8_REL and err_out <= 2 * FP8_REL
    assert rel_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= max(err_ref, err_out)


def test_mgpu_gemm_lowers_for_hopper():
    """The Mosaic GPU kernel cannot run here (TMA has no interpreter); lowering it for CUDA
    still checks its layouts, wgmma operand shapes and shared-memory budget. Numerics:
    tests/test_gpu.py on the H200."""
    _, _, (xq, xs), (wq, ws) = operands(100, 512, 256)
    for kw in (dict(), dict(block_n=256, stages=3), dict(warp_specialized=False),
               dict(groups_per_step=2), dict(splits=2), dict(splits=4, warp_specialized=False),
               dict(ctas=132), dict(ctas=3)):
        fn = functools.partial(fp8_matmul_mgpu, **kw)
        text = jax.jit(fn).trace(xq, xs, wq, ws).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        jax.jit(functools.partial(fp8_matmul_mgpu, block_n=256, stages=4)).trace(
            xq, xs, wq, ws).lower(lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match="block_n 96"):
        fp8_matmul_mgpu(xq, xs, wq, ws, block_n=96)
    with pytest.raises(ValueError, match="splits 2 x groups_per_step 4"):
        fp8_matmul_mgpu(xq, xs, wq, ws, splits=2, groups_per_step=4)
    with pytest.raises(ValueError, match="persistent CTAs"):
        fp8_matmul_mgpu(xq, xs, wq, ws, ctas=132, splits=2)
    _, _, (xq, xs), (wq, ws) = operands(32, 1024, 256)  # the decode sweep's deepest K split
    fn = functools.partial(fp8_matmul_mgpu, splits=8, warp_specialized=False)
    assert "mosaic_gpu" in jax.jit(fn).trace(xq, xs, wq, ws).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("cc,M,kernel", [
    ("9.0", 32, "pallas"), ("9.0", 128, "mgpu"), ("8.9", 256, "pallas"),
    ("10.0", 256, "pallas"), ("8.0", 32, None)])
def test_dispatch_on_gpus(monkeypatch, cc, M, kernel):
    """Which kernel `fp8_matmul` picks per GPU and M; no FP8 tensor cores: a clear error."""
    import kernels.fp8_matmul as fm
    _, _, (xq, xs), (wq, ws) = operands(M, 256, 128)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda: [type("Gpu", (), {"compute_capability": cc})])
    monkeypatch.setattr(fm, "fp8_matmul_pallas", lambda *a: "pallas")
    mgpu_settings = []
    monkeypatch.setattr(fm, "fp8_matmul_mgpu", lambda *a, **kw: mgpu_settings.append(kw) or "mgpu")
    if kernel is None:
        with pytest.raises(ValueError, match="FP8 tensor cores .* this GPU's is 8.0"):
            fm.fp8_matmul(xq, xs, wq, ws)
    else:
        assert fm.fp8_matmul(xq, xs, wq, ws) == kernel
        # one output tile (< 132 SMs) and 2 K groups: the deep-step pipeline
        assert mgpu_settings == ([dict(stages=2, groups_per_step=2)] if kernel == "mgpu" else [])


def test_mgpu_config():
    """The Mosaic GPU pipeline per shape, as fp8_tiles measured on the H200 (132 SMs)."""
    from kernels.fp8_matmul import mgpu_config
    deep = dict(stages=2, groups_per_step=2)
    assert mgpu_config(256, 4096, 12288) == deep  # LLaDA-8B's down GEMM: 64 tiles
    assert mgpu_config(256, 2 * 12288, 4096) == {}  # gate/up: 384 tiles
    assert mgpu_config(4096, 4096, 12288) == dict(deep, ctas=132)  # 1024 tiles: persistent
    assert mgpu_config(256, 4096, 3 * 128) == {}  # an odd number of K groups
    assert mgpu_config(256, 4096, 12288, sms=16) == dict(deep, ctas=16)  # 4 tiles per SM
