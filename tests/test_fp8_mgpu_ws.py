"""`kernels/fp8_matmul_mgpu_ws.py` (DeepGEMM's recipe in Pallas Mosaic GPU). On the CPU: every
default and knob lowers for CUDA (layouts, wgmma operand shapes, shared-memory budget:
~5 s), the tile walk, steady pipeline, scales and epilogue run right in Pallas' Mosaic GPU
interpreter (~15 s), the default knobs and the refused configs. On the GPU (`-m gpu`): the
compiled kernel against the exact per-group product at LLaDA-8B's FFN shapes."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.fp8_matmul import fp8_matmul_ref
from kernels.fp8_matmul_mgpu_ws import (WsConfig, _check_config, fp8_matmul_mgpu_ws,
                                        gate_up_swiglu_mgpu_ws)
from kernels.hopper import SMEM_BYTES
from tests.conftest import ROOT, cpu_subprocess_env
from lacache_jax.quant import quantize_act, quantize_weight
from tests.conftest import rel_err

GATE_UP, DOWN = (4096, 2 * 12288), (12288, 4096)  # LLaDA-8B's FFN GEMMs: (K, N)


def operands(M: int, K: int, N: int, seed: int = 0):
    kx, kw = jax.random.split(jax.random.key(seed))
    xq, xs = quantize_act(jax.random.normal(kx, (M, K)))
    wq, ws = quantize_weight(jax.random.normal(kw, (K, N)) * K ** -0.5)
    return xq, xs, wq, ws


def shapes(M: int, K: int, N: int):
    return (jax.ShapeDtypeStruct((M, K), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((M, K // 128), jnp.float32),
            jax.ShapeDtypeStruct((N, K), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((N // 128, K // 128), jnp.float32))


def export_cuda(M: int, K: int, N: int, out_dtype=jnp.bfloat16, config=None,
                kernel=fp8_matmul_mgpu_ws) -> str:
    fn = functools.partial(kernel, config=config)
    if kernel is fp8_matmul_mgpu_ws:
        fn = functools.partial(fn, out_dtype=out_dtype)
    return jax.export.export(jax.jit(fn), platforms=["cuda"])(*shapes(M, K, N)).mlir_module()


@pytest.mark.parametrize("M,KN,out_dtype", [
    (1024, GATE_UP, jnp.bfloat16), (4096, DOWN, jnp.float32), (1000, GATE_UP, jnp.float32),
    (1000, DOWN, jnp.bfloat16), (64, DOWN, jnp.bfloat16)])
def test_defaults_lower_for_hopper(M, KN, out_dtype):
    """The default knobs at the FFN shapes lower through Mosaic GPU for CUDA (it cannot run
    here): a wrong layout, wgmma operand or an over-budget shared memory raises."""
    K, N = KN
    assert "mosaic_gpu" in export_cuda(M, K, N, out_dtype)


def test_knobs_lower_for_hopper():
    """Each knob the device sweep varies lowers; a pipeline too deep for shared memory is
    refused by the lowering (so the lowering does check the budget)."""
    for kw in (dict(cluster_dim="m"), dict(cluster=1), dict(wg_rows=64, stages=6, steady=False),
               dict(steady=False, stages=3, epi_cols=128, epi_slots=2),
               dict(snake_dim="n", snake_width=16), dict(ctas=6), dict(memory_registers=48),
               dict(early_scales=True), dict(probe="carry_acc"),
               dict(wg_rows=64, step_groups=2, stages=2, steady=False),
               dict(wg_rows=64, step_groups=2, stages=2, early_scales=True),
               dict(wg_rows=64, step_groups=2, stages=2, probe="carry_acc"),
               dict(probe="carry_acc", wg_rows=64, stages=3, steady=False),
               # tiles across weight blocks (column scales), within one, the last overlapping
               dict(block_n=96, epi_cols=32), dict(block_n=64),
               dict(block_n=160, wg_rows=64, epi_cols=32, cluster=1)):
        assert "mosaic_gpu" in export_cuda(1000, 1024, 512, config=WsConfig(**kw)), kw
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        export_cuda(1024, 1024, 512, config=WsConfig(stages=4, epi_slots=2))


@pytest.mark.parametrize("M,K,N,sms,kw", [
    # 2 x 2 tiles of 256 x 128 on 2 CTAs (2 tiles each: the steady pipeline carries over),
    # M padded (300 -> 512), 4 K groups: the 2 slots turn over twice per tile.
    (300, 512, 256, 2, dict(cluster=1, stages=2)),
    # 128-row tiles (one wave per warpgroup), 2 tiles walked by one CTA along N.
    (100, 256, 256, 1, dict(cluster=1, wg_rows=64, stages=2, snake_dim="n")),
    # Both waves' scales loaded first: the same tile walk with the scales in another order.
    (300, 512, 256, 2, dict(cluster=1, stages=2, early_scales=True)),
    # Two K groups per pipeline step (their promotions in turn), 128-row tiles, steady.
    (200, 512, 256, 2, dict(cluster=1, wg_rows=64, stages=2, step_groups=2)),
    # 96-column tiles: each column's w scale (a tile spans two weight blocks), the sixth
    # tile starting at 416 over the fifth's last 64 columns (512 = 5 x 96 + 32).
    (300, 512, 512, 2, dict(cluster=1, stages=2, block_n=96, epi_cols=32)),
    # 64-column tiles, two per weight block: its one scale a group, at block n0 // 128.
    (200, 256, 256, 1, dict(cluster=1, wg_rows=64, stages=2, block_n=64))])
def test_interpreted_matches_reference(M, K, N, sms, kw):
    """The kernel in Pallas' Mosaic GPU interpreter (TMA, barriers and warpgroups simulated;
    clusters are not: `cluster_barrier` is unimplemented there) against the reference: a
    wrong tile index, scale row, barrier slot of the steady pipeline or epilogue slice shows.
    The interpreter fills unwritten memory with NaN, so an unwritten tile cannot pass."""
    xq, xs, wq, ws = operands(M, K, N)
    ref = fp8_matmul_ref(xq, xs, wq, ws, jnp.float32)
    out = fp8_matmul_mgpu_ws(xq, xs, wq, ws, jnp.float32, config=WsConfig(**kw),
                             sm_count=sms, interpret=True)
    assert out.shape == (M, N) and bool(jnp.isfinite(out).all())
    # The interpreter's wave is an fp32 dot of exact FP8 products (4-bit significands: the
    # products are exact in fp32): fp32 summation order only, ~2^-24 per add, 2^-20 bounds it.
    assert rel_err(out, ref) <= 2.0 ** -20


def test_default_config():
    """DeepGEMM's recipe at the FFN shapes: 256 x 128 tiles, clusters of 2 sharing x, 4
    stages that fit in shared memory and divide the K groups (the steady pipeline); few rows:
    128-row tiles; no cluster where N has no pair of 128-column tiles."""
    for K, N in (GATE_UP, DOWN):
        for dtype in (jnp.bfloat16, jnp.float32):
            c = WsConfig.get_default(1024, N, K, 132, dtype)
            assert (c.block_m, c.cluster, c.cluster_dim, c.stages, c.steady) == (
                256, 2, "n", 4, True)
            assert c.smem_bytes(dtype) <= SMEM_BYTES - 1024
    assert WsConfig.get_default(64, 4096, 12288).wg_rows == 64
    assert WsConfig.get_default(1024, 384, 4096).cluster == 1
    odd = WsConfig.get_default(1024, 4096, 97 * 128)  # 97 K groups: no stage count divides
    assert not odd.steady and odd.stages == 4


def test_wave_filling_config():
    """`get_wave_filling` at LLaDA-8B's FFN GEMMs: the down GEMM at batch 1's 768 rows (and
    DPad's 672, and 1,280 at prompt 1024) in 256 x 96 tiles (129 tiles: one wave on 132
    SMs; 215 at 1,280 rows, the second wave 63% full against 256 x 128's 21%), no cluster
    (43 column tiles do not pair), bf16 out through two 32-column epilogue slots (64 does
    not divide 96); where 256 x 128 already fills its waves best (gate/up at 768 rows, 576
    tiles; down at 1024, 128) the default tile. Less work a SM than cuBLASLt's 128 x 128
    tiles (the dispatch's test) at 672 and 768 rows only: at 1,280 two waves of 256 x 96 are
    three of 128 x 128. Every pick within the register budget and shared memory, whole
    pipelines a tile, and it lowers."""
    from kernels.fp8_matmul_mgpu_ws import REGISTER_BUDGET
    K, N = DOWN
    for M in (768, 672, 1280):
        c = WsConfig.get_wave_filling(M, N, K, 132)
        assert (c.block_m, c.block_n, c.cluster, c.column_scales) == (256, 96, 1, True), M
        assert (c.epi_cols, c.epi_slots, c.stages) == (32, 2, 4), M
        assert c.fills_waves_better(M, N, 132) == (M < 1024), M
    for (K, N), M in ((GATE_UP, 768), (DOWN, 1024), (GATE_UP, 4608)):
        c = WsConfig.get_wave_filling(M, N, K, 132)
        assert (c.block_m, c.block_n, c.cluster) == (256, 128, 2), (M, K, N)
        assert not c.fills_waves_better(M, N, 132)
        assert c == WsConfig.get_default(M, N, K, 132)  # the same pipeline too
    assert WsConfig().tile_registers() == REGISTER_BUDGET  # the default tile is the budget
    for (K, N), M in ((DOWN, 768), (GATE_UP, 768), (DOWN, 1280), (DOWN, 256)):
        c = WsConfig.get_wave_filling(M, N, K, 132)
        _check_config(c, N, K)
        assert c.fits(K) and c.tile_registers() <= REGISTER_BUDGET and c.steady, (M, N, c)
    K, N = DOWN
    assert "mosaic_gpu" in export_cuda(768, K, N, config=WsConfig.get_wave_filling(768, N, K))


def test_device_sweep_knobs_are_accepted_at_the_ffn_shapes():
    """Every entry of the device sweep (`benchmarks/fp8_gemm.py` WS_SWEEP, over the default
    at M 4096) passes the kernel's own checks and fits in shared memory at both FFN shapes: a
    refused entry would cost device time for nothing."""
    from benchmarks.fp8_gemm import WS_SWEEP
    for K, N in (GATE_UP, DOWN):
        base = WsConfig.get_default(4096, N, K, 132)
        for kw in WS_SWEEP:
            c = dataclasses.replace(base, **kw)
            _check_config(c, N, K)
            assert c.smem_bytes() <= SMEM_BYTES - 1024, (K, N, kw)


def test_swiglu_sweep_knobs_are_accepted_at_batch_8s_rows():
    """The same for the fused SwiGLU kernel's sweep (`SWIGLU_SWEEP`) at LLaDA-8B's gate/up
    shape and batch 8's 4,608 rows: the kernel's checks, its one tile shape, shared memory with
    two weight tiles a step, whole pipelines per tile where steady, no padded rows where the
    pair shares w (its 256-row cluster tile divides 4,608), and each lowers for Hopper."""
    from benchmarks.fp8_gemm import SWIGLU_SWEEP
    K, N = GATE_UP
    base = WsConfig.get_default_swiglu(4608, N // 2, K, 132)
    for kw in SWIGLU_SWEEP:
        c = dataclasses.replace(base, **kw)
        _check_config(c, N // 2, K)
        assert c.wg_rows == 64 and c.step_groups == 1 and not c.probe, kw
        assert c.smem_bytes(swiglu=True) <= SMEM_BYTES - 1024, kw
        assert not c.steady or (K // 128) % c.stages == 0, kw
        assert 4608 % (c.block_m * (2 if c.cluster_dim == "m" else 1)) == 0, kw
        # and lowers (the pair sharing w: two multicast weight loads a step)
        assert "mosaic_gpu" in export_cuda(4608, K, N, config=c,
                                           kernel=gate_up_swiglu_mgpu_ws), kw


def test_refuses_unsupported_shapes_and_knobs():
    xq, xs, wq, ws = operands(40, 384, 384)
    with pytest.raises(ValueError, match="N 384 must make an even number of 128-column tiles"):
        fp8_matmul_mgpu_ws(xq, xs, wq, ws, config=WsConfig())
    with pytest.raises(ValueError, match="N 128 must be at least block_n 256"):
        fp8_matmul_mgpu_ws(xq, xs, wq[:128], ws[:1], config=WsConfig(cluster=1, block_n=256))
    with pytest.raises(ValueError, match="stages 4 must divide the 3 pipeline steps"):
        fp8_matmul_mgpu_ws(xq, xs, wq, ws, config=WsConfig(cluster=1))
    for kw, msg in ((dict(wg_rows=96), "wg_rows must be 64 or 128"),
                    (dict(epi_cols=48), "epi_cols must be 32, 64 or 128"),
                    (dict(cluster=4), "cluster must be 1 or 2"),
                    (dict(stages=1, steady=False), "stages must be at least 2"),
                    (dict(memory_registers=32), "memory_registers must be a multiple of 8"),
                    (dict(memory_registers=36), "memory_registers must be a multiple of 8"),
                    (dict(probe="fast"), "probe must be one of"),
                    (dict(step_groups=2), "step_groups must be 1, or 2 with wg_rows=64"),
                    (dict(step_groups=3, wg_rows=64), "step_groups must be 1, or 2"),
                    (dict(step_groups=2, wg_rows=64, steady=False),
                     "step_groups 2 must divide the 3 K groups"),
                    (dict(block_n=80, epi_cols=32), "block_n must be a multiple of 32"),
                    (dict(block_n=96), "block_n must be a multiple of 32 .* of epi_cols 64")):
        with pytest.raises(ValueError, match=msg):
            fp8_matmul_mgpu_ws(xq, xs, wq, ws, config=WsConfig(**{"cluster": 1, **kw}))
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_matmul_mgpu_ws(xq[:, :200], xs, wq[:, :200], ws)
    with pytest.raises(ValueError, match="the interpreter has no wgmma accumulator"):
        fp8_matmul_mgpu_ws(xq, xs, wq, ws, config=WsConfig(cluster=1, stages=3,
                                                           probe="carry_acc"), interpret=True)


def reference_chunked(xq, xs, wq, ws, cols: int = 4096):
    """fp8_matmul_ref in f32 over column blocks: its [M, N, K/128] partials at M 4096, N 24576
    would take 13 GB at once."""
    with jax.default_matmul_precision("highest"):
        return jnp.concatenate([
            fp8_matmul_ref(xq, xs, wq[n:n + cols], ws[n // 128:(n + cols) // 128], jnp.float32)
            for n in range(0, wq.shape[0], cols)], axis=1)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1024, 4096, 1000])
@pytest.mark.parametrize("KN", [GATE_UP, DOWN], ids=["gate_up", "down"])
def test_on_gpu_at_llada_shapes(M, KN):
    """The compiled kernel (default knobs: clusters of 2 with TMA multicast, steady
    pipeline) against the exact per-group product, f32 and bf16 out, two random draws (a
    stale output of the first cannot pass the second)."""
    K, N = KN
    for draw in range(2):
        xq, xs, wq, ws = operands(M, K, N, seed=10 * M + draw)
        ref = reference_chunked(xq, xs, wq, ws)
        out = fp8_matmul_mgpu_ws(xq, xs, wq, ws, jnp.float32)
        print("mgpu_ws", M, K, N, draw, rel_err(out, ref))
        # Hopper's FP8 wgmma sums a group's 128 products with about 14 significant bits
        # (DeepSeek-V3 report, section 3.3.2): ~2^-13 per group, the bound of
        # tests/test_gpu.py's FP8 test (today's kernels measure 1.27e-4 to 1.29e-4).
        assert rel_err(out, ref) <= 2.0 ** -12
        # No element off by more than 2^-5 of the largest (an unwritten tile is off by ~1x).
        assert float(jnp.abs(out - ref).max()) <= 2.0 ** -5 * float(jnp.abs(ref).max())
        out16 = fp8_matmul_mgpu_ws(xq, xs, wq, ws)
        assert out16.dtype == jnp.bfloat16
        assert rel_err(out16.astype(jnp.float32), ref) <= 2.0 ** -8  # + one bf16 rounding


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(cluster_dim="m"), dict(cluster=1), dict(steady=False),
                                dict(wg_rows=64), dict(ctas=7, snake_dim="n", snake_width=16),
                                dict(stages=3, epi_cols=64, epi_slots=2),
                                # the sweep's best (twelfth session); passed on the H200
                                # (thirteenth)
                                dict(wg_rows=64, step_groups=2, stages=3, steady=False),
                                # 96-column tiles (column scales; 43 tiles, the last
                                # overlapping), alone and paired along M; 64-column tiles
                                dict(block_n=96, cluster=1), dict(block_n=96, cluster_dim="m"),
                                dict(block_n=64),
                                # a pair along N whose second CTA's last tile overlaps (26)
                                dict(block_n=160, wg_rows=64)],
                         ids=str)
def test_knobs_on_gpu(kw):
    """The knobs the sweep varies, at the down GEMM with a ragged M (1000 rows: padded) and
    an uneven persistent walk (7 CTAs), as precise as the defaults."""
    K, N = DOWN
    xq, xs, wq, ws = operands(1000, K, N, seed=3)
    ref = reference_chunked(xq, xs, wq, ws)
    config = dataclasses.replace(WsConfig.get_default(1000, N, K, out_dtype=jnp.float32), **kw)
    out = fp8_matmul_mgpu_ws(xq, xs, wq, ws, jnp.float32, config=config)
    print("mgpu_ws", kw, rel_err(out, ref))
    assert rel_err(out, ref) <= 2.0 ** -12  # as above
    assert float(jnp.abs(out - ref).max()) <= 2.0 ** -5 * float(jnp.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.parametrize("M", [768, 1280])
def test_wave_filling_on_gpu(M):
    """`get_wave_filling`'s tile (256 x 96 at the down GEMM's 768 and 1,280 rows: column
    scales, the last tile overlapping) against the exact per-group product, f32 and bf16 out,
    as precise as the default tile; how many outputs equal the default tile's is printed (the
    scales' products are the same; whether the wgmma's sums are is the hardware's)."""
    K, N = DOWN
    xq, xs, wq, ws = operands(M, K, N, seed=M)
    ref = reference_chunked(xq, xs, wq, ws)
    c = WsConfig.get_wave_filling(M, N, K, out_dtype=jnp.float32)
    assert c.block_n == 96
    out = fp8_matmul_mgpu_ws(xq, xs, wq, ws, jnp.float32, config=c)
    default = fp8_matmul_mgpu_ws(xq, xs, wq, ws, jnp.float32)
    print("wave filling", M, c, rel_err(out, ref), "same as default",
          float(jnp.mean(out == default)))
    assert rel_err(out, ref) <= 2.0 ** -12  # as test_on_gpu_at_llada_shapes
    assert float(jnp.abs(out - ref).max()) <= 2.0 ** -5 * float(jnp.abs(ref).max())
    out16 = fp8_matmul_mgpu_ws(xq, xs, wq, ws, config=WsConfig.get_wave_filling(M, N, K))
    assert rel_err(out16.astype(jnp.float32), ref) <= 2.0 ** -8  # + one bf16 rounding


# --- gate/up with SwiGLU + quantisation in the epilogue (gate_up_swiglu_mgpu_ws) ------------

def unfused_swiglu(xq, xs, wq, ws, config, interpret: bool):
    """The plain kernel's bf16 gate | up product, then the SwiGLU + quantisation kernel."""
    from kernels.fused_quant import swiglu_quant_pallas
    gu = fp8_matmul_mgpu_ws(xq, xs, wq, ws, jnp.bfloat16, config=config,
                            sm_count=config.ctas or 132, interpret=interpret)
    return swiglu_quant_pallas(gu, interpret=interpret)


@pytest.mark.parametrize("M", [1024, 4608, 1000])
def test_swiglu_defaults_lower_for_hopper(M):
    """The fused kernel's default (128 x 128 tiles of two 64-row warpgroups with a gate and an
    up sum each, no clusters, 4 stages; the pairs lower in the sweep's test) lowers through
    Mosaic GPU at LLaDA-8B's gate/up shape, batch 8's 4,608 rows, 1,024 and a ragged M:
    the epilogue's row max, FP8 cast and the stores of the tile and its row scales have
    layouts; the non-steady pipeline too."""
    assert "mosaic_gpu" in export_cuda(M, *GATE_UP, kernel=gate_up_swiglu_mgpu_ws)
    flat = dataclasses.replace(WsConfig.get_default_swiglu(M, 12288, 4096), steady=False,
                               stages=3, snake_dim="n")
    assert "mosaic_gpu" in export_cuda(M, *GATE_UP, config=flat, kernel=gate_up_swiglu_mgpu_ws)


def test_swiglu_default_config(monkeypatch):
    c = WsConfig.get_default_swiglu(4608, 12288, 4096)
    assert (c.wg_rows, c.block_m, c.cluster, c.stages, c.steady) == (64, 128, 1, 4, True)
    assert c.smem_bytes(swiglu=True) <= SMEM_BYTES - 1024
    # No pairs as shipped (faster at 768, 1,280 and 4,608 rows on an H100); from
    # SWIGLU_PAIRS_MIN_M rows where the column blocks pair up
    from kernels import fp8_matmul_mgpu_ws as ws_mod
    monkeypatch.setattr(ws_mod, "SWIGLU_PAIRS_MIN_M", 4608)
    pairs = WsConfig.get_default_swiglu(4608, 12288, 4096)
    assert (pairs.cluster, pairs.cluster_dim) == (2, "n")  # sharing x
    assert WsConfig.get_default_swiglu(4608, 384, 4096).cluster == 1  # 3 column blocks
    assert WsConfig.get_default_swiglu(4607, 12288, 4096).cluster == 1
    # The pipeline by rows: 3 stages restarted each tile below SWIGLU_STEADY_MIN_M rows
    # (faster at 768 and 1,536 on an H100), 4 steady from there (the switches count the
    # stages down from SWIGLU_STAGES and skip the steady pipeline without SWIGLU_STEADY)
    for M, want in ((768, (3, False)), (4607, (3, False)), (4608, (4, True))):
        c = WsConfig.get_default_swiglu(M, 12288, 4096)
        assert (c.stages, c.steady) == want, M
    monkeypatch.setattr(ws_mod, "SWIGLU_STAGES", 3)
    monkeypatch.setattr(ws_mod, "SWIGLU_STEADY", 0)
    c = WsConfig.get_default_swiglu(4608, 12288, 4096)
    assert (c.stages, c.steady) == (3, False)
    # steady first: 3 stages do not divide 32 K groups, so 2 steady ones; they divide 24
    monkeypatch.setattr(ws_mod, "SWIGLU_STEADY", 1)
    for K, want in ((4096, (2, True)), (3072, (3, True))):
        c = WsConfig.get_default_swiglu(4608, 12288, K)
        assert (c.stages, c.steady) == want


@pytest.mark.parametrize("M,K,F,kw", [
    # 2 x 2 tiles of 128 x 128 on 2 CTAs (2 each: the steady pipeline carries over), M
    # padded (200 -> 256), 4 K groups turning the 2 slots over twice a tile.
    (200, 512, 256, dict(cluster=1, stages=2, ctas=2)),
    # One CTA walking 3 column blocks along N, 2 K groups, the pipeline refilled every tile.
    (100, 256, 384, dict(cluster=1, stages=2, ctas=1, snake_dim="n", steady=False))])
def test_swiglu_interpreted_is_the_unfused_kernels(M, K, F, kw):
    """In the Mosaic GPU interpreter against the plain kernel's bf16 gate | up product, then
    the SwiGLU + quantisation kernel (Triton's interpreter): the same per-group promotions,
    the same rounding of gate and up to bf16 and `swiglu_quantize_tile` in both, so a wrong
    weight block, tile, scale row or column shows, and an unwritten one stays NaN (the
    interpreter's fill). Not bit for bit: the two interpreters' XLA fusions of the fp32
    expression may round `silu(gate) * up` an ulp apart, which moves an FP8 code by one step
    (2^-3 of that element, as 144 to 160 in one of 51,200 here) where it sits on a rounding
    boundary, and a scale by an ulp where the group's largest element moves. Against the
    reference composition (another fp32 summation order): within what flips a bf16 rounding
    of gate or up (2^-8 relative) and, through it, rarely an FP8 code (2^-4 relative for
    that element)."""
    from kernels.gate_up_swiglu import gate_up_swiglu_quant_ref
    from lacache_jax.quant import dequantize_act
    xq, xs, wq, ws = operands(M, K, 2 * F, seed=M)
    c = WsConfig(wg_rows=64, **kw)
    q, s = gate_up_swiglu_mgpu_ws(xq, xs, wq, ws, config=c, sm_count=c.ctas, interpret=True)
    assert q.shape == (M, F) and q.dtype == jnp.float8_e4m3fn and s.shape == (M, F // 128)
    q0, s0 = unfused_swiglu(xq, xs, wq, ws, c, interpret=True)
    a, b = (np.asarray(x.astype(jnp.float32)) for x in (q, q0))
    assert np.isfinite(a).all() and np.mean(a != b) <= 1e-3
    # one FP8 step apart where they differ (relative 2^-3 of the larger; 2^-9 subnormal)
    assert (np.abs(a - b) <= np.maximum(2.0 ** -3 * np.maximum(np.abs(a), np.abs(b)),
                                        2.0 ** -9)).all()
    np.testing.assert_allclose(np.asarray(s), np.asarray(s0), rtol=2.0 ** -22)
    qr, sr = gate_up_swiglu_quant_ref(xq, xs, wq, ws)
    assert rel_err(dequantize_act(q, s), dequantize_act(qr, sr)) <= 2.0 ** -8


def test_swiglu_tail_split():
    """The last partial wave's column blocks (`SWIGLU_TAIL`) at LLaDA-8B's F and 132 SMs:
    whole columns of 128-row tiles within whole waves, the rest in 64-row tiles within one."""
    from kernels.fp8_matmul_mgpu_ws import swiglu_tail_split
    want = {768: 88, 1024: None, 1280: 92, 1536: None, 4608: 95, 6144: None, 100: None}
    for M, main in want.items():
        assert swiglu_tail_split(M, 12288, 132) == main, M
        if main is not None:  # whole waves first, then one wave of half tiles at most
            m_tiles = M // 128
            assert m_tiles * main <= (m_tiles * 96 // 132) * 132
            assert 2 * m_tiles * (96 - main) <= 132
    t = WsConfig.get_swiglu_tail(768, 4096)  # the pipeline as the default's at these rows
    assert (t.split_parts, t.block_m, t.cluster, t.stages, t.steady) == (True, 64, 1, 3, False)
    assert t.smem_bytes(swiglu=True) <= SMEM_BYTES - 1024


# XLA CPU's concurrency-optimised scheduler may reorder an interpreted thread's barrier
# callbacks, which no data orders: the half tiles' hand-over deadlocked there about one run
# in two (two threads waiting on the third, on a 2-core machine), so their interpreted
# checks run in a process without it
IN_ORDER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def interpreted_half_tiles():
    """The half tiles in the Mosaic GPU interpreter (`test_swiglu_half_tiles_interpreted`'s
    process). (1) Both warpgroups on one 64-row tile (`split_parts`: one sums the gate
    block, the other the up block and hands its sum over in shared memory) against the
    default tiles: one tile on one CTA, then 2 x 3 tiles on 2 CTAs (3 a CTA: the hand-over's
    full / free barriers and the steady pipeline carried over tiles). (2) The last wave split
    off (`tail=True`: on 2 SMs, one row tile x 5 column blocks, so 4 blocks in 4 tiles, two a
    CTA, then the last block in 2 half tiles of either kind written into the first launch's
    outputs) against one launch. Each output element is the same promotions in the same
    order, so equal in every element; a block no launch wrote would stay NaN (the
    interpreter's fill)."""
    from kernels import fp8_matmul_mgpu_ws as ws_mod

    def assert_equal(got, want):
        for a, b in zip(got, want):
            a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
            assert np.isfinite(a).all() and np.array_equal(a, b)
    for M, K, F, kw in ((64, 256, 128, dict(ctas=1, steady=False)),
                        (128, 512, 384, dict(ctas=2, steady=True))):
        xq, xs, wq, ws = operands(M, K, 2 * F, seed=M)
        whole, half = (gate_up_swiglu_mgpu_ws(
            xq, xs, wq, ws, sm_count=kw["ctas"], interpret=True,
            config=WsConfig(wg_rows=64, cluster=1, stages=2, split_parts=split, **kw))
            for split in (False, True))
        assert_equal(half, whole)
    M, K, F, sms = 128, 256, 640, 2
    assert ws_mod.swiglu_tail_split(M, F, sms) == 4
    xq, xs, wq, ws = operands(M, K, 2 * F, seed=3)
    c = WsConfig.get_default_swiglu(M, F, K)
    one = gate_up_swiglu_mgpu_ws(xq, xs, wq, ws, config=c, sm_count=sms, interpret=True,
                                 tail=False)
    for kind in (1, 0):
        ws_mod.SWIGLU_TAIL_SPLIT = kind
        jax.clear_caches()  # the switch is read when the kernel is traced
        assert_equal(gate_up_swiglu_mgpu_ws(xq, xs, wq, ws, config=c, sm_count=sms,
                                            interpret=True, tail=True), one)


def test_swiglu_half_tiles_interpreted(tmp_path):
    """`interpreted_half_tiles` in a process without XLA CPU's reordering (`IN_ORDER`)."""
    code = "from tests.test_fp8_mgpu_ws import interpreted_half_tiles as f; f(); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          env=cpu_subprocess_env(tmp_path, IN_ORDER), text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_swiglu_tail_lowers_for_hopper(monkeypatch):
    """Both launches at batch 1's 768 rows (88 column blocks, then 8 in 64-row tiles, of both
    warpgroups or of one, the second taking the first's outputs in place) lower through
    Mosaic GPU for CUDA, and the whole kernel in half tiles; where the switch is read (the
    default configuration), off one launch."""
    from kernels import fp8_matmul_mgpu_ws as ws_mod

    def launches(**kw):
        fn = functools.partial(gate_up_swiglu_mgpu_ws, **kw)
        text = jax.export.export(jax.jit(fn), platforms=["cuda"])(
            *shapes(768, *GATE_UP)).mlir_module()
        return [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    for kind in (1, 0):  # the half tiles with both warpgroups busy, or one
        monkeypatch.setattr(ws_mod, "SWIGLU_TAIL_SPLIT", kind)
        jax.clear_caches()
        first, second = launches(tail=True)
        name = first.split(" = ")[0].strip().split(":")[0]  # "%4" of "%4:2 = ..."
        assert f"{name}#0, {name}#1)" in second  # the first launch's outputs go in
    # the whole kernel in half tiles (the sweep's `split_parts` row)
    half = WsConfig(wg_rows=64, cluster=1, split_parts=True).with_swiglu_pipeline(768, 4096)
    assert half.smem_bytes(swiglu=True) <= SMEM_BYTES - 1024
    assert len(launches(config=half)) == 1
    for on, want in ((1, 2), (0, 1)):
        monkeypatch.setattr(ws_mod, "SWIGLU_TAIL", on)
        jax.clear_caches()  # the switch is read when the kernel is traced
        assert len(launches()) == want


def test_split_parts_refuses_what_it_cannot_share():
    for kw in (dict(cluster=2), dict(wg_rows=128), dict(consumers=1, cluster=1)):
        with pytest.raises(ValueError, match="split_parts needs"):
            _check_config(WsConfig(**{"wg_rows": 64, "cluster": 1, "split_parts": True, **kw}),
                          12288, 4096)
    xq, xs, wq, ws = operands(64, 256, 256)
    with pytest.raises(ValueError, match="the SwiGLU kernel's"):
        fp8_matmul_mgpu_ws(xq, xs, wq, ws, interpret=True, config=WsConfig(
            wg_rows=64, cluster=1, stages=2, steady=False, split_parts=True))


def test_swiglu_refuses_what_its_registers_do_not_take():
    xq, xs, wq, ws = operands(40, 256, 512)
    for kw, msg in ((dict(), "needs wg_rows=64"),
                    (dict(wg_rows=64, step_groups=2, steady=False), "step_groups=1"),
                    (dict(wg_rows=64, probe="carry_acc", steady=False), "no probe"),
                    (dict(wg_rows=64, block_n=64), "block_n=128")):
        with pytest.raises(ValueError, match=msg):
            gate_up_swiglu_mgpu_ws(xq, xs, wq, ws, config=WsConfig(cluster=1, stages=2, **kw))
    with pytest.raises(ValueError, match="must be 2 F with F a multiple of 128"):
        gate_up_swiglu_mgpu_ws(xq, xs, wq[:384], ws[:3])


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4608, 1000])
def test_swiglu_on_gpu_at_llada_shapes(M):
    """The compiled fused kernel at LLaDA-8B's gate/up shape (batch 8's 4,608 rows, a ragged
    M), two draws, against the plain kernel + the SwiGLU kernel on the same GPU: gate and up
    are the same sums rounded the same way; the sigmoid's exp may round otherwise in Mosaic
    GPU than in Triton (an fp32 ulp), which moves an FP8 code by one step (2^-3 of that
    element) only where it sits on a rounding boundary: the dequantised activations within
    2^-8 relative (as the Triton fused kernel's bound against another summation order), so
    at most about 2^-10 of the codes (one step each adds ~2^-6 of an element's square: a
    fraction f of them gives ~sqrt(f) 2^-3) differ. Against the exact product's
    composition: the wgmma's ~2^-13 a group flips bf16 roundings of gate or up (2^-8) and,
    rarely, an FP8 code through them: within 2^-6."""
    from kernels.fused_quant import swiglu_quant_ref
    from lacache_jax.quant import dequantize_act
    K, N = GATE_UP
    for draw in range(2):
        xq, xs, wq, ws = operands(M, K, N, seed=10 * M + draw)
        q, s = gate_up_swiglu_mgpu_ws(xq, xs, wq, ws)
        q0, s0 = unfused_swiglu(xq, xs, wq, ws, WsConfig.get_default(M, N, K), False)
        same = float(jnp.mean(q.astype(jnp.float32) == q0.astype(jnp.float32)))
        got, unfused = dequantize_act(q, s), dequantize_act(q0, s0)
        exact = dequantize_act(*swiglu_quant_ref(
            reference_chunked(xq, xs, wq, ws).astype(jnp.bfloat16)))
        print("swiglu mgpu_ws", M, draw, "same codes", same, "vs unfused",
              rel_err(got, unfused), "vs exact", rel_err(got, exact))
        assert bool(jnp.isfinite(got).all()) and same >= 1 - 2.0 ** -10
        assert rel_err(got, unfused) <= 2.0 ** -8
        assert rel_err(got, exact) <= 2.0 ** -6


@pytest.mark.gpu
@pytest.mark.parametrize("M", [768, 1280])
def test_swiglu_tail_on_gpu(M):
    """The last wave split off (`tail=True`: 88 / 92 column blocks, then 64-row tiles of one
    consumer warpgroup written into the first launch's outputs) against one launch on the
    GPU: each element is the same promotions in the same order on the same wgmma shape, so
    equal in every element and scale (a block neither launch wrote would not be)."""
    from kernels.fp8_matmul_mgpu_ws import swiglu_tail_split
    K, N = GATE_UP
    assert swiglu_tail_split(M, N // 2, 132) == {768: 88, 1280: 92}[M]  # a split happens
    xq, xs, wq, ws = operands(M, K, N, seed=M)
    split = gate_up_swiglu_mgpu_ws(xq, xs, wq, ws, tail=True)
    one = gate_up_swiglu_mgpu_ws(xq, xs, wq, ws, tail=False)
    for a, b in zip(split, one):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        assert bool(jnp.isfinite(a).all()) and bool(jnp.array_equal(a, b))


@pytest.mark.gpu
def test_swiglu_half_tiles_on_gpu():
    """The whole kernel in half tiles (`split_parts`: a warpgroup on each of gate and up, the
    up sum handed over in shared memory) against the default tiles at batch 1's 768 rows on
    the GPU: each part's sum is the same wgmma shape's promotions in the same order, so
    equal in every element and scale."""
    K, N = GATE_UP
    xq, xs, wq, ws = operands(768, K, N, seed=768)
    half = WsConfig(wg_rows=64, cluster=1, split_parts=True).with_swiglu_pipeline(768, K)
    got = gate_up_swiglu_mgpu_ws(xq, xs, wq, ws, config=half)
    for a, b in zip(got, gate_up_swiglu_mgpu_ws(xq, xs, wq, ws)):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        assert bool(jnp.isfinite(a).all()) and bool(jnp.array_equal(a, b))
