"""Flash-Verify (lacache_jax/flash.py, FlashConfig(verify=True)) against the eager PyTorch
reference (tests/reference_flash.py, verify=True), fp32, temperature 0: the two-view mask
equals the reference's `verify_mask`; tokens, NFE and steps identical for both acceptance rules
and several gamma, ragged batches row by row with EOS stops; gamma > 1 reproduces part 1
without verify when every decoded position is tracked; bad settings refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import lacache_jax as lj
from convert.__main__ import main as convert_main
from lacache_jax import flash
from lacache_jax.config import tiny
from tests.conftest import hf_llama, random_llada_state, write_hf_llada
from tests.reference_flash import reference_flash_generate, verify_mask

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


def _reference(model, prompt, gen, record=None):
    f = gen.flash
    return reference_flash_generate(
        model, prompt, gen_length=gen.gen_length, window=f.window, lookahead=f.lookahead,
        track=f.track, threshold=gen.threshold, mask_id=CFG.mask_id,
        eos_id=CFG.eos_id if gen.eos_id is None else gen.eos_id, stop_at_eos=gen.stop_at_eos,
        verify=f.verify, gamma=f.gamma, accept=f.accept, record=record)


@pytest.mark.parametrize("S,T,R", [(0, 8, 8), (1, 6, 8), (3, 2, 8), (4, 0, 8), (4, 8, 16),
                                   (2, 3, 8)])
def test_mask_equals_reference_verify_mask(S, T, R):
    """The slot layout [T tracked | unused | S drafts | S masks] of R rows, restricted to its
    used slots, is `verify_mask(S, T)`; no row sees an unused slot."""
    kind, idx = flash.verify_slots(jnp.array([S]), jnp.array([T]), R)
    m = np.asarray(flash.verify_mask(kind, idx))[0]
    used = np.asarray(kind[0]) != flash.V_UNUSED
    assert used.sum() == T + 2 * S
    np.testing.assert_array_equal(m[np.ix_(used, used)], verify_mask(S, T))
    assert not m[np.ix_(used, ~used)].any()


def _check_rows(params, model, prompts, gen):
    out = lj.generate(params, CFG, prompts, gen)
    P = max(map(len, prompts))
    results = []
    for b, prompt in enumerate(prompts):
        record = []
        ref, nfe, steps = _reference(model, prompt, gen, record)
        np.testing.assert_array_equal(np.asarray(out.tokens[b, P - len(prompt):]), ref)
        assert (int(out.nfe[b]), int(out.steps[b])) == (nfe, steps)
        results.append((out, record))
    return out, [r for _, r in results]


# window 8: S reaches 4; small track: the verify pass tracks 2W - 2S rows out of the ranking.
PARITY = {
    "cumprod_0.5": dict(accept="cumprod", gamma=0.5),
    "cumprod_0.8": dict(accept="cumprod", gamma=0.8),
    "agree_0.3": dict(accept="agree", gamma=0.3),
    "agree_0.7": dict(accept="agree", gamma=0.7),
}


@pytest.mark.parametrize("case", list(PARITY))
def test_tokens_nfe_steps_match_reference(deep, case):
    params, model = deep
    gen = _gen(window=8, lookahead=4, track=3, verify=True, **PARITY[case])
    out, (record,) = _check_rows(params, model, [PROMPT], gen)
    assert int(out.nfe[0]) == 2 * int(out.steps[0])  # both passes count, also when S = 0
    assert sum(len(r["verify_accepted"]) for r in record) > 0  # verification did accept
    assert int(out.revealed[0]) == G
