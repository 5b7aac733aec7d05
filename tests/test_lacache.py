"""cache="exact" (LaCache): identical tokens to cache="none", and layer 0's cached path equal
to recomputing it, to fp32 rounding."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lacache_jax as lj
from lacache_jax import sampling, sar
from lacache_jax.compact import CompactPlan
from kernels import cached_attention as ca
from lacache_jax.model import block, finish_block, qkv, rms_norm, rope_tables
from tests.conftest import GEN_CFG as CFG
from tests.conftest import record_forward_widths, rel_err
from tests.test_generate import RAGGED, _gen
EXACT_CASES = {
    "fixed": dict(steps=12),
    "threshold": dict(threshold=0.9),
    "factor_cfg": dict(factor=1.0, cfg_scale=1.0),
    "dpad": dict(steps=12, dpad=lj.DPadConfig(window=10)),
    "dpad_uniform_threshold": dict(threshold=0.9, dpad=lj.DPadConfig(strategy="uniform",
                                                                     window=10, keep=4)),
    "block_4": dict(block_length=4, steps=12),
    "block_12_threshold": dict(block_length=12, threshold=0.7),
    "one_row": dict(steps=12, rows=1),
}


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_exact_equals_none(models, case):
    """Prompt lengths 5 / 9 / 13 in one ragged batch (or the first alone), blocks of 4, 8, 12."""
    params, _ = models
    kw = dict(EXACT_CASES[case])
    prompts = RAGGED[:kw.pop("rows", len(RAGGED))]
    keys = jax.random.split(jax.random.key(5), len(prompts))
    none = lj.generate(params, CFG, prompts, _gen(**kw), key=keys)
    exact = lj.generate(params, CFG, prompts, _gen(cache="exact", **kw), key=keys)
    np.testing.assert_array_equal(np.asarray(exact.tokens), np.asarray(none.tokens))
    np.testing.assert_array_equal(np.asarray(exact.nfe), np.asarray(none.nfe))


def test_exact_equals_none_when_a_row_stops_early(models):
    """EOS taken from a token row 0 first emits in its second block: that row stops two blocks
    early (fewer passes), the others run on; exact must follow none through all of it."""
    params, _ = models
    keys = jax.random.split(jax.random.key(5), len(RAGGED))
    full = np.asarray(lj.generate(params, CFG, RAGGED, _gen(), key=keys).tokens)
    P, BL = max(map(len, RAGGED)), _gen().block_length
    first, second = full[0, P:P + BL].tolist(), full[0, P + BL:P + 2 * BL].tolist()
    eos = next(t for t in second if t not in first)
    gen = dict(stop_at_eos=True, eos_id=eos)
    none = lj.generate(params, CFG, RAGGED, _gen(**gen), key=keys)
    exact = lj.generate(params, CFG, RAGGED, _gen(cache="exact", **gen), key=keys)
    assert int(none.nfe[0]) == 2 * BL < int(none.nfe.max())  # row 0 stopped after block 2
    np.testing.assert_array_equal(np.asarray(exact.tokens), np.asarray(none.tokens))
    np.testing.assert_array_equal(np.asarray(exact.nfe), np.asarray(none.nfe))


def test_exact_runs_the_facache_kernel_in_fill_and_reuse(models, monkeypatch):
    """Guards against a silently disabled cache ("exact" run as "none" is lossless too): the
    FACache attention must be traced in fill mode (a block's first step) and reuse mode."""
    params, _ = models
    modes = []
    real = ca.cached_attention_ref

    def counted(*args, mode, **kw):
        modes.append(mode)
        return real(*args, mode=mode, **kw)
    monkeypatch.setattr(ca, "cached_attention_ref", counted)  # what the CPU dispatch runs
    jax.clear_caches()
    try:
        lj.generate(params, CFG, RAGGED, _gen(cache="exact", threshold=0.9))
        assert sorted(set(modes)) == ["fill", "reuse"]
        modes.clear()
        lj.generate(params, CFG, RAGGED, _gen(cache="none", threshold=0.9))
        assert modes == []
    finally:
        jax.clear_caches()


@pytest.mark.parametrize("dpad", [lj.DPadConfig(window=10),
                                  lj.DPadConfig(strategy="uniform", window=10, keep=4)],
                         ids=["gaussian", "uniform"])
def test_exact_with_dpad_runs_on_the_compact_canvas(models, monkeypatch, dpad):
    """With DPad the FACache attention of every block's first and later forwards sees that
    block's compact width (guards the compact path against silently falling back to the
    masked whole canvas, which gives the same tokens, or a later step taking another block's
    view)."""
    params, _ = models
    fill, reuse = [], {}
    real = ca.cached_attention_ref

    def recorded(q, k, v, key_mask, s, *args, mode, **kw):
        if mode == "fill":
            fill.append(q.shape[1])
        else:  # a later step's program has its block start as a Python int
            reuse.setdefault(s, []).append(q.shape[1])
        return real(q, k, v, key_mask, s, *args, mode=mode, **kw)
    monkeypatch.setattr(ca, "cached_attention_ref", recorded)
    gen = _gen(cache="exact", steps=12, dpad=dpad)
    plan = CompactPlan.build(gen.resolve(CFG), max(map(len, RAGGED)))
    jax.clear_caches()
    try:
        lj.generate(params, CFG, RAGGED, gen)
    finally:
        jax.clear_caches()
    # Traced once per block: the first forward's switch traces every block's branch, each
    # block's later-step program its own view, and where a gaussian draw can spill over the
    # block's slots also the fallback (the last block's view, the whole canvas).
    blocks = range(len(plan.kept))
    assert min(map(plan.width, blocks)) < plan.T
    assert any(plan.spills) == (dpad.strategy == "gaussian")
    assert sorted(fill) == sorted(map(plan.width, blocks))
    assert {s: sorted(w) for s, w in reuse.items()} == {
        plan.P + k * plan.block_len: sorted([plan.width(k)] + [plan.T] * plan.spills[k])
        for k in blocks}


def test_exact_follows_none_block_by_block_when_some_blocks_overflow(models, monkeypatch):
    """A slot bound that the gaussian draws of blocks 0-2 exceed and those of blocks 3-4 do not
    (DPAD_TAIL 0.3, blocks of 4, with these keys): exact's first and later forwards must run
    the canvas none's run, forward by forward (the masked whole canvas, or the block's compact
    one), with none's tokens."""
    params, _ = models
    monkeypatch.setattr(sampling, "DPAD_TAIL", 0.3)
    _, widths = record_forward_widths(monkeypatch)
    gen = dict(block_length=4, steps=24, dpad=lj.DPadConfig(window=10))
    keys = jax.random.split(jax.random.key(5), len(RAGGED))
    jax.clear_caches()
    try:
        none = lj.generate(params, CFG, RAGGED, _gen(**gen), key=keys)
        ran_none = list(widths)
        widths.clear()
        exact = lj.generate(params, CFG, RAGGED, _gen(cache="exact", **gen), key=keys)
    finally:
        jax.clear_caches()
    # One run_blocks call a forward in both (exact's: layers >= 1), four forwards a block.
    T = max(map(len, RAGGED)) + _gen().gen_length
    assert len(ran_none) == 24 and widths == ran_none
    assert ran_none[:12] == [T] * 12 and max(ran_none[12:20]) < T  # 0-2 overflow, 3-4 not
    np.testing.assert_array_equal(np.asarray(exact.tokens), np.asarray(none.tokens))
    np.testing.assert_array_equal(np.asarray(exact.nfe), np.asarray(none.nfe))


def test_exact_with_the_pallas_kernel(models, monkeypatch):
    """The same through the Pallas kernel itself (interpret mode), tiles smaller than the
    canvas so that fill/reuse tile logic, padding and GQA all take part."""
    params, _ = models
    kernel = functools.partial(ca.cached_attention_pallas, block_q=8, block_k=8, interpret=True)
    monkeypatch.setattr(sys.modules["lacache_jax.cache"], "cached_attention", kernel)
    jax.clear_caches()  # programs traced with the reference must not be reused
    gen = dict(threshold=0.9)
    try:
        exact = lj.generate(params, CFG, RAGGED, _gen(cache="exact", **gen))
    finally:
        jax.clear_caches()
    none = lj.generate(params, CFG, RAGGED, _gen(**gen))
    np.testing.assert_array_equal(np.asarray(exact.tokens), np.asarray(none.tokens))


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_layer0_cached_path_equals_recompute(models, impl):
    """Fill at a block's first step, change the block's tokens, take layer 0 through the
    cached path (block rows recomputed, FACache reuse): equal to layer 0 on the new canvas."""
    params, _ = models
    attention = (ca.cached_attention_ref if impl == "reference" else functools.partial(
        ca.cached_attention_pallas, block_q=16, block_k=16, interpret=True))
    rng = np.random.default_rng(0)
    B, T, s, e = 2, 40, 17, 25
    old = rng.integers(0, CFG.mask_id, (B, T))
    new = old.copy()
    new[:, s:e] = rng.integers(0, CFG.mask_id, (B, e - s))
    keep = np.ones((B, T), bool)
    keep[1, :3] = False
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    cos, sin = rope_tables(pos, CFG.head_dim, CFG.rope_theta)
    layer = params.layers[0]

    def layer0_inputs(tokens, cos, sin):
        emb = params.embed[tokens]
        return (emb, *qkv(rms_norm(emb, layer.attn_norm, CFG.norm_eps), layer, CFG, cos, sin))

    emb, q, k, v = layer0_inputs(jnp.asarray(old), cos, sin)
    _, state = attention(q, k, v, keep, s, e, mode="fill")
    fresh = layer0_inputs(jnp.asarray(new[:, s:e]), cos[:, s:e], sin[:, s:e])
    emb, q, k, v = (c.at[:, s:e].set(f) for c, f in zip((emb, q, k, v), fresh))
    cached = finish_block(emb, attention(q, k, v, keep, s, e, state, mode="reuse"), layer, CFG)
    recomputed, _, _ = block(params.embed[jnp.asarray(new)], layer, CFG, cos, sin, keep)
    # fp32 everywhere; only the attention's order of summation differs (U keys then C keys).
    assert rel_err(cached, recomputed) <= 1e-6


DPAD_CASES = {"whole_canvas": None,
              "dpad_compact": lj.DPadConfig(strategy="uniform", window=10, keep=4),
              "dpad_gaussian": lj.DPadConfig(window=10)}  # run_at's overflow cond traced


@pytest.mark.parametrize("dpad", list(DPAD_CASES.values()), ids=list(DPAD_CASES))
def test_exact_step_logits_equal_a_full_forward(models, dpad):
    """The policy's later-step logits (layer 0 from the cache, FACache reuse) against the public
    full forward of the changed canvas, on a ragged batch at the second block. Token equality
    alone missed a 1% error in the cached normaliser in 7 of 8 cases; logits do not. With
    DPad the policy runs the block's compact canvas, the reference the whole canvas with the
    dropped columns masked."""
    # fp32 throughout; only layer 0's attention sums U keys then C keys instead of in column
    # order (~1e-7 relative per score), which the deeper layers carry to ~1e-6 at most.
    assert exact_step_error(models[0], dpad) <= 2e-6


def exact_step_error(params, dpad) -> float:
    """rel_err of exact's later-step logits (a step revealing 5 tokens of the second block)
    against `lj.forward` of the changed canvas, dropped columns masked (tests/test_gpu.py runs
    it on the GPU kernels)."""
    gen = _gen(cache="exact", dpad=dpad).resolve(CFG)
    P, BL = max(map(len, RAGGED)), gen.block_length
    T = P + gen.gen_length
    rng = np.random.default_rng(1)
    pad = np.array([P - len(r) for r in RAGGED], np.int32)
    x = np.full((len(RAGGED), T), CFG.mask_id, np.int32)
    for b, r in enumerate(RAGGED):
        x[b, :pad[b]], x[b, pad[b]:P] = CFG.pad_id, r
    x[:, P:P + BL] = rng.integers(0, 300, (len(RAGGED), BL))  # the first block, decoded
    s = P + BL
    new = x.copy()
    new[:, s:s + 5] = rng.integers(0, 300, (len(RAGGED), 5))  # a step reveals 5 tokens
    loop = sar.make_loop(params, CFG, gen, jnp.asarray(pad), T)
    keep = loop.canvas.valid_BT
    if dpad is not None:
        keys = jax.random.split(jax.random.key(2), len(RAGGED))
        keep &= sampling.dpad_keep(dpad, sampling.dpad_block_keys(keys, 1), s + BL, T)
        assert loop.ctx.compact is not None and not bool(keep[:, s + BL:].all())

    @jax.jit
    def first_then_step(x_old, x_new):
        _, cache = loop.policy.first(loop.ctx, x_old, keep, s)
        return loop.policy.step(loop.ctx, x_new, keep, s, cache, 1)[0]
    cached = first_then_step(jnp.asarray(x), jnp.asarray(new))
    pos = np.maximum(np.arange(T)[None, :] - pad[:, None], 0)
    full = lj.forward(params, CFG, new, attention_mask=np.asarray(keep), positions=pos)
    return rel_err(cached, full[:, s:s + BL])
