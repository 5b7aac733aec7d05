"""Accelerator-only checks (`pytest -m gpu` on the device machine): the cuDNN attention path
that CPU runs never take, against XLA attention in fp32; the Pallas kernels compiled for the
GPU; the cuBLASLt FP8 GEMM (built on first use) against the exact per-group product."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lacache_jax as lj
from lacache_jax.model import attention
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B,L,H,G,masked", [(1, 512, 32, 32, True), (2, 300, 8, 2, True),
                                             (1, 768, 32, 32, False), (2, 300, 8, 2, False)])
def test_cudnn_attention_matches_fp32(B, L, H, G, masked):
    """cuDNN's attention with a key mask (ragged rows) and without one (an unpadded batch:
    `Canvas.keeps_all`, its unmasked kernel) against fp32."""
    kq, kk, kv = jax.random.split(jax.random.key(L), 3)
    q = jax.random.normal(kq, (B, L, H, 128), jnp.float32)
    k = jax.random.normal(kk, (B, L, G, 128), jnp.float32)
    v = jax.random.normal(kv, (B, L, G, 128), jnp.float32)
    pad = np.arange(B) * 37
    key_mask = jnp.asarray(np.arange(L)[None, :] >= pad[:, None]) if masked else None
    with jax.default_matmul_precision("highest"):
        ref = attention(q, k, v, key_mask)  # fp32 -> XLA implementation
    bf = lambda x: x.astype(jnp.bfloat16)
    out = jax.jit(attention)(bf(q), bf(k), bf(v), key_mask)
    # bf16 inputs (rounding 2^-9) and bf16 probabilities before P@V: ~4e-3 relative.
    assert out.dtype == jnp.bfloat16
    assert rel_err(out.astype(jnp.float32), ref) <= 1e-2


def test_bf16_forward_on_gpu_matches_fp32():
    cfg = lj.tiny(d_model=256, n_heads=2, n_kv_heads=1, d_ff=512)  # head_dim 128 as in LLaDA
    params = lj.init_params(cfg, jax.random.key(0), jnp.float32)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 96))
    key_mask = np.arange(96)[None, :] >= np.array([0, 30])[:, None]
    with jax.default_matmul_precision("highest"):
        ref = lj.forward(params, cfg, tokens, attention_mask=key_mask)
    params16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    out = lj.forward(params16, cfg, tokens, attention_mask=key_mask).astype(jnp.float32)
    # Same bf16 budget as the CPU parity test (tests/test_model.py::test_bf16_parity).
    assert rel_err(out, ref) <= 3e-2


@pytest.mark.parametrize("case", ["whole_canvas", "dpad_compact", "dpad_gaussian"])
def test_exact_step_on_gpu_kernels(models, case):
    """exact's later-step logits through the GPU's FACache kernels (the Triton kernel in fp32,
    fill at the block's first forward and reuse after; with DPad on the block's compact
    canvas) against a full forward of the changed canvas."""
    from tests.test_lacache import DPAD_CASES, exact_step_error
    with jax.default_matmul_precision("highest"):
        err = exact_step_error(models[0], DPAD_CASES[case])
    # fp32 with HIGHEST dots: the kernel's own fp32 bound (test_facache_kernel_on_gpu, 1e-5)
    # in layer 0; the CPU's 2e-6 assumes the reference's summation order everywhere else.
    assert err <= 1e-5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_facache_kernel_on_gpu(dtype):
    """The Triton-lowered kernel at LLaDA's head shape: fill vs dense, reuse bit-identical."""
    from kernels.cached_attention import cached_attention_pallas
    from tests.test_cached_attention import dense_attention, inputs
    q, k, v, key_mask = inputs(0, 2, 768, 32, 32, 128, [0, 100], dtype)
    s, e = 530, 562  # not tile-aligned
    o, state = cached_attention_pallas(q, k, v, key_mask, s, e, mode="fill", poison=True)
    # fp32: HIGHEST-precision dots and fp32 accumulation (1e-5); bf16: as in
    # tests/test_cached_attention.py::test_bf16.
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert rel_err(o.astype(jnp.float32), dense_attention(q, k, v, key_mask)) <= tol
    again = cached_attention_pallas(q, k, v, key_mask, s, e, state, mode="reuse", poison=True)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(o))
    full = cached_attention_pallas(q, k, v, key_mask, s, e, mode="full", poison=True)
    np.testing.assert_array_equal(np.asarray(full), np.asarray(o))
    # Block tiles with split keys (as generate runs them): other rows bit-identical.
    split = cached_attention_pallas(q, k, v, key_mask, s, e, state, mode="reuse", poison=True,
                                    block_len=e - s)
    rows = np.arange(768) // 64 * 64
    tiles = (rows < e) & (rows + 64 > s)
    np.testing.assert_array_equal(np.asarray(split)[:, ~tiles], np.asarray(o)[:, ~tiles])
    assert rel_err(split.astype(jnp.float32), dense_attention(q, k, v, key_mask)) <= tol


def test_short_attention_on_gpu():
    """The split-keys kernel at a dual step's shape (32 rows over 768 keys, LLaDA's heads)
    and at a prefix step's (200 and 256 rows, in 64-row tiles): against the dense reference,
    and `model.attention` dispatching to it near cuDNN."""
    from kernels.short_attention import short_attention_pallas, short_attention_ref
    from lacache_jax import model
    from tests.test_short_attention import inputs
    q, k, v, mask = inputs(0, 2, 32, 768, 32, 32, 128, [0, 100], jnp.bfloat16)
    out = short_attention_pallas(q, k, v, mask)
    ref = short_attention_ref(q.astype(jnp.float32), k, v, mask)
    # As tests/test_short_attention.py::test_bf16: probabilities and output rounded to bf16.
    assert rel_err(out.astype(jnp.float32), ref) <= 1e-2
    np.testing.assert_array_equal(np.asarray(model.attention(q, k, v, mask)), np.asarray(out))
    with model.short_attention_implementation("cudnn"):
        cudnn = model.attention(q, k, v, mask)
    assert rel_err(cudnn.astype(jnp.float32), ref) <= 1e-2
    # batch 8's dual block: one share of all 12 key tiles a (batch, head), no merge
    q8, k8, v8, m8 = inputs(2, 8, 32, 768, 32, 32, 128, [0, 3, 17, 40, 0, 0, 9, 100],
                            jnp.bfloat16)
    ref8 = short_attention_ref(q8.astype(jnp.float32), k8, v8, m8)
    assert rel_err(short_attention_pallas(q8, k8, v8, m8).astype(jnp.float32), ref8) <= 1e-2
    # a canvas of no whole number of key tiles (a prompt of any length): the last re-read
    k, v, mask = k[:, :740], v[:, :740], mask[:, :740]
    out = short_attention_pallas(q, k, v, mask)
    ref = short_attention_ref(q.astype(jnp.float32), k, v, mask)
    assert rel_err(out.astype(jnp.float32), ref) <= 1e-2
    # a prefix step's largest block, 256 rows in four 64-row tiles, and 200 (one padded)
    for L in (256, 200):
        q = inputs(1, 2, L, 740, 32, 32, 128, [0, 100], jnp.bfloat16)[0]
        out = short_attention_pallas(q, k, v, mask)
        ref = short_attention_ref(q.astype(jnp.float32), k, v, mask)
        assert rel_err(out.astype(jnp.float32), ref) <= 1e-2, L
    # model.attention: batch 1's 160-row block to the kernel (two shares of the keys in one
    # wave), batch 2's 200 rows (four row tiles: 512 programs at two shares) to cuDNN
    q1, k1, v1, m1 = q[:1, :160], k[:1], v[:1], mask[:1]
    np.testing.assert_array_equal(np.asarray(model.attention(q1, k1, v1, m1)),
                                  np.asarray(short_attention_pallas(q1, k1, v1, m1)))
    dispatched = model.attention(q, k, v, mask)
    with model.short_attention_implementation("cudnn"):
        np.testing.assert_array_equal(np.asarray(dispatched),
                                      np.asarray(model.attention(q, k, v, mask)))


def test_short_attention_merged_in_the_kernel_on_gpu():
    """The split-keys kernel with the shares' states merged by the last share to finish (an
    atomic count per (batch, head, row tile)), at a dual step's block (batch 1 and 2, 32 rows
    over 768 keys: 6 and 4 shares) and a prefix step's 200 rows (four row tiles, 2 shares:
    what `takes` gives the kernel at batch 1), on fresh queries
    through one compiled kernel (a state read before its share stored it would hold the last
    draw's): against the dense reference as the XLA merge is (bf16 probabilities and output),
    and within a few bf16 roundings of the XLA merge (the same states, merged in another
    fp32 order)."""
    from kernels.short_attention import short_attention_pallas, short_attention_ref
    from tests.test_short_attention import inputs
    _, k, v, mask = inputs(0, 2, 32, 768, 32, 32, 128, [0, 100], jnp.bfloat16)
    for B, L in ((1, 32), (2, 32), (1, 200)):
        for seed in (1, 2, 3):
            q = inputs(seed, B, L, 768, 32, 32, 128, [0, 100], jnp.bfloat16)[0]
            kb, vb, mb = k[:B], v[:B], mask[:B]
            out = short_attention_pallas(q, kb, vb, mb, merge="kernel")
            ref = short_attention_ref(q.astype(jnp.float32), kb, vb, mb)
            assert rel_err(out.astype(jnp.float32), ref) <= 1e-2, (B, L)
            xla = short_attention_pallas(q, kb, vb, mb, merge="xla")
            # fp32 merges in two orders (~1e-7 relative apart) flip a few bf16 roundings (one
            # ulp, <= 2^-7 relative, each): far under 2^-8 in norm; a share's state missed or
            # stale is of the order of the output itself
            assert rel_err(out.astype(jnp.float32), xla.astype(jnp.float32)) <= 2.0 ** -8


def test_facache_mosaic_kernel_on_gpu():
    """The Mosaic GPU kernel (full / fill) at LLaDA's head shape: fill vs dense attention and
    the reference's state; full gives fill's bits; an unbounded phase-B window; the Triton
    kernel's reuse mode on its state."""
    from kernels.cached_attention import cached_attention_pallas, cached_attention_ref
    from kernels.cached_attention_mgpu import cached_attention_mgpu
    from tests.test_cached_attention import dense_attention, inputs
    q, k, v, key_mask = inputs(0, 2, 768, 32, 32, 128, [0, 100], jnp.bfloat16)
    s, e = 530, 562  # not tile-aligned
    o, state = cached_attention_mgpu(q, k, v, key_mask, s, e, mode="fill", block_len=e - s)
    dense = dense_attention(q, k, v, key_mask)
    # bf16 probabilities before P@V and a bf16 output (2^-9 each): the CPU test's 1e-2, as
    # the Triton kernel's (tests/test_cached_attention_mgpu.py).
    assert rel_err(o.astype(jnp.float32), dense) <= 1e-2
    _, ref = cached_attention_ref(q, k, v, key_mask, s, e, mode="fill")
    assert rel_err(state.acc, ref.acc) <= 1e-2
    # l sums fp32 probabilities through ex2.approx (2 ulp): fp32-level, 1e-5 as on the CPU.
    assert rel_err(state.l, ref.l) <= 1e-5
    np.testing.assert_allclose(state.m, ref.m, rtol=1e-5, atol=1e-5)
    full = cached_attention_mgpu(q, k, v, key_mask, s, e, mode="full", block_len=e - s)
    np.testing.assert_array_equal(np.asarray(full), np.asarray(o))
    # No bound on the block: phase B's window is the whole canvas (its tiles outside the
    # block add nothing; the block's keys are grouped into other tiles: same budget).
    whole, _ = cached_attention_mgpu(q, k, v, key_mask, s, e, mode="fill")
    assert rel_err(whole.astype(jnp.float32), dense) <= 1e-2
    reused = cached_attention_pallas(q, k, v, key_mask, s, e, state, mode="reuse",
                                     block_len=e - s)
    assert rel_err(reused.astype(jnp.float32), dense) <= 1e-2
    # Per-row bounds (slot refill) in one launch: each row computes as alone, bit for bit.
    s_B = jnp.array([s, 100])
    rows, _ = cached_attention_mgpu(q, k, v, key_mask, s_B, s_B + 32, mode="fill", block_len=32)
    other, _ = cached_attention_mgpu(q, k, v, key_mask, 100, 132, mode="fill", block_len=32)
    np.testing.assert_array_equal(np.asarray(rows[0]), np.asarray(o[0]))
    np.testing.assert_array_equal(np.asarray(rows[1]), np.asarray(other[1]))
    # The dispatch takes it for fill on Hopper, and generate's exact cache with it.
    from kernels.cached_attention import cached_attention, takes_row_bounds
    assert takes_row_bounds(q, "fill") and not takes_row_bounds(q, "reuse")
    o_d, _ = cached_attention(q, k, v, key_mask, s, e, mode="fill", block_len=e - s)
    np.testing.assert_array_equal(np.asarray(o_d), np.asarray(o))


def test_fp8_kernels_on_gpu_at_llada_widths():
    """The Triton-compiled FP8 GEMM and fused quantisation kernels at LLaDA-8B's widths
    (D 4096, F 12288; N cut to 1024 to keep the reference cheap), odd M."""
    from kernels.fp8_matmul import fp8_matmul_ref
    from kernels.fp8_matmul_mgpu import MgpuConfig, fp8_matmul_mgpu
    from kernels.fp8_matmul_triton import TritonTiles, fp8_matmul_pallas
    from kernels.fused_quant import (QuantTiles, rmsnorm_quant_pallas, rmsnorm_quant_ref,
                                     swiglu_quant_pallas, swiglu_quant_ref)
    from lacache_jax.quant import dequantize_act, quantize_act, quantize_weight
    k = jax.random.split(jax.random.key(0), 4)
    for M, K in [(9, 4096), (32, 12288), (33, 4096), (200, 12288)]:  # 16/32/64-row tiles
        xq, xs = quantize_act(jax.random.normal(k[0], (M, K)))
        wq, ws = quantize_weight(jax.random.normal(k[1], (K, 1024)) * K ** -0.5)
        with jax.default_matmul_precision("highest"):
            ref = fp8_matmul_ref(xq, xs, wq, ws, jnp.float32)
        for bn, swap in ((128, False), (256, False), (128, True), (256, True), (64, True),
                         (32, True), (16, True), (32, False)):
            tiles = dataclasses.replace(TritonTiles.get_default(M, 1024, K), block_n=bn,
                                        swap=swap)
            out = fp8_matmul_pallas(xq, xs, wq, ws, jnp.float32, poison=True, tiles=tiles)
            assert rel_err(out, ref) <= 1e-5  # fp32 summation order only (test_fp8_kernels)
        if M < 33:
            continue  # the Mosaic GPU kernel is dispatched from 128 rows; 33 covers padding
        for kw in (dict(), dict(warp_specialized=False, stages=2),
                   dict(groups_per_step=2, stages=2),  # 4 stages x 2 groups overflow smem
                   dict(splits=4),
                   dict(splits=2, groups_per_step=2, warp_specialized=False, stages=2),
                   dict(splits=8, warp_specialized=False),
                   dict(ctas=132), dict(ctas=3, groups_per_step=2, stages=2)):  # 3: uneven
            out = fp8_matmul_mgpu(xq, xs, wq, ws, jnp.float32, config=MgpuConfig(**kw))
            # Hopper's FP8 wgmma sums a group's 128 products with about 14 significant bits,
            # not fp32's 24 (DeepSeek-V3 report, section 3.3.2; the reason to promote every
            # group): about 2^-13 relative per group, bounded here by 2^-12 and measured.
            print("mgpu", M, K, kw, rel_err(out, ref))
            assert rel_err(out, ref) <= 2.0 ** -12
    # The Mosaic GPU kernel at decode rows with the weights on wgmma's M side (`swap`): x's
    # rows padded to 32 (9, 33), 64- and 128-row weight tiles, deep pipelines, K splits
    for M, K in [(9, 4096), (32, 12288), (33, 4096), (64, 12288)]:
        xq, xs = quantize_act(jax.random.normal(k[0], (M, K)))
        wq, ws = quantize_weight(jax.random.normal(k[1], (K, 1024)) * K ** -0.5)
        with jax.default_matmul_precision("highest"):
            ref = fp8_matmul_ref(xq, xs, wq, ws, jnp.float32)
        for kw in (dict(block_n=64), dict(block_n=128, stages=6, splits=4),  # 8: > smem at 64
                   dict(block_n=64, groups_per_step=2, splits=2),
                   dict(block_n=64, splits=2, scale_row=True)):  # the w scales' row copied
            config = MgpuConfig(warp_specialized=False, swap=True, **kw)
            out = fp8_matmul_mgpu(xq, xs, wq, ws, jnp.float32, config=config)
            print("mgpu swap", M, K, kw, rel_err(out, ref))
            assert rel_err(out, ref) <= 2.0 ** -12  # wgmma's ~14-bit group sums, as above
    # The default tiles at LLaDA-8B's full down shape (decode rows: K split 12 ways)
    wq, ws = quantize_weight(jax.random.normal(k[1], (12288, 4096)) * 12288 ** -0.5)
    for M in (9, 32):
        xq, xs = quantize_act(jax.random.normal(k[0], (M, 12288)))
        assert TritonTiles.get_default(M, 4096, 12288) == TritonTiles(16 if M == 9 else 32, 128,
                                                                      12, 4, 3, swap=True)
        with jax.default_matmul_precision("highest"):
            ref = fp8_matmul_ref(xq, xs, wq, ws, jnp.float32)
        out = fp8_matmul_pallas(xq, xs, wq, ws, jnp.float32, poison=True)
        assert rel_err(out, ref) <= 1e-5  # fp32 summation order only, as above
    x = jax.random.normal(k[2], (77, 4096)).astype(jnp.bfloat16)
    w = (1 + 0.1 * jax.random.normal(k[3], (4096,))).astype(jnp.bfloat16)
    qr, sr = rmsnorm_quant_ref(x, w, 1e-5)
    # the tiled form, then whole rows (statistics in the kernel) at a few row and warp counts
    # (whole rows: a program holds rows x 4096 fp32 values at once, so a few rows)
    for tiles in (None, QuantTiles(1, 32, 1), QuantTiles(2, 32, 4), QuantTiles(4, 32, 8)):
        q, s = rmsnorm_quant_pallas(x, w, 1e-5, poison=True, tiles=tiles)
        assert rel_err(dequantize_act(q, s), dequantize_act(qr, sr)) <= 2.0 ** -5  # as on CPU
    # the default at a dual step's 32 rows: whole rows, one per program over 8 warps
    q, s = rmsnorm_quant_pallas(x[:32], w, 1e-5, poison=True)
    qr, sr = rmsnorm_quant_ref(x[:32], w, 1e-5)
    assert rel_err(dequantize_act(q, s), dequantize_act(qr, sr)) <= 2.0 ** -5
    gu = jax.random.normal(k[2], (77, 2 * 12288)).astype(jnp.bfloat16)
    q, s = swiglu_quant_pallas(gu, poison=True)
    qr, sr = swiglu_quant_ref(gu)
    assert rel_err(dequantize_act(q, s), dequantize_act(qr, sr)) <= 1e-3  # as on CPU


def test_fp8_gemm_with_imprecise_acc_on_gpu(monkeypatch):
    """`fp8_matmul_triton.IMPRECISE_ACC = 32` (the FP8 dots' maxNumImpreciseAcc: Triton may
    then use Hopper's FP8 wgmma instead of upcasting to f16 for mma.sync) at LLaDA-8B's decode
    and padded shapes: within the bound of the Mosaic GPU kernel's wgmma (2^-12: a wgmma
    sums at most 32 products with about 14 significant bits before the fp32 add; DeepSeek-V3
    report 3.3.2), every tile written. Prints whether the bits changed (they do if XLA's
    Triton took wgmma)."""
    from kernels import fp8_matmul_triton as tr
    from kernels.fp8_matmul import fp8_matmul_ref
    from lacache_jax.quant import quantize_act, quantize_weight
    k = jax.random.split(jax.random.key(21), 2)
    cases = []
    for M, K in [(9, 4096), (32, 12288), (33, 4096)]:
        xq, xs = quantize_act(jax.random.normal(k[0], (M, K)))
        wq, ws = quantize_weight(jax.random.normal(k[1], (K, 1024)) * K ** -0.5)
        with jax.default_matmul_precision("highest"):
            ref = fp8_matmul_ref(xq, xs, wq, ws, jnp.float32)
        cases.append(((xq, xs, wq, ws), ref, tr.fp8_matmul_pallas(xq, xs, wq, ws, jnp.float32)))
    monkeypatch.setattr(tr, "IMPRECISE_ACC", 32)
    jax.clear_caches()  # read at lowering: nothing compiled before may be reused
    for args, ref, before in cases:
        out = tr.fp8_matmul_pallas(*args, jnp.float32, poison=True)
        changed = not np.array_equal(np.asarray(out), np.asarray(before))
        print("imprecise_acc 32", args[0].shape, rel_err(out, ref), "bits changed:", changed)
        assert rel_err(out, ref) <= 2.0 ** -12
    jax.clear_caches()


def test_fp8_ffn_scales_written_where_the_gemm_reads_them():
    """Hopper with the cuBLASLt handler: the FFN's quantisation kernels write the activation
    scales group-major, the layout cuBLASLt (768 rows) and the Mosaic GPU kernel's swapped
    decode tiles (32 rows) read, so the compiled FFN holds no transpose of them (two launches
    a layer before); those scales are the row-major ones bit for bit, also at a row count that is
    padded (77)."""
    from kernels import fp8_matmul as fm
    from kernels.fused_quant import rmsnorm_quant_pallas, swiglu_quant_pallas
    from lacache_jax import quant
    if fm.compute_capability()[0] != 9 or not fm.scales_group_major(768):
        pytest.skip("not Hopper with the cuBLASLt handler: scales stay row-major")
    k = jax.random.split(jax.random.key(4), 4)
    D, F = 512, 1024
    w = quant.quantize_ffn_layer(jax.random.normal(k[0], (D, 2 * F)) * D ** -0.5,
                                 jax.random.normal(k[1], (F, D)) * F ** -0.5)
    norm = jnp.ones((D,), jnp.bfloat16)
    for M in (32, 768):
        x = jax.random.normal(k[2], (1, M, D)).astype(jnp.bfloat16)
        hlo = jax.jit(quant.ffn_fp8, static_argnums=2).lower(x, norm, 1e-5, w).compile()
        # Transposes of the activation scales ([M, G] or [G, M], G = D / 128 or F / 128).
        # The Mosaic GPU kernels (768 rows) also transpose and widen the weight scales
        # ([2F / 128, D / 128] here) each call, and at decode rows (`MGPU_SWAP_MAX_M`) turn
        # their transposed output ([N, M]): separate costs this test leaves out.
        groups = {str(D // 128), str(F // 128)}
        transposed = [line for line in hlo.as_text().splitlines() if " transpose(" in line
                      and (dims := set(re.search(r"\[([\d,]*)\]", line).group(1).split(",")))
                      and str(M) in dims and dims & groups]
        assert transposed == [], M
    for M in (77, 768):
        gu = jax.random.normal(k[3], (M, 2 * F)).astype(jnp.bfloat16)
        for fn, args in ((lambda *a, **kw: rmsnorm_quant_pallas(*a, 1e-5, **kw), (gu, gu[0])),
                         (swiglu_quant_pallas, (gu,))):
            (q0, s0), (q, s) = fn(*args), fn(*args, group_major=True, poison=True)
            np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
            np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)),
                                          np.asarray(q0.astype(jnp.float32)))


def test_cublaslt_column_split_on_gpu():
    """The handler's column split (`split=(n_split, tail config)`: the output's columns from
    n_split by a second cuBLASLt call, in place): every column written (a fresh draw a case) and
    each as precise as one call, f32 and bf16 out, both arrangements, a split at the first and
    the last 128-column block, and a tail configuration cuBLASLt refuses (the heuristic's
    runs instead)."""
    from kernels import fp8_cublaslt as lt
    from kernels.fp8_matmul import fp8_matmul_ref
    from lacache_jax.quant import quantize_act, quantize_weight
    assert lt.available()
    M, K, N = 256, 4096, 1024
    refused = (10 ** 6,) + lt.HEURISTIC[1:]
    for draw, (n_split, tail, swap) in enumerate([(128, lt.HEURISTIC, False),
                                                  (896, lt.HEURISTIC, False),
                                                  (384, refused, False),
                                                  (512, lt.HEURISTIC, True)]):
        kx, kw = jax.random.split(jax.random.key(100 + draw))
        xq, xs = quantize_act(jax.random.normal(kx, (M, K)))
        wq, ws = quantize_weight(jax.random.normal(kw, (K, N)) * K ** -0.5)
        with jax.default_matmul_precision("highest"):
            ref = fp8_matmul_ref(xq, xs, wq, ws, jnp.float32)
        for dtype, bound in ((jnp.float32, 2.0 ** -12), (jnp.bfloat16, 2.0 ** -8)):
            out = lt.fp8_matmul_cublaslt(xq, xs, wq, ws, dtype, swap=swap,
                                         split=(n_split, tail)).astype(jnp.float32)
            print("split", n_split, tail[0], swap, dtype.__name__, rel_err(out, ref))
            # as one call (test_cublaslt_fp8_gemm_on_gpu), on each side of the split
            for cols in (slice(0, n_split), slice(n_split, N)):
                assert rel_err(out[:, cols], ref[:, cols]) <= bound


def test_cublaslt_configurations_on_gpu():
    """The handler's configuration search (`lt.search`) and a given configuration in the FFI
    call: the search's first row is the heuristic's own choice (a real algo id); each of the
    fastest configurations it found computes the product within the f32 bound above; one that
    cuBLASLt refuses runs the heuristic's algorithm (the same bits as `HEURISTIC`)."""
    from kernels import fp8_cublaslt as lt
    from kernels.fp8_matmul import fp8_matmul_ref
    from lacache_jax.quant import quantize_act, quantize_weight
    assert lt.available(), "the cuBLASLt handler did not build or load (see the warning)"
    M, K, N = 256, 4096, 1024
    found = lt.search(M, N, K, jnp.float32, reps=1, max_configs=256)
    assert found and found[0][0][0] >= 0 and all(ms > 0 for _, ms in found)
    print("configurations", len(found), "heuristic", found[0])
    kx, kw = jax.random.split(jax.random.key(11))
    xq, xs = quantize_act(jax.random.normal(kx, (M, K)))
    wq, ws = quantize_weight(jax.random.normal(kw, (K, N)) * K ** -0.5)
    with jax.default_matmul_precision("highest"):
        ref = fp8_matmul_ref(xq, xs, wq, ws, jnp.float32)
    base = np.asarray(lt.fp8_matmul_cublaslt(xq, xs, wq, ws, jnp.float32, config=lt.HEURISTIC))
    for config, ms in sorted(found, key=lambda r: r[1])[:4]:
        out = lt.fp8_matmul_cublaslt(xq, xs, wq, ws, jnp.float32, config=config)
        print(config, ms, rel_err(out, ref), "same bits", np.array_equal(np.asarray(out), base))
        assert rel_err(out, ref) <= 2.0 ** -12  # the bound of the test below
    refused = (99999,) + lt.HEURISTIC[1:]
    np.testing.assert_array_equal(
        np.asarray(lt.fp8_matmul_cublaslt(xq, xs, wq, ws, jnp.float32, config=refused)), base)


def test_cublaslt_fp8_gemm_on_gpu():
    """cuBLASLt's block-scaled FP8 GEMM through our FFI handler (built here on first use) at
    LLaDA-8B's widths: as precise as the Mosaic GPU kernel against the exact per-group
    product (f32 out), one bf16 rounding more with bf16 out; every element written (a second
    random draw cannot match a stale first output); used by the dispatch on Hopper."""
    from kernels import fp8_cublaslt as lt
    from kernels import fp8_matmul as fm
    from kernels.fp8_matmul import fp8_matmul_ref
    from lacache_jax.quant import quantize_act, quantize_weight
    assert lt.available(), "the cuBLASLt handler did not build or load (see the warning)"
    for draw, (M, K, N) in enumerate([(32, 4096, 1024), (200, 12288, 1024), (1024, 4096, 384),
                                      (1024, 4096, 384)]):
        kx, kw = jax.random.split(jax.random.key(draw))
        xq, xs = quantize_act(jax.random.normal(kx, (M, K)))
        wq, ws = quantize_weight(jax.random.normal(kw, (K, N)) * K ** -0.5)
        with jax.default_matmul_precision("highest"):
            ref = fp8_matmul_ref(xq, xs, wq, ws, jnp.float32)
        out16 = lt.fp8_matmul_cublaslt(xq, xs, wq, ws)
        assert out16.dtype == jnp.bfloat16
        assert rel_err(out16.astype(jnp.float32), ref) <= 2.0 ** -8  # + one bf16 rounding
        assert lt.F32_OUT, f"this cuBLASLt writes no f32 here (swap {lt.SWAP})"
        out = lt.fp8_matmul_cublaslt(xq, xs, wq, ws, jnp.float32)
        print("cublaslt", M, K, N, "swap", lt.SWAP, rel_err(out, ref))
        # As the Mosaic GPU kernel above: Hopper's FP8 MMA keeps ~14 bits of a group's sum.
        assert rel_err(out, ref) <= 2.0 ** -12
        # No element off by more than 2^-5 of the largest (an unwritten tile is off by ~1x).
        assert float(jnp.abs(out - ref).max()) <= 2.0 ** -5 * float(jnp.abs(ref).max())
        if fm.compute_capability()[0] == 9 and M >= fm.CUBLASLT_MIN_M:
            np.testing.assert_array_equal(np.asarray(fm.fp8_matmul(xq, xs, wq, ws)),
                                          np.asarray(out16))
    # The dispatch pads M to a multiple of 8 for it (121 -> 128: DPad's row counts): the
    # real rows as precise as above, computed from the unpadded operands.
    kx, kw = jax.random.split(jax.random.key(7))
    xq, xs = quantize_act(jax.random.normal(kx, (121, 4096)))
    wq, ws = quantize_weight(jax.random.normal(kw, (4096, 1024)) * 4096 ** -0.5)
    with jax.default_matmul_precision("highest"):
        ref = fp8_matmul_ref(xq, xs, wq, ws, jnp.float32)
    out = fm.fp8_matmul(xq, xs, wq, ws, jnp.float32)
    assert out.shape == (121, 1024) and rel_err(out, ref) <= 2.0 ** -12
    if fm.compute_capability()[0] == 9:  # and it was cuBLASLt's, on the padded operands
        pad = lambda a: jnp.pad(a, ((0, 7), (0, 0)))  # noqa: E731
        np.testing.assert_array_equal(
            np.asarray(out),
            np.asarray(lt.fp8_matmul_cublaslt(pad(xq), pad(xs), wq, ws, jnp.float32)[:121]))
