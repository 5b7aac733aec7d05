"""Sanity tests of the Flash-dLLM PyTorch reference (tests/reference_flash.py) itself: cache
refresh semantics, importance, tracking, the verify mask and pass, acceptance rules and EOS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lacache_jax.config import tiny
from tests.conftest import GEN_CFG, hf_llama, hf_logits, random_llada_state
from tests.reference_flash import (_prefill, reference_flash_generate, verify_mask,
                                   verify_pass)

PROMPT = [5, 17, 99, 3, 250, 42, 7, 64, 128, 11]
# Importance sums layers 2..L-1, so GEN_CFG's two layers would leave it identically zero.
DEEP_CFG = tiny(n_heads=4, n_kv_heads=2, n_layers=4)
ONE_LAYER_CFG = tiny(n_heads=4, n_kv_heads=2, n_layers=1)


def _model(cfg):
    # seed 7 / head_std 2 are the `models` fixture's weights: peaked, thresholds fire.
    return hf_llama(cfg, random_llada_state(cfg, seed=7, head_std=2.0), torch.float32)


@pytest.fixture(scope="module")
def peaked():
    return _model(GEN_CFG)


@pytest.fixture(scope="module")
def deep():
    return _model(DEEP_CFG)


@pytest.fixture(scope="module")
def one_layer():
    return _model(ONE_LAYER_CFG)


def _run(model, cfg, record=None, **kw):
    base = dict(gen_length=16, window=4, lookahead=4, track=6, threshold=0.9,
                mask_id=cfg.mask_id, eos_id=cfg.eos_id)
    return reference_flash_generate(model, PROMPT, record=record, **{**base, **kw})


# fp32 logits of magnitude <= ~30 (head_std 2); the cached path only changes summation order
# (keys in another order, rows in another batch), ~1e-6 relative per op over a few ops.
LOGIT_ATOL = 1e-4


@pytest.mark.parametrize("lookahead", [None, 2])  # track=None overrides the look-ahead
def test_full_recompute_when_everything_is_queried(peaked, lookahead):
    record = []
    _run(peaked, GEN_CFG, record, track=None, lookahead=lookahead)
    assert len(record) > 2
    for rec in record:
        full = hf_logits(peaked, rec["canvas"][None])[0]
        np.testing.assert_allclose(rec["logits"], full[rec["window"]], rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("track,lookahead", [(0, 0), (2, 1), (None, 0), (30, 0)])
def test_keys_come_from_the_cache_as_last_written(one_layer, track, lookahead):
    """One layer: a position's K/V depend only on its token and position, so a step's window
    logits are those of a full forward of the canvas as it was when each position was last
    queried (the prefill queries all). track=None queries everything; track=30 tracks every
    decoded position, which leaves nothing stale here (the masks outside the look-ahead have
    not changed)."""
    record = []
    _run(one_layer, ONE_LAYER_CFG, record, track=track, lookahead=lookahead, gen_length=12)
    written = record[0]["canvas"].copy()
    stale_seen, undecoded = False, set(range(len(PROMPT), len(written)))
    for rec in record:
        if not rec["prefill"]:  # the look-ahead: the next undecoded positions after the window
            rest = sorted(undecoded - set(rec["window"]))
            assert rec["lookahead"] == (rest if track is None else rest[:lookahead])
        undecoded -= set(rec["accepted"])
        queried = rec["window"] + rec["lookahead"] + rec["tracked"]
        written[queried] = rec["canvas"][queried]
        expected = hf_logits(one_layer, written[None])[0][rec["window"]]
        np.testing.assert_allclose(rec["logits"], expected, rtol=0, atol=LOGIT_ATOL)
        stale_seen |= bool((written != rec["canvas"]).any())
    assert stale_seen == (track in (0, 2))  # so a fresh-canvas expectation would fail


def _rope(x_NHK, positions, theta):
    K = x_NHK.shape[-1]
    inv_freq = theta ** (-torch.arange(0, K, 2, dtype=torch.float32) / K)
    ang = torch.as_tensor(positions, dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rotated = torch.cat([-x_NHK[..., K // 2:], x_NHK[..., :K // 2]], -1)
    return x_NHK * cos + rotated * sin


def _importance(model, cfg, canvas, window, first_layer):
    """Raw q.k of the window rows, mean over rows and heads, summed over layers, from the
    per-layer inputs of a plain full forward."""
    N = len(canvas)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(canvas[None]).long(),
                    attention_mask=torch.zeros(1, 1, N, N), output_hidden_states=True)
        total = torch.zeros(N, dtype=torch.float64)
        for layer in range(first_layer, cfg.n_layers):
            attn = model.model.layers[layer].self_attn
            h = model.model.layers[layer].input_layernorm(out.hidden_states[layer][0])
            q = _rope(attn.q_proj(h).view(N, cfg.n_heads, -1), range(N), cfg.rope_theta)
            k = _rope(attn.k_proj(h).view(N, cfg.n_kv_heads, -1), range(N), cfg.rope_theta)
            k = k.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=1)
            raw_HWN = torch.einsum("whk,nhk->hwn", q[window], k)
            total += raw_HWN.double().mean(dim=(0, 1))
    return total.numpy()


def test_importance_is_raw_qk_of_the_window_over_layers_2_on(deep):
    record = []
    _run(deep, DEEP_CFG, record, track=None, lookahead=None, gen_length=8)
    for rec in record:
        expected = _importance(deep, DEEP_CFG, rec["canvas"], rec["window"], first_layer=2)
        # raw scores ~O(1)-O(10) accumulated in fp32 over K = 16 terms: ~1e-6 absolute.
        np.testing.assert_allclose(rec["importance"], expected, rtol=1e-4, atol=1e-4)
    every_layer = _importance(deep, DEEP_CFG, record[0]["canvas"], record[0]["window"], 0)
    assert not np.allclose(record[0]["importance"], every_layer, rtol=1e-2)


@pytest.mark.parametrize("verify", [False, True])
def test_tracked_set_is_last_accepted_plus_most_important(deep, verify):
    """Next step tracks the tokens accepted last (the verify pass's, with verify: the released
    code re-ranks the draft-accepted ones) plus the most important other decoded positions."""
    track, record = 2, []  # small, so the importance ranking decides (5 hides a wrong rule)
    _run(deep, DEEP_CFG, record, track=track, lookahead=2, verify=verify, gamma=0.3)
    from_prompt, decoded = False, set(range(len(PROMPT)))
    for rec, nxt in zip(record, record[1:]):
        last = rec["verify_accepted"] if verify else rec["accepted"]
        decoded |= set(rec["accepted"]) | set(rec.get("verify_accepted", []))
        others = sorted(decoded - set(last), key=lambda p: rec["importance"][p])
        n_others = track - min(len(last), track)
        expected = set(others[len(others) - n_others:] if n_others else []) | set(last[-track:])
        assert set(rec["next_tracked"]) == expected
        assert nxt["tracked"] == rec["next_tracked"]
        from_prompt |= bool(set(rec["next_tracked"]) & set(range(len(PROMPT))))
    assert from_prompt  # importance did pick an old position, not only the newest ones


@pytest.mark.parametrize("S,T", [(0, 8), (1, 6), (3, 2), (4, 0), (4, 8)])
def test_verify_mask_rule(S, T):
    m = verify_mask(S, T)
    assert m.shape == (T + 2 * S, T + 2 * S) and m.dtype == bool
    tracked, drafts, masks = range(T), range(T, T + S), range(T + S, T + 2 * S)
    assert m[:, list(tracked)].all()
    for r in tracked:
        assert not m[r, list(drafts)].any() and m[r, list(masks)].all()
    for i in range(S):
        for row in (drafts[i], masks[i]):
            # every candidate j is seen exactly once, as a draft or as a mask
            seen = m[row, list(drafts)].astype(int) + m[row, list(masks)].astype(int)
            assert (seen == 1).all()
        assert m[drafts[i], drafts[i]] and not m[masks[i], drafts[i]]
        assert [j for j in range(S) if m[masks[i], drafts[j]]] == list(range(i))


def test_verify_pass_isolates_the_views(one_layer):
    """One layer: mask-view row i equals a full forward of the canvas holding the drafts of the
    candidates before i and masks from i on (cached keys were written from the same canvas)."""
    cfg = ONE_LAYER_CFG
    x = np.array(PROMPT + [cfg.mask_id] * 8)
    _, kv, _ = _prefill(one_layer, x, [10, 11, 12, 13])
    tracked, candidates = [2, 7, 9], [14, 11, 16]
    drafts = np.array([40, 41, 42])
    before = [(k.clone(), v.clone()) for k, v in kv]
    got = verify_pass(one_layer, kv, x, tracked, candidates, drafts, cfg.mask_id)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv, before))
    for i in range(len(candidates)):
        y = x.copy()
        y[candidates[:i]] = drafts[:i]
        expected = hf_logits(one_layer, y[None])[0][candidates[i]]
        np.testing.assert_allclose(got[i], expected, rtol=0, atol=LOGIT_ATOL)
    other = verify_pass(one_layer, kv, x, tracked, candidates, np.array([40, 99, 42]),
                        cfg.mask_id)
    assert np.array_equal(other[:2], got[:2]) and not np.allclose(other[2], got[2])
    changed = x.copy()
    changed[tracked] = 77  # fresh K/V now differ from the cache, so a write would show
    verify_pass(one_layer, kv, changed, tracked, candidates, drafts, cfg.mask_id)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv, before))


def test_gamma_above_one_reproduces_verify_off(peaked):
    """Nothing passes verification; with every decoded position tracked (the re-ranking quirk
    aside) the draft passes are the verify=False steps, so the tokens are identical."""
    kw = dict(track=64, lookahead=3, gen_length=12)  # 64 >= every position: all tracked
    plain, nfe, steps = _run(peaked, GEN_CFG, **kw)
    record = []
    tokens, v_nfe, v_steps = _run(peaked, GEN_CFG, record, verify=True, gamma=1.5, **kw)
    np.testing.assert_array_equal(tokens, plain)
    assert (v_steps, v_nfe, nfe) == (steps, 2 * steps, steps)
    assert all(r["verify_accepted"] == [] for r in record)
    assert any(r["candidates"] for r in record)


@pytest.mark.parametrize("accept", ["cumprod", "agree"])
def test_verify_follows_its_acceptance_rule(peaked, accept):
    # window 8 / gamma 0.5: S reaches 4 and some step tells the two rules apart
    W, gamma, record = 8, 0.5, []
    tokens, nfe, steps = _run(peaked, GEN_CFG, record, window=W, verify=True, gamma=gamma,
                              accept=accept, stop_at_eos=False)
    n_decoded, undecoded = len(PROMPT), set(range(len(PROMPT), len(tokens)))
    rules_differ = False
    for rec in record:
        # the rejected-first ordering still makes the window the left-most undecoded positions
        assert sorted(rec["window"]) == sorted(undecoded)[:W]
        undecoded -= set(rec["accepted"]) | set(rec["verify_accepted"])
        n_decoded += len(rec["accepted"])
        rejected = [p for p in rec["window"] if p not in rec["accepted"]]
        conf = dict(zip(rec["window"], rec["confidence"]))
        S = len(rec["candidates"])
        assert S == min(len(rejected), W // 2)  # no EOS here: every window position counts
        assert rec["candidates"] == sorted(rejected, key=lambda p: -conf[p])[:S]
        assert len(rec["verify_tracked"]) == min(2 * W - 2 * S, n_decoded)
        p, argmax = rec["verify_p"], rec["verify_argmax"]
        drafts = rec["draft"][[rec["window"].index(c) for c in rec["candidates"]]]
        by_rule = {"cumprod": np.cumprod(p) >= gamma, "agree": (argmax == drafts) & (p >= gamma)}
        n_by_rule = {k: int(np.argmin(np.append(v, False))) for k, v in by_rule.items()}
        rules_differ |= n_by_rule["cumprod"] != n_by_rule["agree"]
        n = n_by_rule[accept]  # the first failure ends the accepted prefix
        assert rec["verify_accepted"] == rec["candidates"][:n]
        assert (tokens[rec["verify_accepted"]] == drafts[:n]).all()
        n_decoded += n
    assert rules_differ and sum(len(r["verify_accepted"]) for r in record) > 0
    assert nfe == 2 * steps and steps < _run(peaked, GEN_CFG, window=W, stop_at_eos=False)[2]


def test_eos_stops_the_row(peaked):
    """Declare the first token accepted at step 1 to be EOS: the run follows the free run's
    step 1, then never accepts past the predicted length, stops early and fills with EOS."""
    free = []
    _, _, free_steps = _run(peaked, GEN_CFG, free, stop_at_eos=False)
    first = free[0]
    eos = int(first["draft"][first["window"].index(first["accepted"][0])])
    assert eos != GEN_CFG.mask_id
    record = []
    tokens, _, steps = _run(peaked, GEN_CFG, record, eos_id=eos, stop_at_eos=True)
    assert record[0]["accepted"] == first["accepted"]
    pred_len = max(p for p in first["accepted"] if tokens[p] == eos) + 1
    assert all(r["predicted_length"] == pred_len for r in record)
    decoded = set(range(len(PROMPT))) | set(record[0]["accepted"])
    for rec in record[1:]:
        assert (rec["confidence"][np.array(rec["window"]) >= pred_len] == 0).all()
        assert all(p < pred_len for p in rec["accepted"])
        decoded |= set(rec["accepted"])
    assert set(range(pred_len)) <= decoded and steps < free_steps
    undecoded = sorted(set(range(len(tokens))) - decoded)
    assert undecoded and (tokens[undecoded] == eos).all()


def test_threshold_reveals_several_tokens_per_step(peaked):
    record = []
    tokens, nfe, steps = _run(peaked, GEN_CFG, record, window=8, gen_length=24)
    assert max(len(r["accepted"]) for r in record) > 1 and steps < 24 and nfe == steps
    assert not (tokens == GEN_CFG.mask_id).any()


BAD = {
    "gen_length": 0, "window": 0, "lookahead": -1, "track": 2.5, "threshold": 1.5,
    "gamma": 0.0, "accept": "greedy", "eos_id": GEN_CFG.mask_id, "record": (),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments_are_refused(peaked, name):
    with pytest.raises(ValueError, match=name):
        _run(peaked, GEN_CFG, **{name: BAD[name]})
