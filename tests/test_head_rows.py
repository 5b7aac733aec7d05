"""The last layer computes the LM head's rows only (`cache.HEAD_ROWS_ONLY`): its attention,
projection and MLP run for the block's rows (Flash-dLLM's: the window's), its keys and values
for every row. Fails if that is silently off (the MLP's rows) and if it changes what any
policy generates (the same tokens, NFE and steps as every row through the last layer, fp32)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import lacache_jax as lj
from lacache_jax import cache
from tests.conftest import GEN_CFG

CFG = GEN_CFG
G, BL = 24, 8
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 64, 128, 11], [7, 8, 9, 10, 11],
           list(range(100, 113))]
P = max(map(len, PROMPTS))  # generate pads the prompts to the longest
T = P + G
DPAD = lj.DPadConfig(window=10)
MLP = lj.model.mlp  # the unpatched one: each run wraps it afresh


@pytest.fixture(scope="module")
def params():
    return lj.init_params(CFG, jax.random.key(0), np.float32, std=0.3)


def _run(params, monkeypatch, head_rows_only: bool, slots=None, **kw):
    """(result, the MLP's rows per call as traced, per layer in order); `kw`: the
    GenerationConfig's fields beyond this file's blocks (with `flash`: in their place)."""
    widths = []

    def mlp(x_BLD, layer, cfg):
        widths.append(x_BLD.shape[1])
        return MLP(x_BLD, layer, cfg)
    monkeypatch.setattr(lj.model, "mlp", mlp)
    monkeypatch.setattr(cache, "HEAD_ROWS_ONLY", head_rows_only)
    jax.clear_caches()  # trace again under the switch and the patched MLP
    blocks = {} if "flash" in kw else dict(block_length=BL, steps=12)
    gen = lj.GenerationConfig(gen_length=G, stop_at_eos=False, **blocks, **kw)
    out = lj.generate(params, CFG, PROMPTS, gen, key=jax.random.key(3), slots=slots)
    return out, widths


CASES = {  # every call site of `cache.head_blocks` and flash's query pass
    "none_cfg": dict(cfg_scale=1.5),  # `_forward` (also the KV caches' first forwards)
    "exact": dict(cache="exact"),  # `ExactCache._rest`
    "prefix": dict(cache="prefix", threshold=0.9),  # `_step_from`
    "dual_refresh": dict(cache="dual", refresh_interval=2),
    "prefix_dpad": dict(cache="prefix", dpad=DPAD),  # `_step_compact`, the compact canvas
    "prefix_slots": dict(cache="prefix", slots=2),  # per-row starts: `_step_window`'s [P, T)
    # the prefill and later steps of the sliding window (width BL: the head's rows)
    "flash": dict(threshold=0.9, flash=lj.FlashConfig(window=BL, lookahead=4, track=4)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_last_layer_runs_the_block_rows_with_the_same_tokens(params, monkeypatch, case):
    kw = dict(CASES[case])
    slots = kw.pop("slots", None)
    on, on_widths = _run(params, monkeypatch, True, slots, **kw)
    off, off_widths = _run(params, monkeypatch, False, slots, **kw)
    L = CFG.n_layers
    assert L >= 2 and len(on_widths) == len(off_widths) and len(on_widths) % L == 0
    # Each traced forward's layers in order: with the switch on, its last layer's MLP takes
    # the block's rows (its rows under CFG: one row per model row, BL of them; flash: the
    # window's), the others the rows they took with it off.
    for f in range(0, len(on_widths), L):
        assert on_widths[f:f + L - 1] == off_widths[f:f + L - 1], (on_widths, off_widths)
        assert on_widths[f + L - 1] == BL, (case, on_widths)
    assert max(off_widths) > BL  # the case has forwards wider than a block
    for field in ("tokens", "nfe", "steps"):
        np.testing.assert_array_equal(np.asarray(getattr(on, field)),
                                      np.asarray(getattr(off, field)), err_msg=field)


def test_one_layer_exact_cache_keeps_its_block_rows(monkeypatch):
    """exact's layers >= 1 are empty in a one-layer model: `run_blocks` still returns the
    block's rows (no layer to cut them in), the tokens those of the switch off."""
    cfg = dataclasses.replace(CFG, n_layers=1)
    params = lj.init_params(cfg, jax.random.key(1), np.float32, std=0.3)
    gen = lj.GenerationConfig(gen_length=G, block_length=BL, steps=12, stop_at_eos=False,
                              cache="exact")
    runs = []
    for on in (True, False):
        monkeypatch.setattr(cache, "HEAD_ROWS_ONLY", on)
        jax.clear_caches()
        runs.append(lj.generate(params, cfg, PROMPTS, gen, key=jax.random.key(3)))
    np.testing.assert_array_equal(np.asarray(runs[0].tokens), np.asarray(runs[1].tokens))
