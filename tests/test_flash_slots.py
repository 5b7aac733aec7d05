"""Flash-dLLM with slot refill (`generate(..., gen=GenerationConfig(flash=...), slots=S)`,
lacache_jax/flash_slots.py): fp32, per-row keys, more prompts than slots, ragged prompts over
two length buckets, rows stopping at EOS steps apart (some at their prefill): sampled, every
row's tokens, NFE and steps equal those of one static `generate` batch of all the prompts (a
row of which is the prompt alone: tests/test_flash.py checks ragged batches row by row; a
literal `generate` per prompt would compile once per length), the state narrowed between
buckets; with Flash-Verify at temperature 0, every row equals the PyTorch reference run of its
prompt alone; bad input."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import lacache_jax as lj
import torch

from convert.__main__ import main as convert_main
from lacache_jax import flash_slots, slots
from lacache_jax.config import tiny
from tests.conftest import hf_llama, random_llada_state, write_hf_llada
from tests.reference_flash import reference_flash_generate

# Three layers: importance (layers 2..L-1) is not zero, so the tracked set follows it.
CFG = tiny(n_heads=4, n_kv_heads=2, n_layers=3)
G, S = 16, 3
_rng = np.random.default_rng(1)
# Buckets 16 (lengths 12, 10) and 8: the canvas narrows while rows are in flight.
TWO_BUCKETS = [_rng.integers(0, 300, n).tolist() for n in (3, 12, 5, 8, 10, 4, 7)]
ONE_BUCKET = [p for p in TWO_BUCKETS if len(p) <= 8] + [_rng.integers(0, 300, 6).tolist()]
FLASH = dict(window=4, lookahead=3, track=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """fp32 params with peaked outputs (seed 7, head_std 2: thresholds fire) and the
    transformers reference with the same weights, as test_flash."""
    tmp = tmp_path_factory.mktemp("flash_slots")
    state = random_llada_state(CFG, seed=7, head_std=2.0)
    write_hf_llada(tmp / "hf", CFG, state)
    assert convert_main([str(tmp / "hf"), str(tmp / "ck"), "--dtype", "float32", "--quiet"]) == 0
    return lj.load(tmp / "ck")[1], hf_llama(CFG, state, torch.float32)


@pytest.fixture(scope="module")
def params(models):
    return models[0]


def _gen(**kw):
    flash = lj.FlashConfig(**{**FLASH, **kw.pop("flash", {})})
    return lj.GenerationConfig(**{**dict(gen_length=G, threshold=0.9, flash=flash), **kw})


@pytest.fixture(scope="module")
def eos_id(params):
    """A token that one full forward of the canvases predicts in the first quarter of some
    rows' answers and nowhere in others': as EOS it ends rows steps apart (one forward is far
    cheaper to compile than a decoding run; each case checks that it does)."""
    P = max(map(len, TWO_BUCKETS))
    x = np.full((len(TWO_BUCKETS), P + G), CFG.mask_id, np.int32)
    for b, p in enumerate(TWO_BUCKETS):
        x[b, :P - len(p)], x[b, P - len(p):P] = CFG.pad_id, p
    guess = np.asarray(lj.forward(params, CFG, x)).argmax(-1)[:, P:]
    best, score = None, 0
    for t in np.unique(guess):
        early = (guess[:, :G // 4] == t).any(-1).sum()
        never = (~(guess == t).any(-1)).sum()
        if min(early, never) > score:
            best, score = int(t), min(early, never)
    assert best is not None
    return best


@pytest.fixture
def calls(monkeypatch):
    """The until-finish program's inputs and the narrowing widths, call by call (the lazily
    jitted path)."""
    seen = dict(chunks=[], narrow=[])
    real_chunk, real_narrow = flash_slots._until_finish, flash_slots._narrow

    def chunk(params, cfg, gen, impl, st, *rest):
        live = ~np.asarray(st.done_B)
        seen["chunks"].append(dict(T=st.x_BT.shape[1], steps=np.asarray(st.steps_B)[live]))
        return real_chunk(params, cfg, gen, impl, st, *rest)

    def narrow(st, d):
        seen["narrow"].append((st.x_BT.shape[1], d))
        return real_narrow(st, d)
    monkeypatch.setattr(flash_slots, "_until_finish", chunk)
    monkeypatch.setattr(flash_slots, "_narrow", narrow)
    return seen


def _assert_same(got, want):
    for field in ("tokens", "prompt_lengths", "nfe", "steps", "revealed", "gen_lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                      np.asarray(getattr(want, field)), err_msg=field)


def _assert_not_vacuous(want):
    """Rows stop at EOS steps apart, and some run to the end."""
    steps, revealed = np.asarray(want.steps), np.asarray(want.revealed)
    assert (revealed < G).any() and (revealed == G).any()
    assert steps.max() - steps.min() >= 3


def test_slots_equal_generate_sampled_two_buckets(params, eos_id, calls):
    """Sampled tokens (temperature 1) with per-row keys: each row's draws must follow it into
    its slot (its own step count), through a narrowing of the canvas."""
    gen = _gen(eos_id=eos_id, temperature=1.0)
    keys = jax.random.split(jax.random.key(2), len(TWO_BUCKETS))
    want = lj.generate(params, CFG, TWO_BUCKETS, gen, key=keys)
    _assert_not_vacuous(want)
    done = []
    got = lj.generate(params, CFG, TWO_BUCKETS, gen, key=keys, slots=S,
                      progress=lambda n, total: done.append((n, total)))
    _assert_same(got, want)
    assert done[-1] == (len(TWO_BUCKETS), len(TWO_BUCKETS)) and len(done) > 2
    # Refilled: a call held rows at different step counts (one entered while others ran).
    assert any(len(set(c["steps"].tolist())) > 1 for c in calls["chunks"])
    widths = [c["T"] for c in calls["chunks"]]
    assert widths[0] == 16 + G and widths[-1] == 8 + G and calls["narrow"] == [(16 + G, 8)]


def test_slots_equal_reference_alone_verify_compiled(models, eos_id):
    """Flash-Verify at temperature 0 through compile_generate's precompiled programs: every
    row equals the eager PyTorch reference (tests/reference_flash.py) run on its prompt
    alone: the guarantee taken literally, against an oracle that shares no code."""
    params, model = models
    gen = _gen(eos_id=eos_id, flash=dict(verify=True))
    run = lj.compile_generate(params, CFG, ONE_BUCKET, gen, slots=S)
    assert set(run.programs) == {8} and run.compiled is run.programs[8].chunk
    got = run()
    f, P = gen.flash, max(map(len, ONE_BUCKET))
    steps = []
    for b, prompt in enumerate(ONE_BUCKET):
        ref, nfe, n_steps = reference_flash_generate(
            model, prompt, gen_length=G, window=f.window, lookahead=f.lookahead, track=f.track,
            threshold=gen.threshold, mask_id=CFG.mask_id, eos_id=eos_id, stop_at_eos=True,
            verify=True, gamma=f.gamma, accept=f.accept)
        np.testing.assert_array_equal(np.asarray(got.tokens[b, P - len(prompt):]), ref)
        assert (int(got.nfe[b]), int(got.steps[b])) == (nfe, n_steps)
        steps.append(n_steps)
    _assert_not_vacuous(got)
    assert len(set(steps)) > 2  # rows finished at several different steps


def test_bad_input(params):
    gen = _gen()
    with pytest.raises(ValueError, match="block_limits applies to block decoding"):
        slots.run(params, CFG, gen.resolve(CFG), [np.array([1, 2])], jax.random.key(0)[None],
                  1, block_limits=np.array([1]))
    with pytest.raises(ValueError, match="slots must be a positive integer"):
        lj.generate(params, CFG, [[1, 2]], gen, slots=0)
