"""Flash-dLLM decoding (lacache_jax/flash.py) against the eager PyTorch reference
(tests/reference_flash.py), fp32, temperature 0: tokens, NFE and steps identical for several
window / look-ahead / track settings including the full recompute; per step, the same window,
look-ahead, tracked set (chosen by importance) and accepted order; ragged batches row by row
with EOS stops; bad settings refused."""

from __future__ import annotations

import functools

import jax
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
from tests.reference_flash import reference_flash_generate

# Importance sums layers 2..L-1: with 4 layers it is not zero and the tracked set depends on it.
CFG = tiny(n_heads=4, n_kv_heads=2, n_layers=4)
PROMPT = [5, 17, 99, 3, 250, 42, 7, 64, 128, 11]
G = 24


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """Our fp32 params (convert + load) and the transformers reference, same weights; seed 7 /
    head_std 2 make peaked outputs (thresholds fire), as the `models` fixture."""
    tmp = tmp_path_factory.mktemp("flash")
    state = random_llada_state(CFG, seed=7, head_std=2.0)
    write_hf_llada(tmp / "hf", CFG, state)
    assert convert_main([str(tmp / "hf"), str(tmp / "ck"), "--dtype", "float32", "--quiet"]) == 0
    return lj.load(tmp / "ck")[1], hf_llama(CFG, state, torch.float32)


def _gen(threshold=0.9, stop_at_eos=False, eos_id=None, **flash_kw):
    return lj.GenerationConfig(gen_length=G, threshold=threshold, stop_at_eos=stop_at_eos,
                               eos_id=eos_id, flash=lj.FlashConfig(**flash_kw))


def _reference(model, prompt, gen, record=None):
    f = gen.flash
    return reference_flash_generate(
        model, prompt, gen_length=gen.gen_length, window=f.window, lookahead=f.lookahead,
        track=f.track, threshold=gen.threshold, mask_id=CFG.mask_id,
        eos_id=CFG.eos_id if gen.eos_id is None else gen.eos_id, stop_at_eos=gen.stop_at_eos,
        verify=f.verify, gamma=f.gamma, accept=f.accept, record=record)


PARITY = {
    "lookahead_none": dict(window=4, lookahead=None, track=3),
    "full_recompute": dict(window=4, lookahead=2, track=None),  # track=None: look-ahead ignored
    "no_lookahead_no_track": dict(window=3, lookahead=0, track=0),  # staler cache than any
}


@pytest.mark.parametrize("case", list(PARITY))
def test_tokens_nfe_steps_match_reference(deep, case):
    params, model = deep
    gen = _gen(**PARITY[case])
    out = lj.generate(params, CFG, [PROMPT], gen)
    ref, nfe, steps = _reference(model, PROMPT, gen)
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), ref)
    assert (int(out.nfe[0]), int(out.steps[0])) == (nfe, steps)
    assert int(out.revealed[0]) == G and steps < G  # thresholds fired: several per step


@functools.partial(jax.jit, static_argnames=("cfg", "gen", "prefill"))
def _one_step(params, cfg, gen, st, pad_B, keys_B, prefill):
    ctx = Ctx.build(params, cfg, gen, pad_B, st.x_BT.shape[1])
    budget = flash.Budget.build(gen.flash, gen.gen_length, st.x_BT.shape[1])
    return flash.step(ctx, gen, budget, st, keys_B, prefill)


def test_each_step_queries_and_tracks_what_the_reference_does(deep):
    """Steps the decoder's own `flash.step` from the host: per step the window, look-ahead and
    tracked positions it queries, the importance it computes, the accepted positions in
    confidence order and the set it tracks next equal the reference's record."""
    params, model = deep
    gen = _gen(window=4, lookahead=2, track=2)  # a small budget: importance decides
    params, gen_r, _, x, pad, keys = _prepare(params, CFG, [PROMPT], gen, None, None)
    pad = left_padding(pad, x.shape[0])
    ctx = Ctx.build(params, CFG, gen_r, pad, x.shape[1])
    budget = flash.Budget.build(gen_r.flash, G, x.shape[1])
    st = flash.init_state(ctx, x, True)
    record = []
    ref, nfe, steps = _reference(model, PROMPT, gen, record)
    picked_old = False
    for n, rec in enumerate(record):
        cols, kind = jax.jit(flash.select_queries, static_argnums=(2, 3, 4))(
            st, ctx.canvas.valid_BT, budget, x.shape[1] if n == 0 else budget.rows(x.shape[1]),
            n == 0)
        cols, kind = np.asarray(cols[0]), np.asarray(kind[0])
        assert set(cols[kind == flash.WINDOW]) == set(rec["window"])
        if n:
            assert set(cols[kind == flash.OTHER]) == set(rec["lookahead"]) | set(rec["tracked"])
        st = _one_step(params, CFG, gen_r, st, pad, keys, n == 0)
        # fp32 raw scores q.k of magnitude ~1-10, summed over K = 16 terms, two layers: the
        # reference's fp32 products differ by summation order only (~1e-6 relative).
        np.testing.assert_allclose(np.asarray(st.importance_BT[0]), rec["importance"],
                                   rtol=1e-4, atol=1e-4)
        acc = np.flatnonzero(np.asarray(st.accepted_BT[0]))
        assert acc[np.argsort(np.asarray(st.rank_BT[0])[acc])].tolist() == rec["accepted"]
        if rec["next_tracked"] is not None:
            rank, dec = np.asarray(st.rank_BT[0]), np.asarray(st.decoded_BT[0])
            tracked = set(np.flatnonzero(dec & (rank >= dec.sum() - budget.Tr)))
            assert tracked == set(rec["next_tracked"])
            picked_old |= bool(tracked - set(rec["accepted"]))
    assert bool(st.done_B[0]) and len(record) == steps == int(st.steps_B[0])
    np.testing.assert_array_equal(np.asarray(st.x_BT[0]), ref)
    assert picked_old  # importance chose a position beyond the newest ones


RAGGED = [[7, 8, 9, 10, 11], list(range(20, 29)), PROMPT, [3]]


def test_ragged_batch_with_eos_equals_reference_row_by_row(deep):
    """Rows of different lengths (left padding 0..9) stop at an EOS at different steps; each
    row equals the reference run of that prompt alone."""
    params, model = deep
    flash_kw = dict(window=4, lookahead=3, track=5)
    # EOS := a token row 0 accepts midway in a free run, so row 0 stops early.
    free = []
    _reference(model, RAGGED[0], _gen(**flash_kw), free)
    mid = free[len(free) // 2]
    eos = int(mid["draft"][mid["window"].index(mid["accepted"][0])])
    gen = _gen(stop_at_eos=True, eos_id=eos, **flash_kw)
    out = lj.generate(params, CFG, RAGGED, gen)
    P = max(map(len, RAGGED))
    stopped = []
    for b, prompt in enumerate(RAGGED):
        ref, nfe, steps = _reference(model, prompt, gen)
        np.testing.assert_array_equal(np.asarray(out.tokens[b, P - len(prompt):]), ref)
        assert (int(out.nfe[b]), int(out.steps[b])) == (nfe, steps)
        stopped.append(int(out.revealed[b]) < G)
    assert stopped[0] and not all(stopped)  # an EOS stop, and a row that ran to the end
    assert int(out.steps[0]) < len(free)


BAD_GEN = {
    "block_length": dict(block_length=8), "steps": dict(steps=12), "factor": dict(factor=1.0),
    "cache": dict(cache="dual"), "refresh_interval": dict(refresh_interval=2),
    "dpad": dict(dpad=lj.DPadConfig()), "cfg_scale": dict(cfg_scale=1.0),
    "remasking": dict(remasking="random"), "logits_eos_inf": dict(logits_eos_inf=True),
    "confidence_eos_eot_inf": dict(confidence_eos_eot_inf=True), "threshold": dict(threshold=None),
}


@pytest.mark.parametrize("name", list(BAD_GEN))
def test_block_settings_are_refused_with_flash(name):
    kw = {"gen_length": G, "threshold": 0.9, "flash": lj.FlashConfig(), **BAD_GEN[name]}
    with pytest.raises(ValueError, match=name):
        lj.GenerationConfig(**kw)


BAD_FLASH = {"window": 0, "lookahead": -1, "track": 2.5, "verify": 1, "gamma": 0.0,
             "accept": "greedy"}


@pytest.mark.parametrize("name", list(BAD_FLASH))
def test_bad_flash_settings_are_refused(name):
    with pytest.raises(ValueError, match=f"flash.{name}"):
        lj.FlashConfig(**{name: BAD_FLASH[name]})


def test_defaults_and_what_is_allowed():
    f = lj.FlashConfig()
    assert (f.window, f.lookahead, f.track, f.verify, f.gamma, f.accept) == (
        16, 48, 64, False, 0.8, "cumprod")
    gen = lj.GenerationConfig(gen_length=G, threshold=0.9, flash=f)  # block_length 32 > G
    assert gen.num_blocks == 1
    lj.GenerationConfig(gen_length=G, block_length=G, threshold=0.9, flash=f, fp8_ffn=True)
    with pytest.raises(ValueError, match="flash must be a FlashConfig"):
        lj.GenerationConfig(gen_length=G, threshold=0.9, flash={"window": 4})
    lj.GenerationConfig(gen_length=G, threshold=0.9, flash=lj.FlashConfig(verify=True))
