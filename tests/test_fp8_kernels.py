"""FP8 GEMM and fused quantisation kernels (Pallas, interpret mode on CPU) against their
pure-jnp references and the dequantised fp32 math; Triton IR checked by MLIR's verifier; the
Mosaic GPU kernel and the cuBLASLt custom call lowered for CUDA; the dispatch and the cuBLASLt
handler's build-on-first-use (numerics of both on the GPU: tests/test_gpu.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.fp8_matmul import fp8_matmul_ref
from kernels.fp8_matmul_mgpu import MgpuConfig, fp8_matmul_mgpu
from kernels.fp8_matmul_triton import TritonTiles, fp8_matmul_pallas, k_splits, row_tile
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
    # narrow column tiles (16-64 of a 128-wide weight block: its scale row is the block's,
    # j * bn // 128, which the random per-block scales here would expose if wrong)
    for bm, bn, splits, swap in ((16, 128, 1, False), (64, 256, 2, False), (32, 256, 4, False),
                                 (16, 128, 1, True), (32, 256, 2, True), (64, 128, 4, True),
                                 (16, 64, 2, True), (32, 32, 1, True), (16, 16, 4, True),
                                 (32, 64, 1, False), (16, 32, 2, False)):
        out = fp8_matmul_pallas(xq, xs, wq, ws, tiles=TritonTiles(bm, bn, splits, swap=swap),
                                interpret=True, poison=True)
        assert out.dtype == jnp.bfloat16
        assert rel_err(out.astype(jnp.float32), ref) <= 2.0 ** -8  # one bf16 rounding
    with pytest.raises(ValueError, match="splits 3 must divide"):
        fp8_matmul_pallas(xq, xs, wq, ws, tiles=TritonTiles(splits=3), interpret=True)
    for bad in (384, 48, 8):
        with pytest.raises(ValueError, match=f"block_n {bad} must be 16, 32, 64 or a multiple"):
            fp8_matmul_pallas(xq, xs, wq, ws, tiles=TritonTiles(block_n=bad), interpret=True)
    assert [row_tile(m) for m in (1, 16, 17, 100, 5000)] == [16, 16, 32, 64, 64]
    # Decode shapes split K until ~2 programs per SM; big M never splits.
    assert k_splits(1, 32, 96) == 12 and k_splits(1, 192, 32) == 2 and k_splits(128, 192, 32) == 1
    # The default tiles put these together: LLaDA-8B's gate/up GEMM at decode and full-canvas M.
    assert TritonTiles.get_default(32, 24576, 4096) == TritonTiles(32, 128, 2, 4, 3, swap=True)
    # Transposed up to 32-row tiles (16 included), not from 64 (33 rows and up)
    # Down at decode: 128 columns split K 12 ways (narrow columns measured no faster)
    assert TritonTiles.get_default(9, 4096, 12288) == TritonTiles(16, 128, 12, 4, 3, swap=True)
    assert TritonTiles.get_default(32, 4096, 12288) == TritonTiles(32, 128, 12, 4, 3, swap=True)
    assert TritonTiles.get_default(64, 4096, 12288) == TritonTiles(64, 128, 12, 4, 3)
    # Too few columns for 264 programs: every K group its own split
    assert TritonTiles.get_default(32, 1024, 4096) == TritonTiles(32, 128, 32, 4, 3, swap=True)
    assert not TritonTiles.get_default(33, 24576, 4096).swap
    assert TritonTiles.get_default(768, 24576, 4096) == TritonTiles(64, 128, 1, 4, 3)


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


@pytest.mark.parametrize("rows,warps", [(1, 1), (2, 2), (16, 4)])
def test_rmsnorm_quant_whole_rows(rows, warps):
    """Whole-row programs compute their rows' statistics in the kernel (no XLA pass): against
    the reference within test_rmsnorm_quant's bounds (its 1 / RMS sums in another order: the
    last fp32 bit, then one bf16 rounding of a normed value), at a ragged M; their Triton IR
    passes the verifier; tiles that are no Triton block shape are refused."""
    from kernels.fused_quant import QuantTiles
    M, D = 37, 512
    kx, kw = jax.random.split(jax.random.key(11))
    x = (jax.random.normal(kx, (M, D)) * 3).astype(jnp.bfloat16)
    w = (1 + 0.2 * jax.random.normal(kw, (D,))).astype(jnp.bfloat16)
    tiles = QuantTiles(rows, D // 128, warps)
    q, s = rmsnorm_quant_pallas(x, w, 1e-5, tiles=tiles, interpret=True, poison=True)
    qr, sr = rmsnorm_quant_ref(x, w, 1e-5)
    assert q.shape == (M, D) and s.shape == (M, D // 128)
    np.testing.assert_allclose(s, sr, rtol=2.0 ** -7)
    assert rel_err(dequantize_act(q, s), dequantize_act(qr, sr)) <= 2.0 ** -5
    assert rel_err(dequantize_act(q, s), rms_normed(x, w, 1e-5).astype(jnp.float32)) <= FP8_REL
    assert_valid_triton(lambda x, w: rmsnorm_quant_pallas(x, w, 1e-5, tiles=tiles), x, w)
    with pytest.raises(ValueError, match="rows a power of two"):
        swiglu_quant_pallas(jnp.concatenate([x, x], 1), tiles=QuantTiles(12, 1),
                            interpret=True)
    with pytest.raises(ValueError, match="warps"):
        rmsnorm_quant_pallas(x, w, 1e-5, tiles=QuantTiles(1, D // 128, 3), interpret=True)


def test_rmsnorm_quant_takes_whole_rows_at_few_rows():
    """Up to `WHOLE_ROWS_M` rows RMSNorm's default is one whole row per program over 8
    warps (its statistics in the kernel); above, the per-group tiles; SwiGLU keeps them."""
    from kernels import fused_quant as fq
    G = 512 // 128
    assert fq.QuantTiles.get_default(fq.WHOLE_ROWS_M, G, whole_rows=True) == fq.QuantTiles(1, G, 8)
    assert fq.QuantTiles.get_default(fq.WHOLE_ROWS_M + 1, G, whole_rows=True) == fq.QuantTiles()
    assert fq.QuantTiles.get_default(fq.WHOLE_ROWS_M, G) == fq.QuantTiles()
    # no Triton block holds a row of 3 groups: the tiles, and the kernel runs
    assert fq.QuantTiles.get_default(8, 3, whole_rows=True) == fq.QuantTiles()
    x3 = jax.random.normal(jax.random.key(3), (8, 384)).astype(jnp.bfloat16)
    q, s = rmsnorm_quant_pallas(x3, jnp.ones((384,), jnp.bfloat16), 1e-5, interpret=True)
    qr, sr = rmsnorm_quant_ref(x3, jnp.ones((384,), jnp.bfloat16), 1e-5)
    assert rel_err(dequantize_act(q, s), dequantize_act(qr, sr)) <= 2.0 ** -5
    w = jnp.ones((512,), jnp.bfloat16)
    for M, tiles in ((fq.WHOLE_ROWS_M, fq.QuantTiles(1, G, 8)),
                     (fq.WHOLE_ROWS_M + 1, fq.QuantTiles())):
        x = jax.random.normal(jax.random.key(M), (M, 512)).astype(jnp.bfloat16)
        q, s = rmsnorm_quant_pallas(x, w, 1e-5, interpret=True)
        q1, s1 = rmsnorm_quant_pallas(x, w, 1e-5, tiles=tiles, interpret=True)
        np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)),
                                      np.asarray(q1.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s1))


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


def test_quant_tiles_change_no_bit(monkeypatch):
    """Larger quantisation tiles (several rows x 128-column groups per program, as chosen from
    M 1024) give the 16 x 128 tiles' bits: the same per-group arithmetic, only the program
    split changes. Their Triton IR passes the verifier; a group count not dividing is refused."""
    from kernels.fused_quant import QuantTiles
    x = (jax.random.normal(jax.random.key(5), (40, 512)) * 3).astype(jnp.bfloat16)
    w = (1 + 0.1 * jax.random.normal(jax.random.key(6), (512,))).astype(jnp.bfloat16)
    gu = jnp.concatenate([x, x[:, ::-1]], axis=1)
    small = QuantTiles()
    for fn, args in ((functools.partial(rmsnorm_quant_pallas, eps=1e-5), (x, w)),
                     (swiglu_quant_pallas, (gu,))):
        q0, s0 = fn(*args, tiles=small, interpret=True)
        for tiles in (QuantTiles(32, 2),):
            q, s = fn(*args, tiles=tiles, interpret=True, poison=True)
            np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)),
                                          np.asarray(q0.astype(jnp.float32)))
            np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
    from kernels import fused_quant as fq
    monkeypatch.setattr(fq, "BIG_TILES", (32, 8))  # a measured choice would drop in here
    big = QuantTiles.get_default(4096, 512 // 128)
    assert big == QuantTiles(32, 4) and QuantTiles.get_default(32, 4) == small
    assert_valid_triton(lambda x, w: rmsnorm_quant_pallas(x, w, 1e-5, tiles=big), x, w)
    assert_valid_triton(lambda gu: swiglu_quant_pallas(gu, tiles=big), gu)
    with pytest.raises(ValueError, match="groups must be a power of two dividing the 4 groups"):
        swiglu_quant_pallas(gu, tiles=QuantTiles(16, 3), interpret=True)


@pytest.mark.parametrize("tiles", [(16, 1, 4), (32, 2, 4), (1, 4, 1)])
def test_group_major_scales_change_no_bit(tiles):
    """Scales written group-major ([G, M], the layout cuBLASLt reads, handed out as its
    [M, G] transpose) are the row-major ones bit for bit, at a ragged M (padded rows cut
    off), for both kernels and the whole-row RMSNorm form; their Triton IR verifies."""
    from kernels.fused_quant import QuantTiles
    t = QuantTiles(*tiles)
    x = (jax.random.normal(jax.random.key(8), (37, 512)) * 3).astype(jnp.bfloat16)
    w = (1 + 0.1 * jax.random.normal(jax.random.key(9), (512,))).astype(jnp.bfloat16)
    gu = jnp.concatenate([x, x[:, ::-1]], axis=1)
    for fn, args in ((functools.partial(rmsnorm_quant_pallas, eps=1e-5), (x, w)),
                     (swiglu_quant_pallas, (gu,))):
        q0, s0 = fn(*args, tiles=t, interpret=True)
        q, s = fn(*args, tiles=t, interpret=True, poison=True, group_major=True)
        assert s.shape == s0.shape == (37, 4)
        np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)),
                                      np.asarray(q0.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
        assert_valid_triton(lambda *a: fn(*a, tiles=t, group_major=True), *args)


def test_kernels_lower_to_valid_triton_ir():
    _, _, (xq, xs), (wq, ws) = operands(32, 512, 256)
    for bn, swap in ((128, False), (256, False), (128, True), (64, True), (32, True), (32, False),
                     (16, True)):
        tiles = dataclasses.replace(TritonTiles.get_default(32, 256, 512), block_n=bn, swap=swap)
        assert_valid_triton(lambda *a: fp8_matmul_pallas(*a, tiles=tiles), xq, xs, wq, ws)
    x = jnp.ones((20, 512), jnp.bfloat16)
    assert_valid_triton(lambda x, w: rmsnorm_quant_pallas(x, w, 1e-5), x, x[0])
    assert_valid_triton(swiglu_quant_pallas, x)


def test_ffn_through_the_kernels_matches_the_reference_path(monkeypatch):
    """`quant.ffn_fp8` as it runs on a GPU (every op through a Pallas kernel, here in
    interpret mode) against the same function on the references (the CPU dispatch)."""
    import functools

    from kernels import fp8_matmul_triton as tr
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
                        functools.partial(tr.fp8_matmul_pallas, interpret=True))
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
    # Both round the normed activation to bf16 exactly as LLaDA does (`fused_quant.rounded`),
    # so their FP8 codes agree; the GEMMs differ by fp32 summation order (~1e-7), which can
    # flip the bf16 rounding of a few gate/up outputs (2^-8 relative each) and, rarely, an FP8
    # code of the SwiGLU activation (2^-3 relative for that element): 2^-8 bounds it. A path
    # that is merely within FP8 error of the exact FFN (0.041 each) does not pass.
    assert rel_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= 2.0 ** -8


def test_ffn_kernels_see_rows_padded_once(monkeypatch):
    """At a row count the kernels' tiles do not divide (a canvas of 633 columns), `ffn_fp8`
    pads the rows once, so every kernel gets whole tiles and none pads and slices its own
    operands (copies XLA cannot fuse into a kernel); the padding rows never reach the output."""
    from lacache_jax import quant
    seen = []

    def recording(fn):
        def run(a, *args, **kw):
            seen.append((fn.__name__, a.shape[0]))
            return fn(a, *args, **kw)
        run.__name__ = fn.__name__
        return run

    for name in ("fp8_matmul", "rmsnorm_quant", "swiglu_quant"):
        monkeypatch.setattr(quant, name, recording(getattr(quant, name)))
    k = jax.random.split(jax.random.key(5), 3)
    D, F = 256, 384
    w = quant.quantize_ffn_layer(jax.random.normal(k[0], (D, 2 * F)) * D ** -0.5,
                                 jax.random.normal(k[1], (F, D)) * F ** -0.5)
    x = jax.random.normal(k[2], (1, 633, D)).astype(jnp.bfloat16)
    norm = jnp.ones((D,), jnp.bfloat16)
    out = quant.ffn_fp8(x, norm, 1e-5, w)
    assert out.shape == x.shape
    assert [n for n, _ in seen] == ["rmsnorm_quant", "fp8_matmul", "swiglu_quant", "fp8_matmul"]
    assert {m for _, m in seen} == {640}, seen
    # Rows are independent: the first 633 rows of a 640-row batch give the same output (the
    # reference path on the CPU: one XLA dot per GEMM, each row's sum in one order).
    more = jnp.concatenate([x, jax.random.normal(k[0], (1, 7, D)).astype(x.dtype)], axis=1)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(quant.ffn_fp8(more, norm, 1e-5, w)[:, :633],
                                             np.float32))


@pytest.mark.parametrize("M,K,N,kw,out_dtype", [
    (9, 512, 256, dict(swap=True, block_n=64, splits=2), jnp.float32),  # rows padded to 32
    (32, 512, 256, dict(swap=True, groups_per_step=2), jnp.float32),    # two groups a step
    (40, 1024, 384, dict(swap=True, block_n=64, stages=2), jnp.float32),  # two tiles a block
    (32, 512, 512, dict(swap=True, block_n=64), jnp.bfloat16),  # as dispatched for gate/up
    (32, 4096, 256, dict(swap=True, block_n=64, splits=2, scale_row=True), jnp.float32),
    (70, 512, 256, dict(block_n=64, splits=2), jnp.float32)])   # x on wgmma's M side
def test_mgpu_gemm_in_the_interpreter(M, K, N, kw, out_dtype):
    """The one-warpgroup Mosaic GPU kernel in Pallas' interpreter (its wgmmas as fp32
    products): tiles, K splits and each group's row and column scales, `swap`'s weight block
    scale and transposed output among them. The wgmma's own precision: tests/test_gpu.py."""
    _, _, (xq, xs), (wq, ws) = operands(M, K, N)
    config = MgpuConfig(warp_specialized=False, **kw)
    out = fp8_matmul_mgpu(xq, xs, wq, ws, out_dtype, interpret=True, config=config)
    with jax.default_matmul_precision("highest"):
        ref = fp8_matmul_ref(xq, xs, wq, ws, jnp.float32)
    assert out.dtype == out_dtype
    # fp32: summation order only; K products summed in fp32 err by about sqrt(K) * 2^-24
    # (2e-6 at K 1024; measured 1e-7), where a misplaced scale errs by ~1e-2. bf16 out: one
    # rounding of the result, at most 2^-9 relative.
    assert rel_err(out, ref) <= (1e-5 if out_dtype == jnp.float32 else 2.0 ** -8)
    # swap writes the kernel's output transposed ([N, M padded to 32]): the kernel took it
    text = jax.jit(functools.partial(fp8_matmul_mgpu, config=config)).trace(
        xq, xs, wq, ws).lower(lowering_platforms=("cuda",)).as_text()
    rows = -(-M // 32) * 32 if config.swap else -(-M // 64) * 64
    dims = (N, rows) if config.swap else (rows, N)
    kernel_out = f"tensor<{'' if config.splits == 1 else f'{config.splits}x'}{dims[0]}x{dims[1]}x"
    assert any("mosaic_gpu" in line and kernel_out in line.split("->")[-1]
               for line in text.splitlines()), kernel_out


def test_mgpu_gemm_lowers_for_hopper():
    """Pallas' Mosaic GPU interpreter has no layouts and no wgmma (the kernel's arithmetic
    there: `test_mgpu_gemm_in_the_interpreter`); lowering it for CUDA checks its layouts,
    wgmma operand shapes and shared-memory budget. The wgmma's numerics: tests/test_gpu.py."""
    _, _, (xq, xs), (wq, ws) = operands(100, 512, 256)
    for kw in (dict(), dict(block_n=256, stages=3), dict(warp_specialized=False),
               dict(groups_per_step=2), dict(splits=2), dict(splits=4, warp_specialized=False),
               dict(ctas=132), dict(ctas=3)):
        fn = functools.partial(fp8_matmul_mgpu, config=MgpuConfig(**kw))
        text = jax.jit(fn).trace(xq, xs, wq, ws).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        jax.jit(functools.partial(fp8_matmul_mgpu, config=MgpuConfig(block_n=256, stages=4))
                ).trace(xq, xs, wq, ws).lower(lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match="block_n 96"):
        fp8_matmul_mgpu(xq, xs, wq, ws, config=MgpuConfig(block_n=96))
    with pytest.raises(ValueError, match="splits 2 x groups_per_step 4"):
        fp8_matmul_mgpu(xq, xs, wq, ws, config=MgpuConfig(splits=2, groups_per_step=4))
    with pytest.raises(ValueError, match="persistent CTAs"):
        fp8_matmul_mgpu(xq, xs, wq, ws, config=MgpuConfig(ctas=132, splits=2))
    with pytest.raises(ValueError, match="swap"):
        fp8_matmul_mgpu(xq, xs, wq, ws, config=MgpuConfig(swap=True))
    with pytest.raises(ValueError, match="scale_row needs swap"):  # K / 128 = 4 here
        fp8_matmul_mgpu(xq, xs, wq, ws, config=MgpuConfig(swap=True, warp_specialized=False,
                                                          scale_row=True))
    with pytest.raises(ValueError, match="block_n 64 or 128"):  # one w scale a tile
        fp8_matmul_mgpu(xq, xs, wq, ws, config=MgpuConfig(swap=True, warp_specialized=False,
                                                          block_n=256))
    _, _, (xq, xs), (wq, ws) = operands(32, 1024, 256)  # the decode sweep's deepest K split
    for kw in (dict(splits=8), dict(swap=True, block_n=64, stages=8, splits=4),
               dict(swap=True, groups_per_step=2, splits=2)):
        fn = functools.partial(fp8_matmul_mgpu, config=MgpuConfig(warp_specialized=False, **kw))
        assert "mosaic_gpu" in jax.jit(fn).trace(xq, xs, wq, ws).lower(
            lowering_platforms=("cuda",)).as_text()
    # swap pads x's rows to 32: a group's scales, one TMA row, must be 128 bytes or more
    _, _, (xq, xs), (wq, ws) = operands(9, 512, 128)
    fn = functools.partial(fp8_matmul_mgpu, config=MgpuConfig(warp_specialized=False, swap=True,
                                                              block_n=64))
    assert "mosaic_gpu" in jax.jit(fn).trace(xq, xs, wq, ws).lower(
        lowering_platforms=("cuda",)).as_text()


def pretend_gpu(monkeypatch, cc: str = "9.0", built: bool = True):
    """jax sees one GPU of compute capability `cc`; the cuBLASLt handler `built` or not."""
    import kernels.fp8_cublaslt as lt
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda: [type("Gpu", (), {"compute_capability": cc})])
    monkeypatch.setattr(lt, "available", lambda: built)


def recording(picked: list, name: str, entry):
    """A stand-in kernel that appends `entry(xq, kwargs)` under `name` to `picked` and returns
    zeros of the output's shape."""
    def run(xq, xs, wq, ws, *a, **kw):
        picked.append((name, *entry(xq, kw)))
        return jnp.zeros((xq.shape[0], wq.shape[0]))
    return run


@pytest.mark.parametrize("cc,M,built,kernel", [
    ("9.0", 32, True, "mgpu"), ("9.0", 1024, True, "cublaslt"), ("9.0", 136, True, "cublaslt"),
    ("9.0", 133, True, "cublaslt"), ("9.0", 121, True, "cublaslt"), ("9.0", 33, True, "cublaslt"),
    ("9.0", 133, False, "mgpu"), ("9.0", 136, False, "mgpu"), ("9.0", 32, False, "mgpu"),
    ("9.0", 95, False, "pallas"), ("8.9", 32, True, "pallas"),
    ("8.9", 256, True, "pallas"), ("10.0", 256, True, "pallas"), ("8.0", 32, True, None)])
def test_dispatch_on_gpus(monkeypatch, cc, M, built, kernel):
    """Which kernel `fp8_matmul` picks per GPU, M and whether the cuBLASLt handler could be
    built; no FP8 tensor cores: a clear error."""
    import kernels.fp8_cublaslt as lt
    import kernels.fp8_matmul as fm
    import kernels.fp8_matmul_mgpu as mg
    import kernels.fp8_matmul_triton as tr
    _, _, (xq, xs), (wq, ws) = operands(M, 256, 128)
    pretend_gpu(monkeypatch, cc, built)
    picked, mgpu_settings = [], []

    def fake(name):
        def run(xq, xs, wq, ws, *a, **kw):
            picked.append((name, xq.shape[0], xs.shape[0]))
            if name == "mgpu":
                mgpu_settings.append(kw)
            return jnp.zeros((xq.shape[0], wq.shape[0]))
        return run
    monkeypatch.setattr(lt, "fp8_matmul_cublaslt", fake("cublaslt"))
    monkeypatch.setattr(tr, "fp8_matmul_pallas", fake("pallas"))
    monkeypatch.setattr(mg, "fp8_matmul_mgpu", fake("mgpu"))
    if kernel is None:
        with pytest.raises(ValueError, match="FP8 tensor cores .* this GPU's is 8.0"):
            fm.fp8_matmul(xq, xs, wq, ws)
        return
    assert fm.fp8_matmul(xq, xs, wq, ws).shape == (M, 128)
    # cuBLASLt takes M in multiples of 8: the others get zero rows added (133 -> 136, 33 -> 40)
    rows = -(-M // 8) * 8 if kernel == "cublaslt" else M
    assert picked == [(kernel, rows, rows)]
    # Mosaic GPU: two output tiles (< 132 SMs) and 2 K groups: the deep-step pipeline; up to
    # 32 rows the weights on wgmma's M side (two 64-row tiles, K split in its 2 groups).
    decode = MgpuConfig(block_n=64, stages=4, warp_specialized=False, splits=2, swap=True)
    assert mgpu_settings == ([] if kernel != "mgpu" else [dict(config=decode)] if M <= 32
                             else [dict(config=MgpuConfig(stages=2, groups_per_step=2))])
    # The quantisation kernels write the scales group-major exactly where the GEMM reads them
    # so: cuBLASLt unpadded, Triton's transposed (decode) tiles; a wrong guess costs a
    # transpose, not a wrong result.
    swapped = kernel == "pallas" and tr.TritonTiles.get_default(M, 128, 256).swap
    assert fm.scales_group_major(M) == ((kernel == "cublaslt" and M % 8 == 0) or swapped
                                        or (kernel == "mgpu" and M == 32))
    # The dispatch's thresholds are what these cases assume.
    assert fm.CUBLASLT_MIN_M == 33 and 95 < fm.MGPU_MIN_M <= 133 and fm.WAVE_FILL_MAX_M == 0
    assert fm.MGPU_SWAP_MAX_M == 32


@pytest.mark.parametrize("M,swapped", [(32, True), (9, True), (64, True), (65, False)])
def test_dispatch_swaps_operands_up_to_mgpu_swap_max_m(monkeypatch, M, swapped):
    """`MGPU_SWAP_MAX_M` at 64: Hopper's rows up to it go to the Mosaic GPU kernel with the
    weights on wgmma's M side at `MgpuConfig.get_decode`'s pipeline (LLaDA-8B's down GEMM:
    64 weight rows a CTA, K split until 256 CTAs), its scales read group-major where no
    padding row comes between; more rows: as before (cuBLASLt)."""
    import kernels.fp8_cublaslt as lt
    import kernels.fp8_matmul as fm
    import kernels.fp8_matmul_mgpu as mg
    pretend_gpu(monkeypatch)
    monkeypatch.setattr(fm, "MGPU_SWAP_MAX_M", 64)
    picked = []

    def config(xq, kw):
        return (kw.get("config"),)
    monkeypatch.setattr(lt, "fp8_matmul_cublaslt", recording(picked, "cublaslt", config))
    monkeypatch.setattr(mg, "fp8_matmul_mgpu", recording(picked, "mgpu", config))
    S = jax.ShapeDtypeStruct
    args = (S((M, 12288), jnp.float8_e4m3fn), S((M, 96), jnp.float32),
            S((4096, 12288), jnp.float8_e4m3fn), S((32, 96), jnp.float32))
    jax.eval_shape(fm.fp8_matmul, *args)
    if not swapped:
        assert [name for name, _ in picked] == ["cublaslt"]
        return
    assert picked == [("mgpu", MgpuConfig(block_n=64, stages=4, warp_specialized=False,
                                          splits=4, swap=True))]
    assert fm.scales_group_major(M) == (M % 32 == 0)


@pytest.mark.parametrize("block_n", [64, 128])
def test_decode_pipeline_fits_shared_memory(monkeypatch, block_n):
    """`MgpuConfig.get_decode` at LLaDA-8B's down GEMM up to 256 rows lowers for CUDA (whose
    lowering checks the shared memory): its stages leave room for the output tile, and 128
    weight rows drop to 64 where they would leave room for fewer than 2 steps."""
    import kernels.fp8_matmul_mgpu as mg
    monkeypatch.setattr(mg, "DECODE_BLOCK_N", block_n)
    monkeypatch.setattr(mg, "DECODE_STAGES", 8)
    S = jax.ShapeDtypeStruct
    for M in (32, 160, 256):
        config = MgpuConfig.get_decode(M, 4096, 12288)
        assert config.stages >= 2 and config.block_n <= block_n and config.swap
        args = (S((M, 12288), jnp.float8_e4m3fn), S((M, 96), jnp.float32),
                S((4096, 12288), jnp.float8_e4m3fn), S((32, 96), jnp.float32))
        jax.jit(functools.partial(fp8_matmul_mgpu, config=config)).trace(*args).lower(
            lowering_platforms=("cuda",))


def test_dispatch_fills_waves_up_to_wave_fill_max_m(monkeypatch):
    """`WAVE_FILL_MAX_M` on: Hopper's rows from `WAVE_FILL_MIN_M` up to it go to the plain
    Mosaic GPU kernel at `WsConfig.get_wave_filling`'s tile with the device's SM count where
    that tile leaves less work a SM than cuBLASLt's (the down GEMM at 768 rows: 256 x 96 in
    one wave), its scales read group-major; where it does not (the down GEMM at 1,280 rows:
    two waves against three of 128 x 128, the same work; gate/up at 768), fewer rows and
    more: cuBLASLt."""
    import kernels.fp8_cublaslt as lt
    import kernels.fp8_matmul as fm
    import kernels.fp8_matmul_mgpu_ws as ws
    import kernels.fp8_matmul_triton as tr
    pretend_gpu(monkeypatch)
    monkeypatch.setattr(fm, "WAVE_FILL_MAX_M", 1280)
    picked = []

    def fake(name):
        return recording(picked, name, lambda xq, kw: (xq.shape[0], kw))
    monkeypatch.setattr(lt, "fp8_matmul_cublaslt", fake("cublaslt"))
    monkeypatch.setattr(tr, "fp8_matmul_pallas", fake("pallas"))
    monkeypatch.setattr(ws, "fp8_matmul_mgpu_ws", fake("mgpu_ws"))
    for M, (K, N) in ((768, (12288, 4096)), (1280, (12288, 4096)), (1288, (12288, 4096)),
                      (256, (12288, 4096)), (768, (4096, 24576))):
        xq, xs = jnp.zeros((M, K), jnp.float8_e4m3fn), jnp.ones((M, K // 128), jnp.float32)
        wq, w_s = jnp.zeros((N, K), jnp.float8_e4m3fn), jnp.ones((N // 128, K // 128))
        fm.fp8_matmul(xq, xs, wq, w_s)
    config = ws.WsConfig.get_wave_filling(768, 4096, 12288, 132)
    assert config.block_n == 96
    assert picked == [("mgpu_ws", 768, dict(sm_count=132, config=config)),
                      ("cublaslt", 1280, {}), ("cublaslt", 1288, {}), ("cublaslt", 256, {}),
                      ("cublaslt", 768, {})]
    assert fm.scales_group_major(768) and fm.scales_group_major(1288)
    assert fm.WAVE_FILL_MIN_M == 512


def test_mgpu_default_config():
    """The Mosaic GPU pipeline per shape, as fp8_tiles measured on the H200 (132 SMs)."""
    deep = MgpuConfig(stages=2, groups_per_step=2)
    assert MgpuConfig.get_default(256, 4096, 12288) == deep  # LLaDA-8B's down GEMM: 64 tiles
    assert MgpuConfig.get_default(256, 2 * 12288, 4096) == MgpuConfig()  # gate/up: 384 tiles
    assert MgpuConfig.get_default(4096, 4096, 12288) == dataclasses.replace(deep, ctas=132)
    assert MgpuConfig.get_default(256, 4096, 3 * 128) == MgpuConfig()  # odd K group count
    assert MgpuConfig.get_default(256, 4096, 12288, sms=16) == dataclasses.replace(deep, ctas=16)
    # The old import path still reaches the split-out lowerings.
    from kernels import fp8_matmul as fm
    assert fm.MgpuConfig is MgpuConfig and fm.fp8_matmul_pallas is fp8_matmul_pallas


def test_cublaslt_call_lowers_with_the_scale_layouts_cublas_reads(monkeypatch):
    """The FFI call as lowered for CUDA (it cannot run here): one custom call to our target
    with x [M, K], its scales M-major [K/128, M], w [N, K] and the weight scales' K blocks
    padded to a multiple of 4 (here 3 -> 4), output [M, N], the configuration `TUNED` holds
    for the shape and the column split `SPLITS` holds; shapes it cannot take refused."""
    from kernels import fp8_cublaslt as lt
    _, _, (xq, xs), (wq, ws) = operands(40, 384, 256)
    text = jax.jit(lt.fp8_matmul_cublaslt, static_argnames="out_dtype").trace(
        xq, xs, wq, ws, out_dtype=jnp.float32).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in text.splitlines() if lt.TARGET in line]
    assert len(call) == 1
    assert ("(tensor<40x384xf8E4M3FN>, tensor<3x40xf32>, tensor<256x384xf8E4M3FN>, "
            "tensor<2x4xf32>) -> tensor<40x256xf32>") in call[0]
    # No tuned configuration at this shape: the heuristic's (algo id -1) goes to the handler;
    # a tuned one goes as given. No column split either, unless `SPLITS` holds one.
    assert "config = dense<[-1, 0, 0, 0, 0, 1, 0, 0]> : tensor<8xi32>" in call[0]
    assert "n_split = 0 : i32" in call[0]
    monkeypatch.setitem(lt.SPLITS, (40, 256, 384), (128, (5, 18, 0, 0, 0, 1, 0, 0)))
    # (a function of its own: jit's trace cache would hand the later trace this one's table)
    text = jax.jit(lambda *a: lt.fp8_matmul_cublaslt(*a)).trace(xq, xs, wq, ws).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "n_split = 128 : i32" in text
    assert "tail_config = dense<[5, 18, 0, 0, 0, 1, 0, 0]> : tensor<8xi32>" in text
    assert lt.split_for(40, 256, 384, jnp.float32, False) == lt.NO_SPLIT  # tabled for bf16
    assert lt.split_for(48, 256, 384, jnp.bfloat16, False) == lt.NO_SPLIT  # another M
    for bad in ((64, lt.HEURISTIC), (256, lt.HEURISTIC), (-128, lt.HEURISTIC)):
        with pytest.raises(ValueError, match="n_split must be 0 or a multiple of 128"):
            lt.fp8_matmul_cublaslt(xq, xs, wq, ws, split=bad)
    with pytest.raises(ValueError, match="config must be 8 ints"):
        lt.fp8_matmul_cublaslt(xq, xs, wq, ws, split=(128, (1,)))
    monkeypatch.setitem(lt.TUNED, (256, 384), [(32, (7, 20, 14, 3, 1, 1, 0, 2))])
    text = jax.jit(lt.fp8_matmul_cublaslt).trace(xq, xs, wq, ws).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "config = dense<[7, 20, 14, 3, 1, 1, 0, 2]> : tensor<8xi32>" in text
    assert lt.config_for(31, 256, 384, jnp.bfloat16, False) == lt.HEURISTIC
    assert lt.config_for(40, 256, 384, jnp.float32, False) == lt.HEURISTIC  # tabled for bf16
    with pytest.raises(ValueError, match="config must be 8 ints"):
        lt.fp8_matmul_cublaslt(xq, xs, wq, ws, config=(1, 2))
    # The last entry whose M bound is met; none met: the heuristic's.
    monkeypatch.setitem(lt.TUNED, (256, 384), [(32, (7,) + lt.HEURISTIC[1:]),
                                               (64, (8,) + lt.HEURISTIC[1:])])
    assert [lt.config_for(M, 256, 384, jnp.bfloat16, False)[0] for M in (8, 32, 63, 64, 4096)] \
        == [-1, 7, 7, 8, 8]
    assert lt.config_for(64, 256, 384, jnp.bfloat16, True) == lt.HEURISTIC  # other arrangement
    assert lt.supports(40, 256, 384, jnp.bfloat16) and not lt.supports(33, 256, 384, jnp.float32)
    assert not lt.supports(40, 256, 384, jnp.float16)
    with pytest.raises(ValueError, match="M a multiple of 8"):
        lt.fp8_matmul_cublaslt(xq[:33], xs[:33], wq, ws)


def test_cublaslt_split_benchmark_rows(monkeypatch):
    """`fp8_gemm --cublaslt-split` (cuBLASLt faked by the reference here): a row for the one
    call and one per tail configuration (the heuristic's, then the search's fastest), each
    with its timings, bits against the one call and error against the exact product."""
    from benchmarks import fp8_gemm
    from kernels import fp8_cublaslt as lt
    monkeypatch.setitem(fp8_gemm.SHAPES, "tiny", (256, 384))
    fast, slow = (5,) + lt.HEURISTIC[1:], (6,) + lt.HEURISTIC[1:]
    searched = []
    monkeypatch.setattr(lt, "search", lambda M, N, K, *a, **kw: searched.append((M, N, K)) or [
        (lt.HEURISTIC, 1.0), (slow, 2.0), (fast, 0.5)])
    splits = []

    def fake(xq, xs, wq, ws, out_dtype=jnp.bfloat16, *, swap=None, config=None, split=None):
        splits.append(split)
        return fp8_matmul_ref(xq, xs, wq, ws, out_dtype)
    monkeypatch.setattr(lt, "fp8_matmul_cublaslt", fake)
    rows = []
    fp8_gemm.cublaslt_split("tiny:32:128", 1, 1, rows)
    assert searched == [(32, 256, 256)]  # the tail problem: N - N1 columns
    assert [r["tail"] for r in rows] == [None, lt.HEURISTIC, fast]
    assert {lt.NO_SPLIT, (128, lt.HEURISTIC), (128, fast)} == set(splits)
    assert all(r["same_bits_as_one_call"] and r["rel_l2_vs_ref"] < 2.0 ** -7 and r["ms"] > 0
               for r in rows)


def test_cublaslt_search_refuses_bad_arguments_before_the_device():
    from kernels import fp8_cublaslt as lt
    with pytest.raises(ValueError, match="scaling must be one of"):
        lt.search(256, 1024, 4096, scaling="row")
    with pytest.raises(ValueError, match="max_split_k must be >= 1"):
        lt.search(256, 1024, 4096, max_split_k=0)


def test_cublaslt_missing_cuda_falls_back_with_one_warning(monkeypatch, tmp_path):
    """No CUDA headers (this CPU machine): `available()` is False after one warning naming
    what is missing, and the dispatch stays on the Pallas kernel."""
    import kernels.fp8_cublaslt as lt
    import kernels.fp8_matmul as fm
    import kernels.fp8_matmul_triton as tr
    monkeypatch.setattr(lt, "cuda_roots", lambda: [tmp_path])
    monkeypatch.setenv("LACACHE_JAX_CACHE", str(tmp_path / "cache"))
    lt.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no cublasLt.h under .*Pallas kernels"):
            assert lt.available() is False
        assert lt.available() is False  # cached: no second build attempt, no second warning
        _, _, (xq, xs), (wq, ws) = operands(64, 256, 128)
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        monkeypatch.setattr(jax, "devices", lambda: [type("Gpu", (), {"compute_capability":
                                                                      "9.0"})])
        monkeypatch.setattr(tr, "fp8_matmul_pallas", lambda *a: "pallas")
        assert fm.fp8_matmul(xq, xs, wq, ws) == "pallas"
    finally:
        lt.available.cache_clear()
    assert not (tmp_path / "cache").exists()


def test_cublaslt_finds_headers_and_libraries(monkeypatch, tmp_path):
    """A pip-style CUDA tree (nvidia/cu13 with include/, include/cccl/ and lib/): every header
    the handler needs is found, the versioned libraries are linked, the cache key moves with
    the CUDA version; a library the process already mapped is preferred."""
    import kernels.fp8_cublaslt as lt
    root = tmp_path / "nvidia" / "cu13"
    for header in ("cublasLt.h", "cuda_runtime_api.h", "crt/host_defines.h", "cccl/nv/target"):
        (root / "include" / header).parent.mkdir(parents=True, exist_ok=True)
        (root / "include" / header).write_text("")
    (root / "include" / "cublas_api.h").write_text("#define CUBLAS_VER_MAJOR 13\n"
                                                   "#define CUBLAS_VER_MINOR 1\n")
    (root / "lib").mkdir()
    for lib in ("libcublasLt.so.13", "libcudart.so.13", "libcudart.so.13.0.1"):
        (root / "lib" / lib).write_text("")
    monkeypatch.setattr(lt.sys, "path", [str(tmp_path)])
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(lt, "loaded_libraries", lambda: [])
    includes, libs = lt.find_cuda()
    assert includes[:2] == [root / "include", root / "include" / "cccl"]
    assert libs == [root / "lib" / "libcublasLt.so.13", root / "lib" / "libcudart.so.13"]
    assert lt.cuda_versions(includes) == "13.1"
    jax_lt = tmp_path / "elsewhere" / "libcublasLt.so.13.2.0"
    monkeypatch.setattr(lt, "loaded_libraries", lambda: [jax_lt])
    assert lt.find_cuda()[1][0] == jax_lt


def test_quant_tile_sweep_records_xla_tiles_and_refusals(monkeypatch):
    """`benchmarks/fp8_ffn.py --quant-tiles` (kernels in interpret mode here): a row for XLA's
    fusion of the references and one per tile, each with both kernels' times or the reason a
    kernel refused the tile (4 groups do not divide SwiGLU's 2 here)."""
    import lacache_jax as lj
    from benchmarks import fp8_ffn
    from kernels import fused_quant as fq
    from kernels.fused_quant import QuantTiles
    for name in ("rmsnorm_quant_pallas", "swiglu_quant_pallas"):
        monkeypatch.setattr(fp8_ffn, name, functools.partial(getattr(fq, name), interpret=True))
    cfg = lj.tiny(d_model=512, d_ff=256)
    rows = []
    ceil = {"copy_tb_per_s": 1.0}
    fp8_ffn.quant_tiles(cfg, ceil, [QuantTiles(), QuantTiles(1, 4, 1)], [8], rows)  # G 4, 2
    assert [r["tiles"] for r in rows] == ["xla", "16x1x4", "1x4x1"]
    assert all(r["rmsnorm_quant_ms"] > 0 for r in rows)
    assert [("swiglu_quant_ms" in r, "swiglu_quant_refused" in r) for r in rows] == [
        (True, False), (True, False), (False, True)]
    # Traced: the device's own time per call beside; a CPU trace has no device kernels.
    rows = []
    fp8_ffn.quant_tiles(cfg, ceil, [QuantTiles()], [8], rows, traced=True)
    assert [np.isnan(r["swiglu_quant_device_ms"]) for r in rows] == [True, True]
    assert [r["rmsnorm_quant_kernel_ms"] for r in rows] == [None, None]


def test_tile_sweep_over_column_tiles_and_k_splits():
    """benchmarks/fp8_tiles.py's decode sweep: each column tile with k_splits' choice for it
    (down at M 32: 128 column tiles of 32 need 3 splits for 264 programs, 64 of 64 need 6,
    32 of 128 need 12), or with the splits given where they divide the K groups."""
    from benchmarks.fp8_tiles import DecodeSweep, configs
    got = configs(32, 4096, 12288, True, decode=DecodeSweep(block_ns=(32, 64, 128)))
    # narrow tiles transposed (the default at 32 rows) and not; 128 as the default, transposed
    assert [(t.block_n, t.splits, t.swap, t.num_stages) for t in got] == [
        (32, 3, True, 3), (32, 3, True, 4), (32, 3, False, 3), (32, 3, False, 4),
        (64, 6, True, 3), (64, 6, True, 4), (64, 6, False, 3), (64, 6, False, 4),
        (128, 12, True, 3), (128, 12, True, 4)]
    assert all(t.block_m == 32 and t.num_warps == 4 for t in got)
    # The first sweep (no column or split list) stays at 128 columns, split for each row tile,
    # as the default does
    got = configs(32, 4096, 12288, True)
    assert {(t.block_m, t.block_n, t.splits) for t in got} == {(32, 128, 12), (64, 128, 12)}
    # 32 K groups: 3 does not divide them
    got = configs(32, 24576, 4096, True, decode=DecodeSweep(splits=(1, 3, 4)))
    assert [(t.block_n, t.splits) for t in got] == [(128, 1), (128, 1), (128, 4), (128, 4)]
    # --stages and --warps: each setting at each depth and warp count
    got = configs(32, 4096, 12288, True, decode=DecodeSweep(block_ns=(128,), stages=(1, 3)))
    assert [(t.splits, t.num_stages, t.num_warps) for t in got] == [(12, 1, 4), (12, 3, 4)]
    got = configs(32, 4096, 12288, True, decode=DecodeSweep(splits=(6,), warps=(4, 8)))
    assert [(t.splits, t.num_stages, t.num_warps) for t in got] == [
        (6, 3, 4), (6, 3, 8), (6, 4, 4), (6, 4, 8)]


def test_tile_sweep_ranks_settings_by_their_median_over_rounds():
    """`--rounds`: one fast outlier of a setting must not make it the best; the median does."""
    from benchmarks.fp8_tiles import best_settings
    row = lambda bn, rnd, ms: dict(shape="down", M=32, K=12288, N=4096, kernel="pallas",
                                   block_n=bn, round=rnd, ms=ms, tflops=1.0 / ms,
                                   x_read_floor=ms / 0.015)
    rows = [row(64, 0, 0.031), row(128, 0, 0.025), row(64, 1, 0.030), row(128, 1, 0.040),
            row(64, 2, 0.032), row(128, 2, 0.041),
            dict(shape="down", M=32, kernel="xla_bf16", ms=0.001)]  # not a tile setting
    best = best_settings(rows)
    assert list(best) == ["down/32/pallas"]
    b = best["down/32/pallas"]
    assert (b["block_n"], b["ms"], b["ms_rounds"]) == (64, 0.031, [0.031, 0.030, 0.032])
    assert "round" not in b
    assert b["tflops"] == pytest.approx(1 / 0.031)
    assert b["x_read_floor"] == pytest.approx(0.031 / 0.015)


def test_ffn_runs_the_fused_gate_up_kernel_where_it_takes(monkeypatch):
    """Where `gate_up_swiglu.takes`, `quant.ffn_fp8` hands the normed, quantised rows (padded
    once to ROW_ALIGN) and the gate | up weights to `gate_up_swiglu_quant` and feeds its
    output to the down GEMM (a kernel returning zeros gives zeros). The Mosaic GPU kernel
    there, in its interpreter (on 2 SMs: its last wave split off too), gives the FFN of the
    unfused references within what a flipped bf16 rounding of gate or up moves (2^-8
    relative: `test_swiglu_interpreted_is_the_unfused_kernels` bounds the activation so, and
    the down GEMM, the same in both, is linear in it)."""
    from kernels.fp8_matmul_mgpu_ws import gate_up_swiglu_mgpu_ws
    from lacache_jax import quant
    k = jax.random.split(jax.random.key(9), 4)
    M, D, F = 9, 256, 384
    w = quant.quantize_ffn_layer(jax.random.normal(k[0], (D, 2 * F)) * D ** -0.5,
                                 jax.random.normal(k[1], (F, D)) * F ** -0.5)
    x = jax.random.normal(k[2], (1, M, D)).astype(jnp.bfloat16)
    norm = (1 + 0.1 * jax.random.normal(k[3], (D,))).astype(jnp.bfloat16)
    unfused = quant.ffn_fp8(x, norm, 1e-5, w)
    calls = []

    def zeros(xq, xs, wq, ws, act_dtype):
        calls.append((xq.shape, wq.shape))
        return (jnp.zeros((xq.shape[0], F), jnp.float8_e4m3fn),
                jnp.ones((xq.shape[0], F // 128), jnp.float32))
    monkeypatch.setattr(quant, "fuses_gate_up", lambda *a: True)
    monkeypatch.setattr(quant, "gate_up_swiglu_quant", zeros)
    assert not np.asarray(quant.ffn_fp8(x, norm, 1e-5, w), np.float32).any()
    assert calls == [((16 * -(-M // 16), D), (2 * F, D))]  # padded once (ROW_ALIGN)
    monkeypatch.setattr(quant, "gate_up_swiglu_quant", functools.partial(
        gate_up_swiglu_mgpu_ws, sm_count=2, interpret=True))
    fused = quant.ffn_fp8(x, norm, 1e-5, w)
    assert fused.shape == unfused.shape and bool(jnp.isfinite(fused).all())
    assert rel_err(fused.astype(jnp.float32), unfused.astype(jnp.float32)) <= 2.0 ** -8


def test_gate_up_swiglu_takes_the_mosaic_gpu_kernel_from_mgpu_min_m(monkeypatch):
    """`gate_up_swiglu.MGPU_MIN_M`: on as shipped from batch 1's 768 rows (timed faster there
    and at batch 8's 4,608, RESULTS.md thirty-fifth and thirty-sixth sessions), 0 never;
    from that many rows, on Hopper only, F, K and M in whole 128-wide groups;
    `gate_up_swiglu_quant` runs `gate_up_swiglu_mgpu_ws` on its operands with the device's
    SM count."""
    from kernels import fp8_matmul_mgpu_ws as ws_kernel
    from kernels import gate_up_swiglu as gs
    cc = ["9.0"]
    monkeypatch.setattr(jax, "devices", lambda: [type("Gpu", (), {"compute_capability": cc[0]})])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert gs.takes(768, 12288, 4096) and not gs.takes(640, 12288, 4096)
    assert gs.takes(4608, 12288, 4096)
    monkeypatch.setattr(gs, "MGPU_MIN_M", 0)
    assert not gs.takes(4608, 12288, 4096)
    monkeypatch.setattr(gs, "MGPU_MIN_M", 1024)
    assert gs.takes(4608, 12288, 4096) and not gs.takes(768, 12288, 4096)
    assert not gs.takes(4608, 12288 + 64, 4096) and not gs.takes(4608, 12288, 4000)
    assert not gs.takes(4600, 12288, 4096)  # not whole 128-row tiles: padding copies
    cc[0] = "8.9"
    assert not gs.takes(4608, 12288, 4096)
    cc[0] = "9.0"
    calls = []
    sm = []

    def recorded(*a, sm_count):
        calls.append(tuple(x.shape for x in a[:4]))
        sm.append(sm_count)
        return "mgpu"
    monkeypatch.setattr(ws_kernel, "gate_up_swiglu_mgpu_ws", recorded)
    xq, xs = jnp.zeros((1024, 256), jnp.float8_e4m3fn), jnp.ones((1024, 2), jnp.float32)
    wq, ws = jnp.zeros((512, 256), jnp.float8_e4m3fn), jnp.ones((4, 2), jnp.float32)
    assert gs.gate_up_swiglu_quant(xq, xs, wq, ws) == "mgpu"
    assert calls == [((1024, 256), (1024, 2), (512, 256), (4, 2))]
    assert sm == [132]  # the device's SM count (the faked device reports none: 132)


