"""Flash-Cache update kernels (kernels/flash_cache.py, kernels/flash_cache_mgpu.py): the Pallas
kernels in interpret mode against their pure-jnp reference, the reference against the model's
own q/k/v path, the Triton IR through MLIR's verifier, the Mosaic GPU kernel through its CUDA
lowering, and both kernels on the GPU (`-m gpu`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lacache_jax as lj
from kernels import flash_cache as fc
from kernels import flash_cache_mgpu as fcm
from kernels.flash_cache import BlockSizes, flash_cache_pallas, flash_cache_ref
from kernels.flash_cache_mgpu import MgpuConfig, flash_cache_mgpu
from lacache_jax import cache
from lacache_jax.cache import Ctx
from lacache_jax.config import tiny
from lacache_jax.model import Layer, qkv, rope_tables
from lacache_jax.sharding import group_columns
from tests.conftest import GEN_CFG, assert_valid_triton, rel_err


def operands(B, R, D, T, H, G, K, dtype=jnp.float32, seed=0):
    """Random rows, weights, caches; row columns a mix of distinct cache columns and >= T
    (padding rows that must not write)."""
    ks = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(ks[0], (B, R, D)).astype(dtype)
    w = (jax.random.normal(ks[1], (D, (H + 2 * G) * K)) * D ** -0.5).astype(dtype)
    pos = jax.random.randint(ks[2], (B, R), 0, 4 * T)
    cos, sin = rope_tables(pos, K, 500000.0)
    rng = np.random.default_rng(seed)
    cols = np.stack([rng.permutation(T + R)[:R] for _ in range(B)])  # >= T: padding
    cols = jnp.asarray(np.minimum(cols, T + 3), jnp.int32)
    kc = jax.random.normal(ks[3], (B, T, G, K)).astype(dtype)
    vc = jax.random.normal(ks[4], (B, T, G, K)).astype(dtype)
    return h, w, cos, sin, cols, kc, vc


CASES = {  # B, R, D, T, H, G, K, tp: 21 rows over three 8-row tiles (the last one padded)
    "gqa_tp2": (3, 7, 64, 11, 4, 2, 16, 2),
    "mha": (2, 5, 32, 9, 2, 2, 8, 1),
}


@pytest.mark.parametrize("case,splits,depth,programs", [(c, 1, 16, 0) for c in CASES] + [
    ("gqa_tp2", 2, 16, 0), ("gqa_tp2", 1, 8, 22), ("gqa_tp2", 1, 16, 3), ("mha", 2, 16, 5)])
def test_kernel_matches_reference_interpret(case, splits, depth, programs):
    """Every head's columns in one program, or split over `splits` programs (each taking
    part of both RoPE halves), or the (head part, chunk) units dealt to `programs`
    programs: 22 take 3 of a head's 8 chunks each (every head cut, up to 4 partials
    summed), 3 take 11 of 4-chunk heads (whole heads finished at once beside cut ones, up
    to 4 head parts a program), 5 take 5 of 2-chunk head halves."""
    B, R, D, T, H, G, K, tp = CASES[case]
    args = operands(B, R, D, T, H, G, K)
    block = BlockSizes(rows=8, depth=depth, splits=splits, programs=programs)
    stream = fc.Stream.of((H + 2 * G) * splits, D // depth, programs)
    assert programs == 0 or stream.pieces > 1  # partials summed: what these cases test
    q_r, k_r, v_r = flash_cache_ref(*args, n_heads=H, tp=tp)
    q, k, v = flash_cache_pallas(*args[:5], args[5] + 0, args[6] + 0, n_heads=H, tp=tp,
                                 block=block, interpret=True)
    # fp32: the kernel sums the projection in 16-wide chunks, XLA in one pass: summation order
    # over D <= 64 terms of magnitude ~1 changes the result by ~1e-6.
    for got, want in ((q, q_r), (k, k_r), (v, v_r)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    untouched = np.ones((B, T), bool)
    cols = np.asarray(args[4])
    for b in range(B):
        untouched[b, cols[b][cols[b] < T]] = False
    # rows nobody queried keep the old cache bit for bit; queried rows changed
    np.testing.assert_array_equal(np.asarray(k)[untouched], np.asarray(args[5])[untouched])
    assert not np.allclose(np.asarray(k)[~untouched], np.asarray(args[5])[~untouched])


def test_reference_is_the_models_qkv_and_scatter():
    """The decoder's CPU path: the reference computes the model's own q/k/v, for the
    checkpoint layout and the tensor-parallel column groups, and writes k/v at `cols`."""
    cfg = tiny(n_heads=4, n_kv_heads=2)
    h, w, cos, sin, cols, kc, vc = operands(2, 5, cfg.d_model, 9, 4, 2, cfg.head_dim)
    K = cfg.head_dim
    for tp in (1, 2):
        grouped = group_columns(w, (4 * K, 2 * K, 2 * K), tp) if tp > 1 else w
        layer = Layer(*(None,) * 6, tp=tp)
        layer.w_qkv = grouped
        q_m, k_m, v_m = jax.jit(lambda h, c, s: qkv(h, layer, cfg, c, s))(h, cos, sin)
        q, k, v = jax.jit(lambda *a: flash_cache_ref(*a, n_heads=4, tp=tp))(
            h, grouped, cos, sin, cols, kc, vc)
        # Same ops in the same order; only XLA's fusion choices may differ (fp32 ~1e-7).
        np.testing.assert_allclose(np.asarray(q), np.asarray(q_m), rtol=0, atol=1e-6)
        for b in range(2):
            live = np.asarray(cols[b]) < 9
            c = np.asarray(cols[b])[live]
            np.testing.assert_allclose(np.asarray(k[b, c]), np.asarray(k_m[b, live]), atol=1e-6)
            np.testing.assert_array_equal(np.asarray(v[b, c]), np.asarray(v_m[b, live]))
            rest = np.setdiff1d(np.arange(9), c)
            np.testing.assert_array_equal(np.asarray(k[b, rest]), np.asarray(kc[b, rest]))


def test_bad_shapes_are_refused():
    args = list(operands(2, 5, 64, 11, 4, 2, 16))
    with pytest.raises(ValueError, match="cols must be"):
        flash_cache_ref(*args[:4], args[4][:, :3], *args[5:], n_heads=4)
    with pytest.raises(ValueError, match="w_qkv must be"):
        flash_cache_ref(args[0], args[1][:, :-16], *args[2:], n_heads=4)
    with pytest.raises(ValueError, match="block.depth"):
        flash_cache_pallas(*args, n_heads=4, block=BlockSizes(8, 48), interpret=True)
    with pytest.raises(ValueError, match="block.splits=3 must divide head_dim / 2 = 8"):
        flash_cache_pallas(*args, n_heads=4, block=BlockSizes(8, 16, splits=3), interpret=True)
    with pytest.raises(ValueError, match="leaves 4 columns per RoPE half: Triton's dot"):
        flash_cache_pallas(*args, n_heads=4, block=BlockSizes(8, 16, splits=2))
    with pytest.raises(ValueError, match="block.programs=-1 must be >= 0"):
        flash_cache_pallas(*args, n_heads=4, block=BlockSizes(8, 16, programs=-1),
                           interpret=True)


@pytest.mark.parametrize("splits,depth,programs", [(1, 128, 0), (2, 128, 0), (1, 32, 11)])
def test_triton_ir_verifies(splits, depth, programs):
    args = operands(2, 40, 128, 50, 4, 2, 64, dtype=jnp.bfloat16)
    block = dataclasses.replace(BlockSizes.get_default(80, 128), splits=splits, depth=depth,
                                programs=programs)
    fn = lambda *a: flash_cache_pallas(*a, n_heads=4, block=block)  # noqa: E731
    assert_valid_triton(fn, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("B,R,splits,programs", [(1, 128, 1, 0), (4, 128, 1, 0), (3, 70, 1, 0),
                                                 (1, 128, 2, 0), (1, 128, 1, 132),
                                                 (3, 70, 1, 200)])
def test_kernel_on_gpu(B, R, splits, programs):
    """LLaDA-8B head shapes (H = G = 32, K = 128), a shortened d_model; default tiles, each
    head split over two programs, and the 96 heads' chunks dealt, per row tile, to 132
    programs (128 rows: two 64-row tiles, 16 chunks a head, 128 programs of 12) or to 200
    (210 rows: two 128-row tiles, 8 chunks a head, 192 programs of 4)."""
    args = operands(B, R, 1024, 600, 32, 32, 128, dtype=jnp.bfloat16, seed=B)
    ref = flash_cache_ref(*args, n_heads=32)
    block = dataclasses.replace(BlockSizes.get_default(B * R, 1024), splits=splits,
                                programs=programs)
    out = flash_cache_pallas(*args[:5], args[5] + 0, args[6] + 0, n_heads=32, block=block)
    for got, want in zip(out, ref):
        g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
        # bf16 operands, fp32 accumulation in both; summation order over 1024 terms may move
        # the bf16 rounding of the projection by an ulp (2^-8), rotated into two outputs.
        np.testing.assert_allclose(g, w, rtol=0, atol=2 * 2.0 ** -8 * np.abs(w).max())


def test_default_tiles():
    """A batch-1 flash step's 65-128 rows take two 64-row tiles, 64 deep, 4 stages (faster
    than one 128-row tile in 5 of 6 same-run comparisons on the H200); more rows take
    128-row tiles, 128-deep chunks, 3 stages (RESULTS.md tenth session); smaller row tiles
    keep 64-deep chunks, 4 stages; a d_model that the chunk does not divide falls back to
    the largest chunk that divides it."""
    assert BlockSizes.get_default(128, 4096) == BlockSizes(64, 64, 4, 4)
    assert BlockSizes.get_default(70, 4096) == BlockSizes(64, 64, 4, 4)
    assert BlockSizes.get_default(129, 4096) == BlockSizes(128, 128, 8, 3)
    assert BlockSizes.get_default(4096, 4096) == BlockSizes(128, 128, 8, 3)
    assert BlockSizes.get_default(40, 4096) == BlockSizes(64, 64, 4, 4)
    assert BlockSizes.get_default(4096, 96) == BlockSizes(128, 32, 8, 4)
    assert BlockSizes.get_default(128, 96) == BlockSizes(64, 32, 4, 4)


def test_dispatch_leaves_large_batches_to_xla(monkeypatch):
    """The fused kernel wins at batch 1 and loses at batch 32 on the H200 (R 128): the
    dispatch uses it only up to FUSED_MAX_ROWS query rows, on one head group."""
    monkeypatch.setattr(fc.jax, "default_backend", lambda: "gpu")
    assert fc.use_kernel(128, 1) and fc.use_kernel(fc.FUSED_MAX_ROWS, 1)
    assert not fc.use_kernel(fc.FUSED_MAX_ROWS + 1, 1) and not fc.use_kernel(32 * 128, 1)
    assert not fc.use_kernel(128, 2)
    # RoPE halves Triton can block: powers of two from 16 (head_dim 128 and 64, not 96 or 16)
    assert fc.use_kernel(128, 1, 64) and not fc.use_kernel(128, 1, 96)
    assert not fc.use_kernel(128, 1, 16)
    monkeypatch.setattr(fc.jax, "default_backend", lambda: "cpu")
    assert not fc.use_kernel(128, 1)


def count_kernel_calls(monkeypatch, *kernels) -> list:
    """A list that gets an entry each time one of `kernels` ((module, name) pairs; default
    both Pallas kernels, Triton and Mosaic GPU) is traced."""
    calls = []
    for module, name in kernels or ((fc, "flash_cache_pallas"), (fcm, "flash_cache_mgpu")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, kernel=kernel, **k: calls.append(1) or kernel(*a, **k))
    return calls


# --- the Mosaic GPU kernel (kernels/flash_cache_mgpu.py) -----------------------------------

MGPU_CASES = {  # B, R, D, T, H, G, K, config: one and two consumer warpgroups, GQA
    "one_wg_gqa": (2, 21, 128, 30, 2, 1, 64, MgpuConfig(stages=2)),
    "two_wg_padded": (3, 30, 256, 40, 2, 1, 64, MgpuConfig(stages=3)),
}


# A bf16 ulp is 2^-8 to 2^-7 of a value. Where the kernel's fp32 sum (in other chunks than
# XLA's) rounds the projection to the other bf16 neighbour, RoPE carries that ulp of x1 and of
# x2 into an output (|cos| + |sin| <= sqrt 2), whose own rounding may then differ by an ulp:
# (sqrt 2 + 1) 2^-7 < 2^-5.7 of the largest value. Hence 2^-6 of the largest output.
ULP_BUDGET = 2.0 ** -6


def assert_rounding_close(got, want):
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(g, w, rtol=0, atol=ULP_BUDGET * np.abs(w).max())


def assert_unqueried_rows_kept(new_caches, old_caches, cols_BR):
    """Rows nobody queried keep the old cache bit for bit."""
    cols = np.asarray(cols_BR)
    T = np.asarray(old_caches[0]).shape[1]
    for new, old in zip(new_caches, old_caches):
        for b in range(cols.shape[0]):
            rest = np.setdiff1d(np.arange(T), cols[b])
            np.testing.assert_array_equal(np.asarray(new)[b, rest], np.asarray(old)[b, rest])


@pytest.mark.parametrize("case", MGPU_CASES)
def test_mgpu_kernel_matches_reference_interpret(case):
    """Pallas' Mosaic GPU interpreter (TMA, barriers and the warp-specialised pipeline
    simulated; clusters are not: `cluster_barrier` is unimplemented there, so cluster 1)."""
    B, R, D, T, H, G, K, config = MGPU_CASES[case]
    args = operands(B, R, D, T, H, G, K, dtype=jnp.bfloat16, seed=B)
    q_r, k_r, v_r = flash_cache_ref(*args, n_heads=H)
    q, k, v = flash_cache_mgpu(*args[:5], args[5] + 0, args[6] + 0, n_heads=H, config=config,
                               interpret=True)
    for got, want in ((q, q_r), (k, k_r), (v, v_r)):
        assert_rounding_close(got, want)
    assert_unqueried_rows_kept((k, v), args[5:], args[4])
    # the written value rows are the projection's bf16 rounding, not rotated: equal to the
    # reference's bit for bit except where the two sums round to neighbours (rare)
    cols = np.asarray(args[4])
    written = [(b, c) for b in range(B) for c in cols[b] if c < T]
    got_v = np.stack([np.asarray(v)[b, c] for b, c in written])
    want_v = np.stack([np.asarray(v_r)[b, c] for b, c in written])
    assert np.mean(got_v == want_v) > 0.99


def test_mgpu_refusals():
    bf = (jnp.bfloat16,) * 4
    assert fcm.refusal(bf, 128, 4096, 128, 96, 1) is None
    assert "bf16 or f16" in fcm.refusal((jnp.float32,) * 4, 128, 4096, 128, 96, 1)
    assert "one dtype" in fcm.refusal(bf[:3] + (jnp.float32,), 128, 4096, 128, 96, 1)
    assert "tp=2" in fcm.refusal(bf, 128, 4096, 128, 96, 2)
    assert "head dim" in fcm.refusal(bf, 128, 4096, 96, 96, 1)
    assert "head dim" in fcm.refusal(bf, 128, 4096, 256, 96, 1)
    assert "block_k" in fcm.refusal(bf, 128, 4000, 128, 96, 1)
    assert "cluster" in fcm.refusal(bf, 128, 4096, 128, 6, 1, MgpuConfig(cluster=4))
    assert "shared memory" in fcm.refusal(bf, 128, 4096, 128, 96, 1, MgpuConfig(stages=6))
    args = operands(1, 8, 64, 11, 2, 2, 64)  # fp32
    with pytest.raises(ValueError, match="bf16 or f16"):
        flash_cache_mgpu(*args, n_heads=2, interpret=True)


def test_mgpu_dispatch(monkeypatch):
    """The predicate of the dispatch: the Mosaic GPU kernel when `MGPU` is set, on Hopper,
    where it supports the shape and dtypes; otherwise (the default) the Triton kernel."""
    from kernels import fp8_matmul
    bf = (jnp.bfloat16,) * 4
    monkeypatch.setattr(fc.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(fc, "MGPU", True)
    monkeypatch.setattr(fp8_matmul, "compute_capability", lambda: (9, 0))
    assert fc.takes_mgpu(bf, 128, 4096, 128, 96, 1)
    assert not fc.takes_mgpu((jnp.float32,) * 4, 128, 4096, 128, 96, 1)
    assert not fc.takes_mgpu(bf, 128, 4096, 128, 96, 2)
    monkeypatch.setattr(fp8_matmul, "compute_capability", lambda: (8, 0))
    assert not fc.takes_mgpu(bf, 128, 4096, 128, 96, 1)
    monkeypatch.setattr(fp8_matmul, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(fc, "MGPU", False)
    assert not fc.takes_mgpu(bf, 128, 4096, 128, 96, 1)


@pytest.mark.parametrize("cluster", [1, 2, 4])
def test_mgpu_lowers_for_cuda(cluster):
    """The kernel through Pallas' Mosaic GPU lowering (layouts and transforms checked, no GPU
    needed) at LLaDA-8B's shapes, 32 rows (one warpgroup) and 128 (two), and at head dim 64."""
    sd = jax.ShapeDtypeStruct
    for R, K in ((32, 128), (128, 128), (128, 64)):
        a = (sd((1, R, 4096), jnp.bfloat16), sd((4096, 96 * K), jnp.bfloat16),
             sd((1, R, K // 2), jnp.float32), sd((1, R, K // 2), jnp.float32),
             sd((1, R), jnp.int32), sd((1, 768, 32, K), jnp.bfloat16),
             sd((1, 768, 32, K), jnp.bfloat16))
        fn = functools.partial(flash_cache_mgpu, n_heads=32, config=MgpuConfig(cluster=cluster))
        text = jax.jit(fn).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def skip_off_hopper():
    from kernels.fp8_matmul import compute_capability
    if compute_capability()[0] != 9:
        pytest.skip("the Mosaic GPU kernel is Hopper's")


@pytest.mark.gpu
@pytest.mark.parametrize("B,R,config", [
    (1, 128, MgpuConfig()), (1, 128, MgpuConfig(cluster=2)), (1, 128, MgpuConfig(cluster=4)),
    (1, 32, MgpuConfig()), (4, 128, MgpuConfig()), (3, 70, MgpuConfig(cluster=1, stages=2))])
def test_mgpu_kernel_on_gpu(B, R, config):
    """LLaDA-8B head shapes (H = G = 32, K = 128), a shortened d_model."""
    skip_off_hopper()
    args = operands(B, R, 1024, 600, 32, 32, 128, dtype=jnp.bfloat16, seed=B)
    ref = flash_cache_ref(*args, n_heads=32)
    out = flash_cache_mgpu(*args[:5], args[5] + 0, args[6] + 0, n_heads=32, config=config)
    for got, want in zip(out, ref):
        assert_rounding_close(got, want)
    assert_unqueried_rows_kept(out[1:], args[5:], args[4])


@pytest.mark.gpu
def test_mgpu_through_the_dispatch_on_gpu(monkeypatch):
    """With `MGPU` set, `flash_cache` runs the Mosaic GPU kernel on Hopper (traced once),
    with the reference's results."""
    skip_off_hopper()
    monkeypatch.setattr(fc, "MGPU", True)
    args = operands(2, 64, 1024, 600, 32, 32, 128, dtype=jnp.bfloat16, seed=7)
    ref = flash_cache_ref(*args, n_heads=32)
    calls = count_kernel_calls(monkeypatch, (fcm, "flash_cache_mgpu"))
    out = jax.jit(functools.partial(fc.flash_cache, n_heads=32))(*args)
    assert len(calls) == 1
    for got, want in zip(out, ref):
        assert_rounding_close(got, want)


@pytest.mark.parametrize("per_row", [False, True], ids=["one_start", "per_row_starts"])
def test_dual_step_through_the_kernel(models, per_row):
    """A dual-cache later step with the fused kernel doing the projection, RoPE and cache
    write (`cache.dual_update("fused")`, the Pallas kernel forced: interpret mode here)
    against XLA's path: the same block logits and the same cache, for ragged rows under CFG
    at one block start and at per-row starts (slot refill)."""
    params, _ = models
    P, G, BL = 8, 16, 8
    gen = lj.GenerationConfig(gen_length=G, block_length=BL, steps=G, cache="dual",
                              cfg_scale=1.5, mask_id=GEN_CFG.mask_id, eos_id=GEN_CFG.eos_id)
    pad_B = jnp.asarray([0, 3, 5])
    rng = np.random.default_rng(4)
    x_BT = rng.integers(2, 60, (3, P + G))
    x_BT[:, P:] = GEN_CFG.mask_id
    ctx = Ctx.build(params, GEN_CFG, gen, pad_B, P + G)
    keep_BT = ctx.canvas.valid_BT
    s = jnp.asarray([P, P + BL, P]) if per_row else P
    policy = cache.policy_for(gen)
    _, kv = policy.first(ctx, jnp.asarray(x_BT), keep_BT, s)
    x_BT[:, P + 1:P + G:3] = rng.integers(2, 60, (3, len(range(P + 1, P + G, 3))))  # revealed
    want, want_kv = policy.step(ctx, jnp.asarray(x_BT), keep_BT, s, kv, 1)
    with cache.dual_update("fused"), fc.implementation("pallas"):
        got, got_kv = policy.step(ctx, jnp.asarray(x_BT), keep_BT, s, kv, 1)
    # fp32: the kernel's chunked projection sums in another order than XLA's dot (~1e-6 at
    # these widths, as above); logits carry that through the layers at ~1e-5.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-4)
    for g, w in zip(got_kv.k + got_kv.v, want_kv.k + want_kv.v):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-4)


def test_dual_cache_through_the_kernel_in_slot_refill(models, monkeypatch):
    """End to end: slot refill (rows at different blocks at once) with the dual cache's
    updates through the fused kernel gives the tokens of XLA's path, and the kernel ran."""
    params, _ = models
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 60, n).tolist() for n in (5, 9, 3)]
    gen = lj.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual",
                              threshold=0.7)
    keys = jax.random.split(jax.random.key(5), len(prompts))
    want = lj.generate(params, GEN_CFG, prompts, gen, key=keys, slots=2)
    calls = count_kernel_calls(monkeypatch)
    jax.clear_caches()  # retrace: the forced choice is read while tracing
    with cache.dual_update("fused"), fc.implementation("pallas"):
        got = lj.generate(params, GEN_CFG, prompts, gen, key=keys, slots=2)
    assert len(calls) >= GEN_CFG.n_layers  # the kernel did the later steps' writes
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.nfe), np.asarray(want.nfe))


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 4])
def test_dual_step_through_the_kernel_on_gpu(B, monkeypatch):
    """A dual-cache later step at LLaDA-8B's head shapes (H = G = 32, K = 128; 2 layers, a
    shortened FFN and vocabulary) in bf16: the fused kernel (the dispatch picks it on the GPU
    up to FUSED_MAX_ROWS rows) against XLA's ops, cache and block logits."""
    cfg = tiny(d_model=4096, n_heads=32, n_kv_heads=32, d_ff=1024, vocab_size=1024,
               max_seq_len=1024, mask_id=1023, eos_id=1022, pad_id=1022)
    params = lj.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    P, G, BL = 96, 64, 32
    gen = lj.GenerationConfig(gen_length=G, block_length=BL, steps=G, cache="dual",
                              mask_id=cfg.mask_id, eos_id=cfg.eos_id)
    rng = np.random.default_rng(B)
    x_BT = rng.integers(2, 1000, (B, P + G))
    x_BT[:, P:] = cfg.mask_id
    ctx = Ctx.build(params, cfg, gen, jnp.arange(B) * 7, P + G)
    keep_BT = ctx.canvas.valid_BT
    policy = cache.policy_for(gen)
    _, kv = jax.jit(lambda x: policy.first(ctx, x, keep_BT, P))(jnp.asarray(x_BT))
    x_BT[:, P:P + BL:2] = rng.integers(2, 1000, (B, BL // 2))  # revealed
    assert fc.use_kernel(B * BL, 1)
    step = lambda x, c: policy.step(ctx, x, keep_BT, P, c, 1)  # noqa: E731
    want, want_kv = jax.jit(step)(jnp.asarray(x_BT), kv)
    calls = count_kernel_calls(monkeypatch)
    jax.clear_caches()  # the choice is read while tracing: the same lambda must retrace
    with cache.dual_update("fused"):
        got, got_kv = jax.jit(step)(jnp.asarray(x_BT), kv)
    assert len(calls) == cfg.n_layers  # the kernel did the writes
    for g, w in zip(got_kv.k + got_kv.v, want_kv.k + want_kv.v):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        # as test_kernel_on_gpu: an ulp (2^-8) of the projection's rounding, rotated into two
        np.testing.assert_allclose(g, w, rtol=0, atol=2 * 2.0 ** -8 * np.abs(w).max())
    # Those ulp-sized differences in layer 0's q/k/v move layer 1 and the logits by a few bf16
    # roundings (each 2^-8 relative): 2^-5 leaves an 8x margin.
    assert rel_err(jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)) <= 2.0 ** -5


def test_dual_update_fused_falls_back_to_xla_where_the_kernel_would_not_run(models,
                                                                              monkeypatch):
    """`dual_update("fused")` where the dispatch would not pick the kernel (here: no GPU)
    keeps XLA's dynamic-update-slice path: neither the kernel nor its reference's scatter
    (which under a mesh adds all-gathers of the new K/V) is traced."""
    params, _ = models
    calls = []
    monkeypatch.setattr(cache, "flash_cache", lambda *a, **k: calls.append(1))
    gen = lj.GenerationConfig(gen_length=16, block_length=8, steps=16, cache="dual")
    want = lj.generate(params, GEN_CFG, [[5, 6, 7]], gen)
    jax.clear_caches()
    with cache.dual_update("fused"):
        got = lj.generate(params, GEN_CFG, [[5, 6, 7]], gen)
    assert calls == []
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
