"""FACache's Mosaic GPU kernel (full / fill) in Pallas' Mosaic GPU interpreter on the CPU
against the reference and dense attention, its refusals, and its lowering for CUDA at LLaDA's
head shape (what the GPU compiler is handed; `pytest -m gpu` runs it: tests/test_gpu.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.cached_attention import MASKED, cached_attention_ref
from kernels.cached_attention_mgpu import cached_attention_mgpu, refusal
from tests.conftest import rel_err
from tests.test_cached_attention import dense_attention, inputs

# The interpreter runs warpgroups as threads over barriers: a protocol slip (or the hang noted
# at `_window`) stalls rather than fails. Each interpreted case takes 5-25 s here. The thread
# method: a hang blocks the main thread inside XLA, where a signal handler cannot run.
interpreted = pytest.mark.timeout(240, method="thread")

CASES = [  # B, L, H, G, K, pads, s, e, block_len, block_kv
    (1, 200, 2, 1, 64, [7], 70, 102, 32, 64),     # unaligned window; MQA; L not a tile multiple
    (2, 128, 1, 1, 64, [0, 40], 96, 128, 32, 128),  # window pulled back to fit; padded row
    (1, 130, 2, 1, 64, [0], 98, 130, None, 64),   # block at the end; no bound: whole window
    (1, 64, 4, 2, 64, [0], 0, 64, 64, 64),        # the block is every key: phase A sees none; GQA
]


@interpreted
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[1]}-s{c[6]}-e{c[7]}-kv{c[9]}")
def test_interpreted_fill_and_full(case):
    B, L, H, G, K, pads, s, e, block_len, block_kv = case
    q, k, v, key_mask = inputs(0, B, L, H, G, K, pads, jnp.bfloat16)
    kw = dict(block_len=block_len, block_kv=block_kv, interpret=True)
    o, state = cached_attention_mgpu(q, k, v, key_mask, s, e, mode="fill", **kw)
    # The interpreter fills memory nobody wrote with NaN: every output must be written.
    assert all(bool(jnp.isfinite(x).all()) for x in (o, state.acc, state.l, state.m))
    # bf16 inputs are exact in the fp32 dense attention; the kernel rounds the probabilities
    # to bf16 before P@V and the output to bf16 (2^-9 each): ~4e-3 relative, bound 1e-2
    # (the Triton kernel's budget, tests/test_cached_attention.py::test_bf16).
    assert rel_err(o.astype(jnp.float32), dense_attention(q, k, v, key_mask)) <= 1e-2
    _, ref = cached_attention_ref(q, k, v, key_mask, s, e, mode="fill")
    if s == 0 and e >= L:  # nothing outside the block: the reference's empty state exactly
        assert bool((ref.m == MASKED).all() & (ref.l == 0).all())
        for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        # acc carries the same bf16 probabilities (1e-2 as above); l sums the fp32 ones, m
        # is a max of fp32 scores: fp32 summation order only (~2^-24 per add over K, keys).
        assert rel_err(state.acc, ref.acc) <= 1e-2
        assert rel_err(state.l, ref.l) <= 1e-5
        np.testing.assert_allclose(state.m, ref.m, rtol=1e-5, atol=1e-5)
    if case is CASES[0]:  # `full` is fill without the state's store: the same loop, bits
        full = cached_attention_mgpu(q, k, v, key_mask, s, e, mode="full", **kw)
        np.testing.assert_array_equal(np.asarray(full), np.asarray(o))


@interpreted
def test_interpreted_per_row_bounds(monkeypatch):
    """Slot refill's per-row bounds [B] in one launch: each row as the reference with its own.
    Head dim 128: the state's second 64-column chunk, stored after phase B. The
    interpreter's race detection on (vector clocks over shared and global accesses): none
    may be reported."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    from kernels import hopper
    monkeypatch.setattr(hopper, "interpret_params", lambda: InterpretGPUParams(detect_races=True))
    q, k, v, key_mask = inputs(1, 2, 128, 1, 1, 128, [0, 30], jnp.bfloat16)
    s, e = jnp.array([96, 40]), jnp.array([128, 72])
    o, state = cached_attention_mgpu(q, k, v, key_mask, s, e, mode="fill", block_len=32,
                                     block_kv=64, interpret=True)
    jax.block_until_ready(o)
    assert gpu_callbacks.get_races().races_found is False
    for b in range(2):
        row = lambda x: x[b:b + 1]
        o_ref, ref = cached_attention_ref(row(q), row(k), row(v), row(key_mask), int(s[b]),
                                          int(e[b]), mode="fill")
        # the budgets of test_interpreted_fill_and_full
        assert rel_err(row(o).astype(jnp.float32), o_ref.astype(jnp.float32)) <= 1e-2
        assert rel_err(row(state.acc), ref.acc) <= 1e-2
        assert rel_err(row(state.l), ref.l) <= 1e-5
        np.testing.assert_allclose(row(state.m), ref.m, rtol=1e-5, atol=1e-5)


def test_refusals():
    q, k, v, key_mask = inputs(0, 1, 64, 2, 2, 64, [0], jnp.bfloat16)
    f = functools.partial(cached_attention_mgpu, interpret=True)
    _, state = cached_attention_ref(q, k, v, key_mask, 0, 8, mode="fill")
    with pytest.raises(ValueError, match="'reuse' mode is the Triton kernel's"):
        f(q, k, v, key_mask, 0, 8, state, mode="reuse")
    with pytest.raises(ValueError, match="bf16 or f16 only"):
        f(*(x.astype(jnp.float32) for x in (q, k, v)), key_mask, 0, 8)
    q32, k32, v32, _ = inputs(0, 1, 64, 2, 2, 32, [0], jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64 up to 256"):
        f(q32, k32, v32, key_mask, 0, 8)
    q, k, v, key_mask = inputs(0, 1, 1024, 1, 1, 128, [0], jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):  # 4 stages of 256-key K/V tiles
        f(q, k, v, key_mask, 0, 8, block_kv=256, stages=4)
    with pytest.raises(ValueError, match="block_len must be at least 1"):
        f(q, k, v, key_mask, 0, 8, block_len=0)
    # The dispatch's question (`takes_row_bounds`), at the kernel's defaults: LLaDA's head dim
    # in both modes; 192 not (2 stages of 128 x 192 K/V tiles overflow shared memory: the
    # Triton kernel takes it); never fp32 or reuse.
    assert refusal(jnp.bfloat16, 128, "fill") is None and refusal(jnp.float16, 64, "full") is None
    assert "shared memory" in refusal(jnp.bfloat16, 192, "full")
    assert refusal(jnp.float32, 128, "full") and refusal(jnp.bfloat16, 128, "reuse")


@pytest.mark.parametrize("mode", ["fill", "full"])
def test_lowers_for_cuda_at_llada_shape(mode):
    """The Mosaic GPU lowering (layouts, transforms, barriers) of LLaDA's layer-0 shape, on
    the CPU: what ptxas then gets on the GPU."""
    q = jax.ShapeDtypeStruct((1, 1024, 32, 128), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((1, 1024), jnp.bool_)
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    fn = functools.partial(cached_attention_mgpu, mode=mode, block_len=32)
    text = jax.jit(fn).trace(q, q, q, mask, i32, i32).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1
