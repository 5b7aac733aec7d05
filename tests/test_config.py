"""ModelConfig from LLaDA config.json: every key read, every unsupported value refused by name."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import lacache_jax as lj
from lacache_jax.config import ConfigError, ModelConfig

# LLaDA-8B-Instruct's config.json, keys and values as REFERENCE.md §1 lists them (plus the
# code-default keys that ship in the file).
LLADA_8B_HF = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0,
    "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
    "d_model": 4096, "embedding_dropout": 0.0, "embedding_size": 126464,
    "eos_token_id": 126081, "flash_attention": False, "include_bias": False,
    "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
    "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
    "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": 126336,
    "max_sequence_length": 4096, "mlp_hidden_size": 12288, "mlp_ratio": 4,
    "model_type": "llada", "multi_query_attention": None, "n_heads": 32, "n_kv_heads": 32,
    "n_layers": 32, "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
    "scale_logits": False, "use_cache": False, "vocab_size": 126464, "weight_tying": False,
}


def test_llada_8b_config_json_matches_preset():
    cfg = ModelConfig.from_hf(LLADA_8B_HF)
    assert cfg == lj.llada_8b()
    assert cfg.head_dim == 128
    assert cfg.n_params == 8_015_581_184  # REFERENCE.md §2


def test_round_trip_through_hf_dict():
    for cfg in (lj.tiny(), lj.tiny(n_kv_heads=2), lj.tiny(tie_embeddings=True), lj.llada_8b()):
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("key,value", [
    ("alibi", True), ("rope", False), ("rope_full_precision", False), ("include_bias", True),
    ("include_qkv_bias", True), ("bias_for_layer_norm", True), ("attention_layer_norm", True),
    ("layer_norm_type", "default"), ("layer_norm_with_affine", False), ("block_type", "sequential"),
    ("activation_type", "gelu"), ("input_emb_norm", True), ("scale_logits", True),
    ("block_group_size", 2), ("clip_qkv", 8.0), ("rope_scaling", {"type": "linear"}),
])
def test_unsupported_values_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=f"unsupported value {key}="):
        ModelConfig.from_hf({**LLADA_8B_HF, key: value})


@pytest.mark.parametrize("key", ["d_model", "n_heads", "n_layers", "rope_theta", "rms_norm_eps",
                                 "max_sequence_length", "vocab_size", "mask_token_id",
                                 "eos_token_id", "pad_token_id", "block_type", "activation_type",
                                 "layer_norm_type", "rope", "embedding_size", "weight_tying"])
def test_missing_required_key(key):
    """Every key whose LLaDA code default (configuration_llada.ModelConfig: rope_theta 10000,
    pad 50256, block_type "sequential", activation "swiglu", a LayerNorm, no RoPE, 50304
    embeddings, tied weights) is not LLaDA-8B's value is required: a config.json without it
    describes another model to LLaDA's own code."""
    hf = dict(LLADA_8B_HF)
    del hf[key]
    with pytest.raises(ConfigError, match=f"missing required key '{key}'"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("key", ["alibi", "include_bias", "include_qkv_bias",
                                 "attention_layer_norm", "layer_norm_with_affine",
                                 "rope_full_precision", "bias_for_layer_norm", "input_emb_norm",
                                 "scale_logits", "block_group_size", "multi_query_attention",
                                 "n_kv_heads"])
def test_keys_whose_llada_default_is_ours_may_be_missing(key):
    hf = dict(LLADA_8B_HF)
    del hf[key]
    assert ModelConfig.from_hf(hf) == lj.llada_8b()


def test_wrong_types_and_values():
    with pytest.raises(ConfigError, match="'d_model' has value '4096' of the wrong type"):
        ModelConfig.from_hf({**LLADA_8B_HF, "d_model": "4096"})
    with pytest.raises(ConfigError, match="n_heads=32 is not divisible by n_kv_heads=5"):
        ModelConfig.from_hf({**LLADA_8B_HF, "n_kv_heads": 5})
    with pytest.raises(ConfigError, match="embedding_size=100 is smaller than vocab_size"):
        ModelConfig.from_hf({**LLADA_8B_HF, "embedding_size": 100})
    with pytest.raises(ConfigError, match=r"mask_id=126336 is not a token id in \[0, 1000\)"):
        ModelConfig.from_hf({**LLADA_8B_HF, "vocab_size": 1000, "embedding_size": None,
                             "eos_token_id": 1, "pad_token_id": 1})
    with pytest.raises(ConfigError, match="weight_tying"):
        ModelConfig.from_hf({**LLADA_8B_HF, "weight_tying": "no"})
    for key, value in (("rope_theta", float("nan")), ("rms_norm_eps", float("inf"))):
        name = {"rope_theta": "rope_theta", "rms_norm_eps": "norm_eps"}[key]
        with pytest.raises(ConfigError, match=f"{name} must be a positive finite number"):
            ModelConfig.from_hf({**LLADA_8B_HF, key: value})
    with pytest.raises(ConfigError, match="'rope_theta' has value 1000* out of range"):
        ModelConfig.from_hf({**LLADA_8B_HF, "rope_theta": 10 ** 400})
    with pytest.raises(ConfigError, match="mask_id=126081 must differ from eos_id=126081"):
        ModelConfig.from_hf({**LLADA_8B_HF, "mask_token_id": 126081})


def test_gqa_mqa_and_defaults():
    assert ModelConfig.from_hf({**LLADA_8B_HF, "n_kv_heads": 8}).n_kv_heads == 8
    assert ModelConfig.from_hf({**LLADA_8B_HF, "n_kv_heads": None}).n_kv_heads == 32
    # multi_query_attention as LLaDA's effective_n_kv_heads reads it: used when n_kv_heads is
    # unset, and refused when it contradicts n_kv_heads.
    mqa = {**LLADA_8B_HF, "multi_query_attention": True, "n_kv_heads": None}
    assert ModelConfig.from_hf(mqa).n_kv_heads == 1
    assert ModelConfig.from_hf({**mqa, "n_kv_heads": 1}).n_kv_heads == 1
    assert ModelConfig.from_hf({**mqa, "multi_query_attention": False}).n_kv_heads == 32
    for flag, n_kv in ((True, 32), (False, 8)):
        with pytest.raises(ConfigError, match=f"multi_query_attention={flag} contradicts "
                                              f"n_kv_heads={n_kv}"):
            ModelConfig.from_hf({**mqa, "multi_query_attention": flag, "n_kv_heads": n_kv})
    hf = {**LLADA_8B_HF, "mlp_hidden_size": None, "mlp_ratio": 2}
    assert ModelConfig.from_hf(hf).d_ff == 8192
    hf = {**LLADA_8B_HF, "embedding_size": 126500}
    assert ModelConfig.from_hf(hf).vocab_size == 126500
    hf = {**LLADA_8B_HF, "embedding_size": None}  # null: LLaDA's code uses vocab_size
    assert ModelConfig.from_hf(hf).vocab_size == 126464
    assert ModelConfig.from_hf({**LLADA_8B_HF, "pad_token_id": None}).pad_id == 126081  # EOS


def test_from_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig.from_hf_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({**LLADA_8B_HF, "alibi": True}))
    with pytest.raises(ConfigError, match=r"config.json: unsupported value alibi=True"):
        ModelConfig.from_hf_file(tmp_path / "config.json")


def test_from_dict_rejects_unknown_and_missing_fields():
    with pytest.raises(ConfigError, match="unknown config field"):
        ModelConfig.from_dict({**lj.tiny().to_dict(), "extra": 1})
    d = lj.tiny().to_dict()
    del d["d_model"]
    with pytest.raises(ConfigError, match="missing config field.*d_model"):
        ModelConfig.from_dict(d)


def test_config_is_hashable_for_jit():
    assert hash(lj.tiny()) == hash(lj.tiny())


def test_numpy_scalars_are_plain_numbers_and_infinities_refused():
    """Settings computed with NumPy (np.int64, np.float32) are accepted and stored as Python
    numbers, so configs built either way are equal and hash alike; inf is refused by name."""
    plain = lj.GenerationConfig(gen_length=24, block_length=8, steps=24, threshold=0.5,
                                dpad=lj.DPadConfig(window=np.int64(16), keep=np.int32(4)))
    numpy = lj.GenerationConfig(gen_length=np.int64(24), block_length=np.int32(8),
                                steps=np.int64(24), threshold=np.float32(0.5),
                                stop_at_eos=np.bool_(True),
                                dpad=lj.DPadConfig(window=16, keep=4))
    assert numpy == plain and hash(numpy) == hash(plain)
    assert type(numpy.gen_length) is int and type(numpy.threshold) is float
    assert type(numpy.stop_at_eos) is bool and type(plain.dpad.window) is int
    assert lj.FlashConfig(window=np.int64(4), gamma=np.float64(0.5)) == lj.FlashConfig(
        window=4, gamma=0.5)
    # a float keeps the value it holds: float32's 0.9 is not 0.9
    assert lj.GenerationConfig(threshold=np.float32(0.9)).threshold == float(np.float32(0.9))
    for field, value in (("temperature", math.inf), ("cfg_scale", math.inf),
                         ("temperature", 10 ** 400)):  # beyond float: OverflowError inside
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            lj.GenerationConfig(**{field: value})
    with pytest.raises(ValueError, match="flash.gamma must be a finite number"):
        lj.FlashConfig(gamma=math.inf)
