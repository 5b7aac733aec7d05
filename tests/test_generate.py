"""lj.generate against the eager PyTorch reference sampler (fp32, temperature 0), batching
invariants, early stop at EOS, and refusal of every bad GenerationConfig value."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import lacache_jax as lj
from lacache_jax import sampling
from lacache_jax.generate import row_keys
from lacache_jax.sampling import dpad_block_keys
from convert.__main__ import main as convert_main
from tests.conftest import GEN_CFG, hf_llama, random_llada_state, write_hf_llada
from tests.reference_sampler import reference_generate

CFG = GEN_CFG
G, BL = 24, 8
PROMPT = [5, 17, 99, 3, 250, 42, 7, 64, 128, 11]


def _gen(**kw):
    base = dict(gen_length=G, block_length=BL, steps=G, stop_at_eos=False)
    return lj.GenerationConfig(**{**base, **kw})


PARITY = {
    "fixed_1_per_step": dict(),
    "fixed_2_per_step": dict(steps=12),
    "fixed_uneven": dict(steps=9),  # 3 steps for 8 tokens: 3, 3, 2
    "threshold_0.9": dict(threshold=0.9),
    "threshold_0.5": dict(threshold=0.5),
    "factor_1": dict(factor=1.0),
    "factor_3": dict(factor=3.0),
    "prefix_fixed": dict(cache="prefix", steps=12),
    "prefix_threshold": dict(cache="prefix", threshold=0.9),
    "dual_fixed": dict(cache="dual", steps=12),
    "dual_threshold": dict(cache="dual", threshold=0.9),
    "dual_factor": dict(cache="dual", factor=1.0),
    "dual_refresh_2": dict(cache="dual", refresh_interval=2),
    "cfg_scale": dict(cfg_scale=1.5, steps=12),
    "cfg_scale_prefix": dict(cfg_scale=1.5, cache="prefix", threshold=0.9),
    "cfg_scale_dual": dict(cfg_scale=1.5, cache="dual", refresh_interval=2, steps=12),
    # EOS / EoT are tokens the baseline emits (see _emitted), so these flags change tokens.
    "logits_eos_inf": dict(logits_eos_inf=True, eos_id="emitted"),
    "logits_eos_inf_threshold": dict(logits_eos_inf=True, eos_id="emitted", threshold=0.9),
    "confidence_eos_eot_inf": dict(confidence_eos_eot_inf=True, eos_id="emitted",
                                   eot_id="emitted"),
    "confidence_eos_eot_inf_dual": dict(confidence_eos_eot_inf=True, eos_id="emitted",
                                        eot_id="emitted", cache="dual", steps=12),
}


def _emitted(params, kw: dict) -> tuple[dict, np.ndarray]:
    """Replace "emitted" ids by the two most frequent tokens of the run without the flags: a
    flag that silently does nothing then leaves the output unchanged, which the caller checks."""
    plain = {k: v for k, v in kw.items() if v != "emitted" and not k.endswith("_inf")}
    base = np.asarray(lj.generate(params, CFG, [PROMPT], _gen(**plain)).tokens[0, len(PROMPT):])
    ids, counts = np.unique(base, return_counts=True)
    top = [int(i) for i in ids[np.argsort(-counts, kind="stable")][:2]]
    fill = iter(top)
    return {k: next(fill) if v == "emitted" else v for k, v in kw.items()}, base


@pytest.mark.parametrize("case", list(PARITY))
def test_matches_reference_sampler(models, case):
    params, ref_model = models
    kw = PARITY[case]
    base = None
    if "emitted" in kw.values():
        kw, base = _emitted(params, kw)
    gen = _gen(**kw)
    out = lj.generate(params, CFG, [PROMPT], gen)
    if base is not None:  # the flag acts: the tokens differ from the run without it
        assert (np.asarray(out.tokens[0, len(PROMPT):]) != base).any()
    r = gen.resolve(CFG)
    ref, ref_nfe = reference_generate(
        ref_model, PROMPT, gen_length=G, block_length=BL, steps=gen.steps, mask_id=r.mask_id,
        eos_id=r.eos_id, cache=gen.cache, threshold=gen.threshold, factor=gen.factor,
        refresh_interval=gen.refresh_interval, cfg_scale=gen.cfg_scale,
        logits_eos_inf=gen.logits_eos_inf, confidence_eos_eot_inf=gen.confidence_eos_eot_inf,
        eot_id=gen.eot_id)
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), ref)
    assert int(out.nfe[0]) == ref_nfe
    assert int(out.revealed[0]) == G and not (ref == CFG.mask_id).any()


# Cases where confidences near 1 (logits ~32) differ below fp32's resolution of p: the
# reference's float64 orders them, an fp32 softmax tied them (position order) and changed the
# tokens (fixed) or the step count (threshold 1.0). Found by random sweeps against the
# reference (15 of 300 cases differed with the fp32 softmax, none with log-odds).
NEAR_ONE = {
    "fixed": dict(prompt=[213], gen_length=16, block_length=8, steps=16),
    "threshold_1.0": dict(prompt=[128, 279, 277, 46, 186, 241, 46, 156, 132], gen_length=8,
                          block_length=4, steps=8, threshold=1.0),
    # two positions at p == 1.0 exactly in float64 (r <= 2^-53): a tie in position order
    "float64_tie_cfg_prefix": dict(prompt=[83, 160, 295, 15, 289, 95, 267, 65, 201, 61],
                                   gen_length=8, block_length=4, steps=8, cache="prefix",
                                   cfg_scale=1.5),
}


@pytest.mark.parametrize("case", list(NEAR_ONE))
def test_confidences_near_one_order_as_float64(models, case):
    params, ref_model = models
    kw = dict(NEAR_ONE[case])
    prompt = kw.pop("prompt")
    gen = lj.GenerationConfig(stop_at_eos=False, **kw)
    out = lj.generate(params, CFG, [prompt], gen)
    ref, ref_nfe = reference_generate(ref_model, prompt, mask_id=CFG.mask_id, eos_id=CFG.eos_id,
                                      **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), ref)
    assert int(out.nfe[0]) == ref_nfe


def test_confidence_log_odds_against_float64():
    """Log-odds of the chosen token against float64, over peaked and flat rows, the chosen
    token the argmax or not; near p = 1 against float64's rounding of 1 / (1 + r)."""
    logits = jax.random.normal(jax.random.key(0), (4, 64, 50)) * jnp.array([1, 4, 12, 30.0])[
        :, None, None]
    x0 = jnp.argmax(logits, -1).at[:, ::3].set(7)  # every third chosen token is arbitrary
    z = np.asarray(sampling.confidence(logits, x0, "low_confidence", None), np.float64)
    l64 = np.asarray(logits, np.float64)
    chosen = np.take_along_axis(l64, np.asarray(x0)[..., None], -1)[..., 0]
    others = np.where(np.arange(50) == np.asarray(x0)[..., None], -np.inf, l64)
    top = others.max(-1)
    ref = chosen - top - np.log(np.exp(others - top[..., None]).sum(-1))
    finite = np.isfinite(z)
    assert (~finite == (ref > 53 * math.log(2))).all()  # p == 1 in float64 exactly there
    # fp32: the logit differences (|d| <= 200: 1.5e-5 absolute) and log of the others' sum
    # (a few ulps relative) give |z| 1e-6 relative plus 2e-5 absolute; near p = 1 float64's
    # own rounding of 1 + r (2^-52 in r) adds up to log(1.5) where r is a few ulps of 1.
    near_one = ref > 30
    np.testing.assert_allclose(z[finite & ~near_one], ref[finite & ~near_one],
                               rtol=1e-6, atol=2e-5)
    r64 = np.round(np.exp(-ref) / 2.0 ** -52) * 2.0 ** -52
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(z[finite & near_one], -np.log(r64[finite & near_one]),
                                   rtol=1e-6)
    assert (finite & near_one).any() and (~finite).any()  # both regimes occur
    # Thresholds compare as p >= tau: at_least against float64 p.
    p64 = 1 / (1 + np.exp(-ref))
    for tau in (0.1, 0.5, 0.9, 0.999, 1.0):
        agree = np.asarray(sampling.at_least(jnp.asarray(z), tau)) == (p64 >= tau)
        assert agree.mean() > 0.999 and (agree | (np.abs(p64 - tau) < 1e-6)).all()
    assert not np.asarray(sampling.at_least(jnp.asarray(z), 1.5)).any()


@pytest.fixture(scope="module")
def mask_emitting_models(tmp_path_factory):
    """The `models` weights with the mask id's head row 1.3x that of the token the plain
    model emits most: the mask id wins wherever that token would, so masks stay masked."""
    state = random_llada_state(GEN_CFG, seed=7, head_std=2.0)
    tmp = tmp_path_factory.mktemp("mask")
    write_hf_llada(tmp / "plain", GEN_CFG, state)
    assert convert_main([str(tmp / "plain"), str(tmp / "p"), "--dtype", "float32",
                         "--quiet"]) == 0
    plain = lj.generate(lj.load(tmp / "p")[1], CFG, [PROMPT], _gen())
    ids, counts = np.unique(np.asarray(plain.tokens[0, len(PROMPT):]), return_counts=True)
    head = state["model.transformer.ff_out.weight"]
    head[CFG.mask_id] = 1.3 * head[ids[np.argmax(counts)]]
    write_hf_llada(tmp / "hf", GEN_CFG, state)
    assert convert_main([str(tmp / "hf"), str(tmp / "ck"), "--dtype", "float32",
                         "--quiet"]) == 0
    return lj.load(tmp / "ck")[1], hf_llama(GEN_CFG, state, torch.float32)


@pytest.mark.parametrize("kw", [dict(), dict(steps=12), dict(cache="dual", steps=12),
                                dict(threshold=0.9)], ids=str)
def test_a_model_sampling_the_mask_id(mask_emitting_models, kw):
    """Where the model samples the mask id the position stays masked: the fixed schedule
    still ends a block after its steps (LLaDA), the threshold rule after block_length steps,
    and `revealed` counts real tokens only."""
    params, ref_model = mask_emitting_models
    gen = _gen(**kw)
    out = lj.generate(params, CFG, [PROMPT], gen)
    ref, ref_nfe = reference_generate(
        ref_model, PROMPT, gen_length=G, block_length=BL, steps=gen.steps, mask_id=CFG.mask_id,
        eos_id=CFG.eos_id, cache=gen.cache, threshold=gen.threshold)
    left = int((ref[len(PROMPT):] == CFG.mask_id).sum())
    assert left > 0  # the case this test is about
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), ref)
    assert int(out.nfe[0]) == ref_nfe and int(out.revealed[0]) == G - left


def test_parallel_modes_reveal_several_tokens_per_step(models):
    """Guards the parity cases above against vacuity: thresholds do fire on this model."""
    params, _ = models
    out = lj.generate(params, CFG, [PROMPT], _gen(threshold=0.9))
    assert int(out.steps[0]) < G and float(out.tokens_per_step[0]) > 1.2


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("strategy", ["gaussian", "uniform"])
def test_dpad_matches_reference_with_the_same_kept_set(models, cache, strategy):
    params, ref_model = models
    dpad = lj.DPadConfig(strategy=strategy, window=10, keep=4)
    gen = _gen(cache=cache, steps=12, dpad=dpad)
    key = jax.random.key(3)
    out = lj.generate(params, CFG, [PROMPT], gen, key=key)
    keys = row_keys(key, 1)
    P = len(PROMPT)

    def keep_fn(b, T):
        e = P + (b + 1) * BL
        return np.asarray(sampling.dpad_keep(dpad, dpad_block_keys(keys, b), e, T))[0]
    assert not keep_fn(0, P + G).all()  # something is dropped
    ref, _ = reference_generate(ref_model, PROMPT, gen_length=G, block_length=BL, steps=12,
                                mask_id=CFG.mask_id, eos_id=CFG.eos_id, cache=cache,
                                keep_fn=keep_fn)
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), ref)


def _dpad_uniform_kept(window: int, keep: int, block_end: int, T: int) -> np.ndarray:
    """DPad's own uniform rule where it draws nothing (keep >= window): its
    `UniformSampler.sample` returns a suffix of at most `keep` columns whole, else
    `randperm(min(n, window))[:keep]`, i.e. the whole window."""
    src = np.arange(block_end, T)
    kept_cols = src if keep >= len(src) else src[:min(len(src), window)]
    kept = np.arange(T) < block_end
    kept[kept_cols] = True
    return kept


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_dpad_uniform_keeps_a_short_suffix_whole(models, cache):
    """Uniform DPad with keep above the window: block 0's 16-column suffix keeps the window's
    4, block 1's 8-column suffix (<= keep 12) is kept whole, as DPad's sampler does; the
    kept sets equal its rule and the tokens the reference's with that rule."""
    params, ref_model = models
    dpad = lj.DPadConfig(strategy="uniform", window=4, keep=12)
    P, T = len(PROMPT), len(PROMPT) + G
    keys = row_keys(jax.random.key(3), 2)
    for b in range(G // BL):
        e = P + (b + 1) * BL
        want = _dpad_uniform_kept(4, 12, e, T)
        got = np.asarray(sampling.dpad_keep(dpad, dpad_block_keys(keys, b), e, T))
        np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))
        rows = np.asarray(sampling.dpad_keep(dpad, dpad_block_keys(keys, b),
                                             jnp.asarray([e, P + BL]), T))  # per row
        np.testing.assert_array_equal(rows[0], want)
        np.testing.assert_array_equal(rows[1], _dpad_uniform_kept(4, 12, P + BL, T))
    assert _dpad_uniform_kept(4, 12, P + 2 * BL, T)[P + 2 * BL:].all()  # beyond the window
    gen = _gen(cache=cache, steps=12, dpad=dpad)
    out = lj.generate(params, CFG, [PROMPT], gen, key=jax.random.key(3))
    ref, _ = reference_generate(
        ref_model, PROMPT, gen_length=G, block_length=BL, steps=12, mask_id=CFG.mask_id,
        eos_id=CFG.eos_id, cache=cache,
        keep_fn=lambda b, T: _dpad_uniform_kept(4, 12, P + (b + 1) * BL, T))
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), ref)


def test_dpad_keep_probabilities():
    """Gaussian keep rate at suffix distance d follows scale * phi(k d / (window - 1))."""
    dpad = lj.DPadConfig(window=64, k=4.0, scale=2.0)
    keys = jax.random.split(jax.random.key(0), 4000)
    kept = np.asarray(sampling.dpad_keep(dpad, keys, jnp.int32(10), 100))
    assert kept[:, :10].all() and not kept[:, 74:].any()
    d = np.arange(64)
    want = 2.0 * np.exp(-0.5 * (4.0 * d / 63) ** 2) / np.sqrt(2 * np.pi)
    # 4000 Bernoulli draws: standard error <= 0.008; 5 sigma.
    np.testing.assert_allclose(kept[:, 10:74].mean(0), want, atol=0.04)
    uniform = lj.DPadConfig(strategy="uniform", window=64, keep=5)
    kept = np.asarray(sampling.dpad_keep(uniform, keys[:50], jnp.int32(10), 100))
    assert (kept[:, 10:74].sum(1) == 5).all() and not kept[:, 74:].any()


RAGGED = [[7, 8, 9, 10, 11], list(range(20, 29)), list(range(100, 113))]


@pytest.mark.parametrize("kw", [dict(), dict(cache="prefix", steps=12),
                                dict(cache="dual", threshold=0.9),
                                dict(factor=1.0, cfg_scale=1.0),
                                dict(cache="dual", dpad=lj.DPadConfig(window=10), temperature=1.0,
                                     remasking="random", steps=12)],
                         ids=["none", "prefix", "dual_threshold", "factor_cfg", "dual_dpad_random"])
def test_ragged_batch_row_equals_row_alone(models, kw):
    params, _ = models
    gen = _gen(**kw)
    keys = jax.random.split(jax.random.key(11), len(RAGGED))
    batch = lj.generate(params, CFG, RAGGED, gen, key=keys)
    P = max(map(len, RAGGED))
    assert batch.tokens.shape == (3, P + G)
    np.testing.assert_array_equal(np.asarray(batch.prompt_lengths), [5, 9, 13])
    for b, prompt in enumerate(RAGGED):
        alone = lj.generate(params, CFG, [prompt], gen, key=keys[b:b + 1])
        np.testing.assert_array_equal(np.asarray(batch.tokens[b, P - len(prompt):]),
                                      np.asarray(alone.tokens[0]))
        assert int(batch.nfe[b]) == int(alone.nfe[0])
        assert int(batch.steps[b]) == int(alone.steps[0])


@pytest.mark.parametrize("cache", ["exact", "dual"])
def test_unpadded_batch_attends_without_a_key_mask(models, monkeypatch, cache):
    """No row padded and no DPad (known on the host): the layers' attention gets no key mask
    (cuDNN's unmasked kernel on a GPU), with the tokens, NFE and steps of the masked path;
    a padded batch, or DPad's dropped suffix, still passes one to every call. exact's forwards
    take their mask in `_rest`, dual's first in `_forward` and its later in `query_layers`
    (none and prefix use those two as well)."""
    params, _ = models
    seen = []
    real = lj.model.attention

    def attention(q, k, v, key_mask_BS=None):
        seen.append(key_mask_BS is None)
        return real(q, k, v, key_mask_BS)
    monkeypatch.setattr(lj.model, "attention", attention)
    gen = _gen(cache=cache, steps=12)
    even = [PROMPT, PROMPT[::-1]]
    runs = {}
    for name, prompts, g in (("unpadded", even, gen), ("ragged", RAGGED, gen),
                             ("dpad", even, dataclasses.replace(
                                 gen, dpad=lj.DPadConfig(window=10)))):
        seen.clear()
        jax.clear_caches()  # trace again under the patched attention
        runs[name] = lj.generate(params, CFG, prompts, g, key=jax.random.key(3))
        assert seen and all(seen) == (name == "unpadded") and any(seen) == all(seen), (name, seen)
    # The same program with the mask forced back: an all-True mask weighs keys as none does.
    monkeypatch.setattr(lj.canvas.Canvas, "key_mask", lambda self, keep: self.dup(keep))
    jax.clear_caches()
    masked = lj.generate(params, CFG, even, gen, key=jax.random.key(3))
    for field in ("tokens", "nfe", "steps"):
        np.testing.assert_array_equal(np.asarray(getattr(runs["unpadded"], field)),
                                      np.asarray(getattr(masked, field)))


def test_array_with_prompt_lengths_equals_list(models):
    params, _ = models
    arr = np.zeros((3, 13), np.int32)
    for b, p in enumerate(RAGGED):
        arr[b, :len(p)] = p
    a = lj.generate(params, CFG, arr, _gen(threshold=0.9), prompt_lengths=[5, 9, 13])
    b = lj.generate(params, CFG, RAGGED, _gen(threshold=0.9))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


def test_stop_at_eos(models):
    """Take as 'EOS' a token row 0 first emits in its second block: with stop_at_eos that row
    matches the reference's early termination, fills the rest and saves passes, while row 1
    (which never emits it) runs on exactly as alone."""
    params, ref_model = models
    prompts = [RAGGED[1], PROMPT]
    full = lj.generate(params, CFG, prompts, _gen())
    P = max(map(len, prompts))
    gen_part = np.asarray(full.tokens)[:, P:]
    eos = next(t for t in gen_part[0, BL:2 * BL].tolist() if t not in gen_part[0, :BL])
    gen = _gen(stop_at_eos=True, eos_id=eos)
    out = lj.generate(params, CFG, prompts, gen)
    toks = np.asarray(out.tokens)
    np.testing.assert_array_equal(toks[0, :P + 2 * BL], np.asarray(full.tokens)[0, :P + 2 * BL])
    assert (toks[0, P + 2 * BL:] == eos).all()
    assert int(out.nfe[0]) == 2 * BL < int(full.nfe[0])
    first = int(np.argmax(gen_part[0] == eos))
    assert int(out.gen_lengths[0]) == first and out.answers()[0] == gen_part[0, :first].tolist()
    assert out.answers(G) == out.answers()  # the run's own length, named or not
    with pytest.raises(ValueError, match=f"answers\\(32\\): this output has gen_length {G}"):
        out.answers(32)
    unknown = dataclasses.replace(out, gen_length=0)  # built by hand: no length of its own
    with pytest.raises(ValueError, match="does not know its gen_length"):
        unknown.answers()
    assert unknown.answers(G) == out.answers()
    ref, ref_nfe = reference_generate(ref_model, prompts[0], gen_length=G, block_length=BL,
                                      steps=G, mask_id=CFG.mask_id, eos_id=eos, stop_at_eos=True)
    np.testing.assert_array_equal(toks[0, P - len(prompts[0]):], ref)
    assert int(out.nfe[0]) == ref_nfe
    assert eos not in gen_part[1]
    np.testing.assert_array_equal(toks[1], np.asarray(full.tokens)[1])
    assert int(out.nfe[1]) == G and int(out.gen_lengths[1]) == G


def test_random_remasking_and_temperature_invariants(models):
    params, _ = models
    gen = _gen(remasking="random", temperature=0.7, steps=9)  # 3, 3, 2 tokens per step
    a = lj.generate(params, CFG, [PROMPT], gen, key=jax.random.key(1))
    b = lj.generate(params, CFG, [PROMPT], gen, key=jax.random.key(1))
    c = lj.generate(params, CFG, [PROMPT], gen, key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))  # reproducible
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()  # the key matters
    assert int(a.steps[0]) == 9 and int(a.nfe[0]) == 9 and int(a.revealed[0]) == G
    assert not (np.asarray(a.tokens) == CFG.mask_id).any()
    # Per step, the fixed schedule reveals exactly its count, whatever the confidences.
    conf = jax.random.uniform(jax.random.key(0), (64, BL))
    masked = jax.random.bernoulli(jax.random.key(1), 0.7, (64, BL))
    k = jnp.minimum(masked.sum(-1), 3)
    np.testing.assert_array_equal(np.asarray(sampling.reveal_fixed(conf, masked, k).sum(-1)), k)


def test_transfer_schedule():
    np.testing.assert_array_equal(sampling.transfer_schedule(jnp.array([8, 7, 2]), 3),
                                  [[3, 3, 2], [3, 2, 2], [1, 1, 0]])


def test_factor_rule_quirk():
    # Two masks left: both go even when the second fails its threshold (released behaviour).
    conf = jnp.array([[0.9, 0.1, 0.0, 0.0]])
    masked = jnp.array([[True, True, False, False]])
    assert sampling.reveal_factor(conf, masked, None, 1.0).sum() == 2
    # Three masks: thr_1 = 1 - 1/3; c_1 = 0.5 fails first at i = 1 -> reveal 1.
    masked3 = jnp.array([[True, True, True, False]])
    conf3 = jnp.array([[0.9, 0.5, 0.4, 0.0]])
    assert sampling.reveal_factor(conf3, masked3, None, 1.0).sum() == 1
    # c_1 = 0.7 passes thr_1; c_2 = 0.1 fails at i = 2 = N - 1 -> all 3.
    conf3 = jnp.array([[0.9, 0.7, 0.1, 0.0]])
    assert sampling.reveal_factor(conf3, masked3, None, 1.0).sum() == 3


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_confidence_eos_eot_inf_as_released(temperature):
    """The released chained assignment, restated in torch: at T > 0 the noisy logits are a
    new float64 tensor, so only EoT leaves the confidence softmax (EOS keeps its share)."""
    eos, eot = 3, 5
    logits = jax.random.normal(jax.random.key(0), (2, 4, 8)) * 3
    x0 = jnp.argmax(logits, -1).at[0, 0].set(eos).at[1, 0].set(eot)
    ref_logits = torch.tensor(np.asarray(logits), dtype=torch.float64)
    noisy = ref_logits if temperature == 0 else ref_logits.clone()  # add_gumbel_noise
    noisy[..., eos] = ref_logits[..., eot] = -math.inf
    ref = torch.softmax(ref_logits, -1).gather(-1, torch.tensor(np.asarray(x0))[..., None])
    z = sampling.confidence(sampling.without_eos_eot(logits, eos, eot, temperature), x0,
                            "low_confidence", None)
    ours = np.asarray(jnp.exp(sampling.log_prob(z)))
    # fp32 log-odds vs float64 p (logits ~3: |z| < 30): a few fp32 ulps.
    np.testing.assert_allclose(ours, ref[..., 0].numpy(), rtol=1e-6, atol=1e-7)
    assert ours[1, 0] == 0.0 and (ours[0, 0] == 0.0) == (temperature == 0)


def test_eot_id_default():
    """LLaDA's <|eot_id|> where the vocabulary holds it (the reference hard-codes it), else
    confidence_eos_eot_inf needs an explicit eot_id."""
    gen = _gen(confidence_eos_eot_inf=True)
    assert gen.resolve(lj.llada_8b()).eot_id == 126348
    assert dataclasses.replace(gen, eot_id=7).resolve(lj.llada_8b()).eot_id == 7
    with pytest.raises(ValueError, match="confidence_eos_eot_inf needs eot_id"):
        gen.resolve(CFG)  # what lj.generate does first


@pytest.mark.parametrize("field,value,message", [
    ("block_length", 7, "block_length=7 does not divide gen_length=24"),
    ("steps", 10, "steps=10 is not divisible by the number of blocks 3"),
    ("steps", 0, "steps must be a positive integer"),
    ("gen_length", -8, "gen_length must be a positive integer"),
    ("threshold", 0.0, r"threshold must lie in \(0, 1\]"),
    ("threshold", 1.5, r"threshold must lie in \(0, 1\]"),
    ("factor", -1.0, "factor must be positive"),
    ("cache", "paged", "cache must be one of"),
    ("cache", ["dual"], "cache must be one of"),  # unhashable: ValueError, not TypeError
    ("remasking", "top", "remasking must be one of"),
    ("temperature", -0.1, "temperature must be >= 0"),
    ("cfg_scale", -1.0, "cfg_scale must be >= 0"),
    ("refresh_interval", 2, "refresh_interval applies to cache='dual' only"),
    ("refresh_interval", 0, "refresh_interval must be a positive integer"),
    ("dpad", {"window": 8}, "dpad must be a DPadConfig"),
    ("stop_at_eos", 1, "stop_at_eos must be a bool"),
    ("logits_eos_inf", "yes", "logits_eos_inf must be a bool"),
    ("confidence_eos_eot_inf", None, "confidence_eos_eot_inf must be a bool"),
    ("mask_id", -1, "mask_id must be a non-negative token id"),
    ("eos_id", 1.5, "eos_id must be a non-negative token id"),
    ("eot_id", "x", "eot_id must be a non-negative token id"),
    ("fp8_ffn", "on", "fp8_ffn must be a bool"),
])
def test_bad_generation_config(field, value, message):
    with pytest.raises(ValueError, match=message):
        _gen(**{field: value})


def test_bad_dpad_config():
    with pytest.raises(ValueError, match="dpad.strategy"):
        lj.DPadConfig(strategy="x")
    with pytest.raises(ValueError, match="dpad.window must be at least 2"):
        lj.DPadConfig(window=1)
    with pytest.raises(ValueError, match="dpad.scale must be a positive number"):
        lj.DPadConfig(scale=0)
    with pytest.raises(ValueError, match="threshold=0.9 and factor=1.0 are alternatives"):
        _gen(threshold=0.9, factor=1.0)


def test_bad_generate_arguments(models):
    params, _ = models
    gen = _gen()
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=512"):
        lj.generate(params, CFG, [[1] * 489], gen)
    with pytest.raises(ValueError, match=r"prompts\[1\] contains the mask id 319 at position 2"):
        lj.generate(params, CFG, [[1, 2], [3, 4, CFG.mask_id]], gen)
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        lj.generate(params, CFG, [[]], gen)
    with pytest.raises(ValueError, match="prompts is empty"):
        lj.generate(params, CFG, [], gen)
    with pytest.raises(ValueError, match=r"token ids outside \[0, 320\)"):
        lj.generate(params, CFG, [[1, 400]], gen)
    with pytest.raises(ValueError, match="prompt_lengths must lie"):
        lj.generate(params, CFG, np.ones((2, 4), np.int32), gen, prompt_lengths=[2, 5])
    with pytest.raises(ValueError, match="prompts must be an int array"):
        lj.generate(params, CFG, np.ones((4,), np.int32), gen)
    with pytest.raises(ValueError, match=r"key must be one key or one per row \(2\)"):
        lj.generate(params, CFG, [[1], [2]], gen, key=jax.random.split(jax.random.key(0), 3))
    with pytest.raises(ValueError, match="mask_id=400 is outside the model's vocabulary"):
        lj.generate(params, CFG, [[1]], dataclasses.replace(gen, mask_id=400))
    with pytest.raises(ValueError, match="gen must be a GenerationConfig"):
        lj.generate(params, CFG, [[1]], {"gen_length": 8})


@pytest.mark.parametrize("flash", [False, True])
def test_progress_is_reported_after_each_block_s_work(flash):
    """`progress(done, n)` fires once block `done` has been computed. Its callback took only
    the block counter, known when the block starts, so XLA ran it first: the bar ran a block
    ahead (seen: block 1 of 8 reported at 2% of the run, block 8 at 88%; now 14% and 100%).
    Equal blocks: report 1 must come after at least half a block's work, measured as the
    reports' own spacing, and the reports in order; the time before the loop and after it
    (the result's transfer, 15% of the run on a loaded CI machine) only delays report 1, so
    a correct loop cannot fail this. Flash-dLLM reports once, at the end: after half the
    run."""
    import time
    cfg = lj.tiny(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=512)
    params = lj.init_params(cfg, jax.random.key(0))
    gen = (lj.GenerationConfig(gen_length=64, threshold=0.9, stop_at_eos=False,
                               flash=lj.FlashConfig(window=4, lookahead=4, track=4)) if flash
           else lj.GenerationConfig(gen_length=64, block_length=8, steps=64, stop_at_eos=False))
    prompts = [list(range(5, 37))]
    lj.generate(params, cfg, prompts, gen, progress=lambda d, n: None)  # compiled here
    times = []
    start = time.perf_counter()
    lj.generate(params, cfg, prompts, gen,
                progress=lambda d, n: times.append((d, n, time.perf_counter() - start)))
    total = time.perf_counter() - start
    n = 1 if flash else 8
    assert [(d, m) for d, m, _ in times] == [(d, n) for d in range(1, n + 1)]
    at = [t for _, _, t in times]
    if flash:
        assert at[0] >= 0.5 * total, (at, total)
        return
    block = (at[-1] - at[0]) / (n - 1)
    assert all(b > a for a, b in zip(at, at[1:])), at
    # A block ahead, report 1 came before any block's work: at 2% of the run, 0.16 of a block
    assert at[0] >= 0.5 * block, [(d, round(t / total, 3)) for d, _, t in times]
