"""Forward-pass parity against the independent PyTorch reference (transformers Llama with
LLaDA weights and a bidirectional mask), through the real checkpoint path:
HF-layout files -> `python -m convert` -> `lj.load` -> `lj.forward`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lacache_jax as lj
from convert.__main__ import main as convert_main
from tests.conftest import hf_llama, hf_logits, random_llada_state, rel_err, write_hf_llada

# fp32 vs fp32: both sides accumulate in fp32 and differ only in summation order and in
# libm's sin/cos/exp by an ulp, so errors stay near 1e-7 relative; 1e-5 is the spec's bound.
FP32_REL = 1e-5


def _converted(tmp_path, cfg, seed=0, dtype="float32"):
    state = random_llada_state(cfg, seed)
    src = write_hf_llada(tmp_path / "hf", cfg, state)
    assert convert_main([str(src), str(tmp_path / "ckpt"), "--dtype", dtype, "--quiet"]) == 0
    config, params = lj.load(tmp_path / "ckpt")
    return state, config, params


def _tokens(cfg, B, L, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, L)).astype(np.int32)


@pytest.mark.parametrize("cfg", [lj.tiny(), lj.tiny(n_heads=8, n_kv_heads=2, d_model=128)],
                         ids=["mha", "gqa"])
def test_fp32_parity(tmp_path, cfg):
    state, config, params = _converted(tmp_path, cfg)
    assert config == cfg and params.dtype == jnp.float32
    tokens = _tokens(cfg, 2, 48)
    ours = np.asarray(lj.forward(params, config, tokens))
    ref = hf_logits(hf_llama(cfg, state, _torch_dtype("float32")), tokens)
    assert ours.shape == (2, 48, cfg.vocab_size)
    assert rel_err(ours, ref) <= FP32_REL


def test_fp32_parity_key_padding_and_positions(tmp_path):
    cfg = lj.tiny(n_heads=8, n_kv_heads=4, d_model=128)
    state, config, params = _converted(tmp_path, cfg, seed=1)
    tokens = _tokens(cfg, 3, 40, seed=1)
    pad = np.array([0, 7, 19])  # left padding per row
    key_mask = np.arange(40)[None, :] >= pad[:, None]
    positions = np.maximum(np.arange(40)[None, :] - pad[:, None], 0).astype(np.int32)
    model = hf_llama(cfg, state, _torch_dtype("float32"))
    for kw in (dict(key_mask=key_mask), dict(key_mask=key_mask, positions=positions)):
        ours = np.asarray(lj.forward(params, config, tokens, attention_mask=kw["key_mask"],
                                     positions=kw.get("positions")))
        assert rel_err(ours, hf_logits(model, tokens, **kw)) <= FP32_REL
    # The mask matters: without it the real rows change.
    unmasked = np.asarray(lj.forward(params, config, tokens))
    ref = hf_logits(model, tokens, key_mask)
    assert rel_err(unmasked[1:, 20:], ref[1:, 20:]) > 1e-3


def test_bf16_parity(tmp_path):
    cfg = lj.tiny(n_heads=8, n_kv_heads=2, d_model=128, n_layers=3)
    state, config, params = _converted(tmp_path, cfg, seed=2, dtype="bfloat16")
    assert params.dtype == jnp.bfloat16
    tokens = _tokens(cfg, 2, 64, seed=2)
    ours = np.asarray(lj.forward(params, config, tokens).astype(jnp.float32))
    ref = hf_logits(hf_llama(cfg, state, _torch_dtype("bfloat16")), tokens)
    exact = hf_logits(hf_llama(cfg, state, _torch_dtype("float32")), tokens)
    # bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3). The weights themselves are
    # rounded to bf16 (the fp32 run keeps them exact); each side also rounds after every
    # matmul, norm, RoPE (transformers rounds cos/sin to bf16, we rotate in fp32) and residual
    # add, in different orders: through 3 layers and the head that compounds to ~1e-2 of the
    # logits' norm for either side against fp32, so the two bf16 runs differ by up to ~3e-2.
    assert rel_err(ours, exact) <= 3e-2
    assert rel_err(ours, ref) <= 3e-2
    # Argmax must agree wherever the fp32 top-2 margin exceeds both sides' worst bf16 error.
    bound = np.abs(ours - exact).max() + np.abs(ref - exact).max()
    top2 = np.sort(exact, axis=-1)[..., -2:]
    decisive = (top2[..., 1] - top2[..., 0]) > bound
    assert decisive.mean() > 0.5  # the check is not vacuous
    assert (ours.argmax(-1) == ref.argmax(-1))[decisive].all()


def test_nnx_module_matches_forward():
    cfg = lj.tiny()
    module = lj.LLaDA.random(cfg, jax.random.key(3), jnp.float32)
    tokens = _tokens(cfg, 2, 16, seed=3)
    # Eager vs jitted execution fuses differently: fp32 rounding-level differences only.
    assert rel_err(module(jnp.asarray(tokens)), lj.forward(module.weights(), cfg, tokens)) < 1e-6


def test_forward_rejects_bad_input():
    cfg = lj.tiny()
    params = lj.init_params(cfg, jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="tokens must be an integer array"):
        lj.forward(params, cfg, np.zeros((2, 3, 4), np.int32))
    with pytest.raises(ValueError, match="tokens must be an integer array"):
        lj.forward(params, cfg, np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 320\)"):
        lj.forward(params, cfg, np.full((1, 4), 320))
    with pytest.raises(ValueError, match="exceeds max_seq_len=512"):
        lj.forward(params, cfg, np.zeros((1, 513), np.int32))
    with pytest.raises(ValueError, match="non-empty"):
        lj.forward(params, cfg, np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="attention_mask has shape"):
        lj.forward(params, cfg, np.zeros((1, 4), np.int32), attention_mask=np.ones((1, 5)))
    with pytest.raises(ValueError, match="positions must be integers"):
        lj.forward(params, cfg, np.zeros((1, 4), np.int32), positions=np.zeros((1, 4)))
    with pytest.raises(ValueError, match="params has 2 layers, config says 3"):
        lj.forward(params, lj.tiny(n_layers=3), np.zeros((1, 4), np.int32))


def test_forward_under_jit_with_traced_tokens():
    cfg = lj.tiny()
    params = lj.init_params(cfg, jax.random.key(0), jnp.float32)
    tokens = _tokens(cfg, 1, 8)
    jitted = jax.jit(lambda p, t: lj.forward(p, cfg, t))
    np.testing.assert_array_equal(np.asarray(jitted(params, tokens)),
                                  np.asarray(lj.forward(params, cfg, tokens)))


def _torch_dtype(name):
    import torch
    return getattr(torch, name)


def test_params_checked_against_the_config():
    """Every leaf against the config, before tracing: a message naming the leaf and both
    shapes (a d_model mismatch used to die deep in XLA, heads or vocab ran silently)."""
    import dataclasses

    import pytest
    cfg = lj.tiny(d_model=64, n_heads=4, n_kv_heads=2)
    params = lj.init_params(cfg, jax.random.key(0), jnp.float32)
    tokens = np.zeros((1, 4), np.int32)
    gen = lj.GenerationConfig(gen_length=4, block_length=4, steps=4)
    wrong = {"d_model": dict(d_model=128), "heads": dict(n_heads=8),
             "kv_heads": dict(n_kv_heads=4), "vocab": dict(vocab_size=330),
             "d_ff": dict(d_ff=96)}
    for name, change in wrong.items():
        other = dataclasses.replace(cfg, **change)
        for call in (lambda: lj.forward(params, other, tokens),
                     lambda: lj.generate(params, other, [[1, 2]], gen)):
            with pytest.raises(ValueError, match=r"params\.\S+ has shape \(.*\) but the config "
                                                 r"\(d_model=.*\) needs \("):
                call()
    mixed = dataclasses.replace(params, layers=[
        dataclasses.replace(params.layers[0], wo=params.layers[0].wo.astype(jnp.bfloat16)),
        *params.layers[1:]])
    with pytest.raises(ValueError, match=r"params\.layers\[0\]\.wo is bfloat16 but params\.embed"
                                         r" is float32"):
        lj.forward(mixed, cfg, tokens)
