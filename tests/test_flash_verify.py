"""Flash-Verify (lacache_jax/flash.py, FlashConfig(verify=True)) against the eager PyTorch
reference (tests/reference_flash.py, verify=True), fp32, temperature 0: the two-view mask
equals the reference's `verify_mask`; tokens, NFE and steps identical for both acceptance rules
and several gamma, ragged batches row by row with EOS stops; gamma > 1 reproduces part 1
without verify when every decoded position is tracked; bad settings refused."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import lacache_jax as lj
from convert.__main__ import main as convert_main
from lacache_jax import flash
from lacache_jax.cache import Ctx
from lacache_jax.config import tiny
from lacache_jax.generate import _prepare, left_padding
from tests.conftest import hf_llama, random_llada_state, write_hf_llada
from tests.reference_flash import verify_mask
from tests.test_flash import _reference  # same model (CFG), same G

# The flash tests' model: 4 layers, so importance (layers 2..L-1) decides what is tracked.
CFG = tiny(n_heads=4, n_kv_heads=2, n_layers=4)
PROMPT = [5, 17, 99, 3, 250, 42, 7, 64, 128, 11]
G = 24


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """Our fp32 params (convert + load) and the transformers reference, same weights; seed 7 /
    head_std 2 make peaked outputs (thresholds fire), as tests/test_flash.py."""
    tmp = tmp_path_factory.mktemp("flash_verify")
    state = random_llada_state(CFG, seed=7, head_std=2.0)
    write_hf_llada(tmp / "hf", CFG, state)
    assert convert_main([str(tmp / "hf"), str(tmp / "ck"), "--dtype", "float32", "--quiet"]) == 0
    return lj.load(tmp / "ck")[1], hf_llama(CFG, state, torch.float32)


def _gen(stop_at_eos=False, eos_id=None, **flash_kw):
    return lj.GenerationConfig(gen_length=G, threshold=0.9, stop_at_eos=stop_at_eos,
                               eos_id=eos_id, flash=lj.FlashConfig(**flash_kw))




@pytest.mark.parametrize("ncand,ntrk,R", [(0, 8, 8), (1, 6, 8), (3, 2, 8), (4, 0, 8),
                                          (4, 8, 16), (2, 3, 8)])
def test_mask_equals_reference_verify_mask(ncand, ntrk, R):
    """The slot layout [ntrk tracked | unused | ncand drafts | ncand masks] of R rows,
    restricted to its used slots, is the reference's `verify_mask(S=ncand, T=ntrk)`; no row
    sees an unused slot."""
    kind, idx = flash.verify_slots(jnp.array([ncand]), jnp.array([ntrk]), R)
    m = np.asarray(flash.verify_mask(kind, idx))[0]
    used = np.asarray(kind[0]) != flash.V_UNUSED
    assert used.sum() == ntrk + 2 * ncand
    np.testing.assert_array_equal(m[np.ix_(used, used)], verify_mask(ncand, ntrk))
    assert not m[np.ix_(used, ~used)].any()


RAGGED = [list(range(20, 29)), [7, 8, 9, 10, 11], [3]]  # left padding 0, 4, 8


def _check_rows(params, model, prompts, gen):
    """Each row of one batched generation equals the reference run of its prompt alone;
    returns (output, the reference records)."""
    out = lj.generate(params, CFG, prompts, gen)
    P = max(map(len, prompts))
    records = []
    for b, prompt in enumerate(prompts):
        records.append([])
        ref, nfe, steps = _reference(model, prompt, gen, records[-1])
        np.testing.assert_array_equal(np.asarray(out.tokens[b, P - len(prompt):]), ref)
        assert (int(out.nfe[b]), int(out.steps[b])) == (nfe, steps)
        assert nfe == 2 * steps  # both passes count, also at steps with no candidate
    return out, records


def _verified(records):
    return [len(r["verify_accepted"]) for rec in records for r in rec]


# window 8: S reaches window // 2 = 4. track 3 < the decoded count, so the tracked sets of
# both passes come out of the importance ranking. The gammas let some candidates pass and
# reject others (the reference's mask-view probabilities on these rows span 0.01-0.98).
PARITY = [("cumprod", 0.5), ("cumprod", 0.85), ("agree", 0.3)]  # and agree 0.7: EOS test


@pytest.mark.parametrize("accept,gamma", PARITY)
def test_ragged_batch_matches_reference_row_by_row(deep, accept, gamma):
    params, model = deep
    gen = _gen(window=8, lookahead=4, track=3, verify=True, accept=accept, gamma=gamma)
    out, records = _check_rows(params, model, RAGGED, gen)
    n = _verified(records)
    assert sum(n) > 0 and n.count(0) > len(RAGGED)  # some steps accept, others reject all
    assert (np.asarray(out.revealed) == G).all()


def test_canvas_shorter_than_the_verify_slots(deep):
    """A canvas of fewer columns than the verify pass's 2 x window query slots (prompt 3 + 24
    < 32): once failed on broadcasting the tracked columns; the reference's tokens, NFE and
    steps."""
    params, model = deep
    prompt = PROMPT[:3]
    gen = _gen(window=16, lookahead=4, track=3, verify=True, gamma=0.5)
    out = lj.generate(params, CFG, [prompt], gen)
    ref, nfe, steps = _reference(model, prompt, gen)
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), ref)
    assert (int(out.nfe[0]), int(out.steps[0])) == (nfe, steps)


def test_eos_accepted_by_the_verify_pass_stops_the_row(deep):
    """EOS := the first token the verify pass accepts in a free run of row 0, so row 0 sets its
    predicted length in the verify pass; the rows stop at different steps."""
    params, model = deep
    kw = dict(window=8, lookahead=4, track=3, verify=True, accept="agree", gamma=0.7)
    free = []
    _reference(model, RAGGED[0], _gen(**kw), free)
    first = next(r for r in free if r["verify_accepted"])
    eos = int(first["draft"][first["window"].index(first["verify_accepted"][0])])
    assert eos != CFG.mask_id
    out, records = _check_rows(params, model, RAGGED, _gen(stop_at_eos=True, eos_id=eos, **kw))
    assert int(out.revealed[0]) < G and len(set(np.asarray(out.steps).tolist())) > 1
    assert int(out.steps[0]) < len(free)


def test_gamma_above_one_reproduces_verify_off(deep):
    """Nothing passes verification (p <= 1 < gamma), so each step's draft pass is part 1's step
    and the tokens equal those without verify, at twice the forwards. This holds only when
    every decoded position is tracked: track=None (a full recompute, where it is trivial) or
    track >= P + G, run here (64 >= 9 + 24: the cache is read, the look-ahead bounded). The
    released code ranks the verify pass's accepted tokens last (none here), so this step's
    draft-accepted tokens compete on importance for the next step's tracked set instead of
    being kept, and with a small track the two runs refresh different cache rows
    (tests/reference_flash.py's docstring)."""
    params, model = deep
    kw = dict(window=8, lookahead=4, track=64)
    plain = lj.generate(params, CFG, RAGGED, _gen(**kw))
    verified = lj.generate(params, CFG, RAGGED, _gen(verify=True, gamma=1.5, **kw))
    np.testing.assert_array_equal(np.asarray(verified.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(verified.steps), np.asarray(plain.steps))
    np.testing.assert_array_equal(np.asarray(verified.nfe), 2 * np.asarray(plain.nfe))
    assert (np.asarray(plain.steps) < G).all()  # thresholds fired: candidates were left over


@functools.partial(jax.jit, static_argnames=("gen", "prefill"))
def _one_step(params, gen, st, pad_B, keys_B, prefill):
    ctx = Ctx.build(params, CFG, gen, pad_B, st.x_BT.shape[1])
    budget = flash.Budget.build(gen.flash, gen.gen_length, st.x_BT.shape[1])
    return flash.step(ctx, gen, budget, st, keys_B, prefill)


def test_verify_pass_writes_nothing_to_the_cache(deep):
    """From the same state, a step with verify leaves the cache exactly as the step without it
    (the main pass's writes only), while its verify pass did accept tokens."""
    params, _ = deep
    gen = _gen(window=8, lookahead=4, track=3, verify=True, accept="cumprod", gamma=0.5)
    params, gen, _, x, pad, keys = _prepare(params, CFG, [RAGGED[0]], gen, None, None)
    pad = left_padding(pad, x.shape[0])
    plain = dataclasses.replace(gen, flash=dataclasses.replace(gen.flash, verify=False))
    st = flash.init_state(Ctx.build(params, CFG, gen, pad, x.shape[1]), x, True)
    st = _one_step(params, plain, st, pad, keys, True)  # the free run verifies from step 2 on
    a, b = (_one_step(params, g, st, pad, keys, False) for g in (plain, gen))
    for ca, cb in zip(a.cache.k + a.cache.v, b.cache.k + b.cache.v):
        np.testing.assert_array_equal(np.asarray(ca), np.asarray(cb))
    assert int(b.revealed_B[0]) > int(a.revealed_B[0])  # the verify pass did accept
    assert (int(a.nfe_B[0]), int(b.nfe_B[0])) == (2, 3)


BAD_FLASH = [(dict(gamma=0.0), "flash.gamma"), (dict(gamma=True), "flash.gamma"),
             (dict(gamma="0.8"), "flash.gamma"), (dict(accept="greedy"), "flash.accept"),
             (dict(window=1), "flash.window")]


@pytest.mark.parametrize("kw,name", BAD_FLASH)
def test_bad_verify_settings_are_refused(kw, name):
    with pytest.raises(ValueError, match=name):
        lj.FlashConfig(verify=True, **kw)


def test_verify_is_accepted_by_generation_config():
    f = lj.FlashConfig(verify=True, gamma=0.9, accept="agree")
    assert lj.GenerationConfig(gen_length=G, threshold=0.9, flash=f).flash.verify
