"""Model configuration: read from a LLaDA `config.json`, validated once, hashable for `jit`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np


WEIGHT_DTYPES = ("bfloat16", "float32")  # what checkpoints store and weights load as


class ConfigError(ValueError):
    """A config value is missing, malformed or describes a model we do not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of a LLaDA model (REFERENCE.md §1).

    `vocab_size` is the number of embedding rows and logit columns (LLaDA's `embedding_size`
    when set, which may exceed the tokenizer's vocabulary).
    """

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    rope_theta: float
    norm_eps: float
    max_seq_len: int
    mask_id: int
    eos_id: int
    pad_id: int
    tie_embeddings: bool = False

    def __post_init__(self):
        _python_scalars(self)
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                     "max_seq_len"):
            _positive_int(getattr(self, name), name, ConfigError)
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 < value < math.inf):
                raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
        for name in ("mask_id", "eos_id", "pad_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    0 <= value < self.vocab_size):
                raise ConfigError(f"{name}={value!r} is not a token id in [0, {self.vocab_size})")
        if self.mask_id in (self.eos_id, self.pad_id):
            raise ConfigError(f"mask_id={self.mask_id} must differ from eos_id={self.eos_id} "
                              f"and pad_id={self.pad_id}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_params(self) -> int:
        D, F, V, hd = self.d_model, self.d_ff, self.vocab_size, self.head_dim
        attn = D * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        per_layer = attn + 3 * D * F + 2 * D
        head = 0 if self.tie_embeddings else V * D
        return V * D + self.n_layers * per_layer + D + head

    # --- Hugging Face LLaDA config.json -------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a LLaDA `config.json` dict; refuse every feature we do not implement."""
        return cls(**_read_hf(hf))

    @classmethod
    def from_hf_file(cls, path: str | os.PathLike) -> "ModelConfig":
        try:
            with open(path) as f:
                hf = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        try:
            return cls.from_hf(hf)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """A LLaDA-style `config.json` dict describing this model."""
        return {
            "architectures": ["LLaDAModelLM"], "model_type": "llada",
            "d_model": self.d_model, "n_layers": self.n_layers, "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads, "mlp_hidden_size": self.d_ff,
            "mlp_ratio": max(1, self.d_ff // self.d_model),
            "vocab_size": self.vocab_size, "embedding_size": self.vocab_size,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.norm_eps,
            "max_sequence_length": self.max_seq_len, "mask_token_id": self.mask_id,
            "eos_token_id": self.eos_id, "pad_token_id": self.pad_id,
            "weight_tying": self.tie_embeddings, **_SUPPORTED_FIXED,
        }

    # --- our own checkpoint metadata ----------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(d) - names):
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        if missing := sorted(f.name for f in dataclasses.fields(cls)
                             if f.name not in d and f.default is dataclasses.MISSING):
            raise ConfigError(f"missing config field(s): {', '.join(missing)}")
        return cls(**d)


# Keys whose value must be exactly this (the only variant implemented). Those in
# `_LLADA_DEFAULTS` must be present (their LLaDA code default describes another model); a
# missing key of the rest is accepted: LLaDA's code default is the value below.
_SUPPORTED_FIXED: dict[str, Any] = {
    "block_type": "llama",
    "activation_type": "silu",
    "layer_norm_type": "rms",
    "rope": True,
    "layer_norm_with_affine": True,
    "alibi": False,
    "rope_full_precision": True,
    "include_bias": False,
    "include_qkv_bias": False,
    "bias_for_layer_norm": False,
    "attention_layer_norm": False,
    "input_emb_norm": False,
    "scale_logits": False,
    "block_group_size": 1,
}
# Keys that must be absent or null.
_SUPPORTED_NULL = ("clip_qkv", "rope_scaling")


def _require(hf: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in hf or hf[key] is None:
        raise ConfigError(f"missing required key {key!r}")
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"key {key!r} has value {value!r} of the wrong type")
    return value


# LLaDA's code defaults (configuration_llada.ModelConfig) of the keys that must be present
# because these defaults are not what we implement (a LayerNorm, no RoPE, ...);
# named in the error.
_LLADA_DEFAULTS = {"block_type": "sequential", "activation_type": "swiglu",
                   "layer_norm_type": "default", "rope": False, "embedding_size": 50304,
                   "weight_tying": True, "pad_token_id": 50256}


def _float(value: int | float, key: str) -> float:
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        raise ConfigError(f"key {key!r} has value {value} out of range") from None


def _kv_heads(hf: dict[str, Any], n_heads: int) -> int:
    """LLaDA's `effective_n_kv_heads`: n_kv_heads, else 1 with multi_query_attention, else
    n_heads; both set must agree (n_kv_heads 1 with it true, n_heads with it false)."""
    mqa = hf.get("multi_query_attention")
    if mqa is not None and not isinstance(mqa, bool):
        raise ConfigError(f"key 'multi_query_attention' has value {mqa!r} of the wrong type")
    if hf.get("n_kv_heads") is None:
        return 1 if mqa else n_heads
    n_kv_heads = _require(hf, "n_kv_heads", int)
    if mqa is not None and n_kv_heads != (1 if mqa else n_heads):
        raise ConfigError(f"multi_query_attention={mqa} contradicts n_kv_heads={n_kv_heads} "
                          f"(with n_heads={n_heads}); LLaDA's code refuses this too")
    return n_kv_heads


def _read_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if "d_model" not in hf and "hidden_size" in hf:  # transformers' naming: not LLaDA's
        kind = hf.get("model_type") or (hf.get("architectures") or ["?"])[0]
        raise ConfigError(f"a {kind} config (hidden_size, not LLaDA's d_model): only LLaDA "
                          "checkpoints (model_type llada, LLaDAModelLM) convert")
    for key, default in _LLADA_DEFAULTS.items():
        if key not in hf:
            raise ConfigError(f"missing required key {key!r} (LLaDA's code default, "
                              f"{default!r}, " + ("is not implemented)" if key in
                                                  _SUPPORTED_FIXED else "would apply)"))
    for key, want in _SUPPORTED_FIXED.items():
        # bias_for_layer_norm may be null in LLaDA configs (falls back to include_bias).
        if key in hf and not (hf[key] is None and key == "bias_for_layer_norm") and (
                hf[key] != want or type(hf[key]) is not type(want)):
            raise ConfigError(f"unsupported value {key}={hf[key]!r} (only {want!r} is implemented)")
    for key in _SUPPORTED_NULL:
        if hf.get(key) is not None:
            raise ConfigError(f"unsupported value {key}={hf[key]!r} (only null is implemented)")

    d_model = _require(hf, "d_model", int)
    n_heads = _require(hf, "n_heads", int)
    n_kv_heads = _kv_heads(hf, n_heads)
    if hf.get("mlp_hidden_size") is not None:
        d_ff = _require(hf, "mlp_hidden_size", int)
    else:
        d_ff = _require(hf, "mlp_ratio", int) * d_model
    vocab = _require(hf, "vocab_size", int)
    if hf["embedding_size"] is not None:  # null: LLaDA's code uses vocab_size
        embedding_size = _require(hf, "embedding_size", int)
        if embedding_size < vocab:
            raise ConfigError(f"embedding_size={embedding_size} is smaller than vocab_size={vocab}")
        vocab = embedding_size
    weight_tying = hf["weight_tying"]
    if not isinstance(weight_tying, bool):
        raise ConfigError(f"key 'weight_tying' has value {weight_tying!r} of the wrong type")
    eos_id = _require(hf, "eos_token_id", int)
    return dict(
        d_model=d_model, n_layers=_require(hf, "n_layers", int), n_heads=n_heads,
        n_kv_heads=n_kv_heads, d_ff=d_ff, vocab_size=vocab,
        rope_theta=_float(_require(hf, "rope_theta", (int, float)), "rope_theta"),
        norm_eps=_float(_require(hf, "rms_norm_eps", (int, float)), "rms_norm_eps"),
        max_seq_len=_require(hf, "max_sequence_length", int),
        mask_id=_require(hf, "mask_token_id", int), eos_id=eos_id,
        pad_id=(eos_id if hf["pad_token_id"] is None  # null: LLaDA's code allows it; EOS pads
                else _require(hf, "pad_token_id", int)),
        tie_embeddings=weight_tying,
    )


# Every config.json key `_read_hf` reads or requires (convert warns about the others).
HF_KEYS_READ = frozenset({
    "d_model", "n_layers", "n_heads", "n_kv_heads", "multi_query_attention", "mlp_hidden_size",
    "mlp_ratio", "vocab_size", "embedding_size", "weight_tying", "rope_theta", "rms_norm_eps",
    "max_sequence_length", "mask_token_id", "eos_token_id", "pad_token_id", *_SUPPORTED_FIXED,
    *_SUPPORTED_NULL})


# --- presets ---------------------------------------------------------------------------

LLADA_EOT_ID = 126348  # <|eot_id|>: not in config.json; LLaDA's sampler hard-codes it


def llada_8b() -> ModelConfig:
    """LLaDA-8B (Base, Instruct) and LLaDA-1.5: REFERENCE.md §1."""
    return ModelConfig(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=12288,
                       vocab_size=126464, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=4096,
                       mask_id=126336, eos_id=126081, pad_id=126081)


def tiny(**overrides: Any) -> ModelConfig:
    """A small LLaDA-shaped config for CPU tests; special ids sit at the top of its vocabulary."""
    base = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=160, vocab_size=320,
                rope_theta=500000.0, norm_eps=1e-5, max_seq_len=512,
                mask_id=319, eos_id=318, pad_id=318)
    base.update(overrides)
    return ModelConfig(**base)


# --- generation ------------------------------------------------------------------------

REMASKING = ("low_confidence", "random")


@dataclasses.dataclass(frozen=True)
class DPadConfig:
    """DPad suffix dropout (REFERENCE.md §6), drawn once per block from the JAX key.

    `gaussian`: keep suffix position at distance d < window with probability
    `scale * phi(k * d / (window - 1))`; `uniform`: keep `keep` positions drawn uniformly
    inside the window. Positions beyond the window are dropped, but for one quirk of DPad's
    sampler, kept: uniform keeps a suffix of at most `keep` columns whole.
    """
    strategy: str = "gaussian"
    window: int = 256
    k: float = 4.0
    scale: float = 2.0
    keep: int = 32

    def __post_init__(self):
        _python_scalars(self)
        if self.strategy not in ("gaussian", "uniform"):
            raise ValueError(
                f"dpad.strategy must be 'gaussian' or 'uniform', got {self.strategy!r}")
        _positive_int(self.window, "dpad.window")
        if self.window < 2:
            raise ValueError(f"dpad.window must be at least 2, got {self.window}")
        _positive_int(self.keep, "dpad.keep")
        for name in ("k", "scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"dpad.{name} must be a positive number, got {v!r}")


ACCEPT_RULES = ("cumprod", "agree")


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Flash-dLLM decoding (REFERENCE.md §8): a sliding window with selective cache refresh.

    Each step decodes from the `window` left-most undecoded positions and re-queries only a
    bounded set of positions through every layer: the window, the next `lookahead` undecoded
    positions after it, and `track` decoded positions (those accepted last, then the most
    attended older ones: lacache_jax/flash.py); every other position's keys and values come
    from the cache as last written. `GenerationConfig.threshold` is the acceptance epsilon.

    `lookahead` defaults to 48, not the paper's 64: the released code's `mask_num` counts the
    window itself, so its look-ahead is window * (mask_num - 1) = 16 * 3 = 48 masks at the
    published setting (tests/reference_flash.py). `track=None` re-queries every position
    outside the window, masks and decoded (a full recompute, whatever `lookahead` says);
    `lookahead=None` queries every undecoded position. The released code always takes the
    argmax; here `GenerationConfig.temperature` > 0 draws the window's tokens with Gumbel
    noise as the block decoders do (an extension: parity holds at temperature 0).

    `verify=True` adds Flash-Verify: after the draft pass's acceptance, a second forward per
    step over [tracked | drafts | masks] of the next `window // 2` (at most) rejected window
    positions checks the drafts (`accept`: "cumprod", the released code's rule, accepts the
    longest prefix, in draft-confidence order, whose cumulative product of mask-view
    probabilities of the drafts is >= `gamma`; "agree", the paper's, accepts while the
    mask-view argmax equals the draft with probability >= `gamma`). Each step then counts two
    forwards. `gamma` > 1 accepts nothing (a cost check); it needs `window` >= 2.
    """
    window: int = 16
    lookahead: int | None = 48
    track: int | None = 64
    verify: bool = False
    gamma: float = 0.8
    accept: str = "cumprod"

    def __post_init__(self):
        _python_scalars(self)
        _positive_int(self.window, "flash.window")
        for name in ("lookahead", "track"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"flash.{name} must be None or a non-negative integer, "
                                 f"got {v!r}")
        if not isinstance(self.verify, bool):
            raise ValueError(f"flash.verify must be a bool, got {self.verify!r}")
        _number(self.gamma, "flash.gamma")
        if not self.gamma > 0:
            raise ValueError(f"flash.gamma must be positive, got {self.gamma}")
        if self.accept not in ACCEPT_RULES:
            raise ValueError(f"flash.accept must be one of {ACCEPT_RULES}, got {self.accept!r}")
        if self.verify and self.window < 2:
            raise ValueError(f"flash.window must be >= 2 with flash.verify (it checks up to "
                             f"window // 2 candidates), got {self.window}")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Static settings of one jitted generation program (hashable; validated on creation).

    The fixed schedule (LLaDA) applies when neither `threshold` nor `factor` is set: each block
    takes `steps // (gen_length // block_length)` steps. With `threshold` or `factor`
    (Fast-dLLM), a block takes as many steps as it needs. `mask_id`/`eos_id` default to the
    model's; `eot_id` (only read by `confidence_eos_eot_inf`) defaults to LLaDA's `<|eot_id|>`,
    126348, which the reference hard-codes, when the vocabulary holds it.
    """
    gen_length: int = 256
    block_length: int = 32
    steps: int = 256
    temperature: float = 0.0
    remasking: str = "low_confidence"
    threshold: float | None = None
    factor: float | None = None
    cache: str = "none"
    refresh_interval: int | None = None
    dpad: DPadConfig | None = None
    fp8_ffn: bool = False
    stop_at_eos: bool = True
    cfg_scale: float = 0.0
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    mask_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    flash: FlashConfig | None = None

    def __post_init__(self):
        _python_scalars(self)
        _positive_int(self.gen_length, "gen_length")
        _positive_int(self.block_length, "block_length")
        _positive_int(self.steps, "steps")
        if self.flash is not None:
            self._check_flash()
        elif self.gen_length % self.block_length:
            raise ValueError(f"block_length={self.block_length} does not divide "
                             f"gen_length={self.gen_length}")
        if self.flash is None and self.steps % self.num_blocks:
            raise ValueError(f"steps={self.steps} is not divisible by the number of blocks "
                             f"{self.num_blocks} (gen_length / block_length)")
        _number(self.temperature, "temperature", lo=0.0)
        _number(self.cfg_scale, "cfg_scale", lo=0.0)
        if self.remasking not in REMASKING:
            raise ValueError(f"remasking must be one of {REMASKING}, got {self.remasking!r}")
        if self.threshold is not None:
            _number(self.threshold, "threshold")
            if not 0.0 < self.threshold <= 1.0:
                raise ValueError(f"threshold must lie in (0, 1], got {self.threshold}")
        if self.factor is not None:
            _number(self.factor, "factor")
            if not self.factor > 0:
                raise ValueError(f"factor must be positive, got {self.factor}")
        if self.threshold is not None and self.factor is not None:
            raise ValueError(f"threshold={self.threshold} and factor={self.factor} are "
                             "alternatives: set at most one")
        from lacache_jax.cache import POLICIES  # the policy table owns the names
        if not isinstance(self.cache, str) or self.cache not in POLICIES:  # [..]: unhashable
            raise ValueError(f"cache must be one of {tuple(POLICIES)}, got {self.cache!r}")
        for name in ("stop_at_eos", "logits_eos_inf", "confidence_eos_eot_inf", "fp8_ffn"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.refresh_interval is not None:
            _positive_int(self.refresh_interval, "refresh_interval")
            if self.cache != "dual":
                raise ValueError("refresh_interval applies to cache='dual' only")
        if self.dpad is not None and not isinstance(self.dpad, DPadConfig):
            raise ValueError(f"dpad must be a DPadConfig or None, got {type(self.dpad).__name__}")
        for name in ("mask_id", "eos_id", "eot_id"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be a non-negative token id, got {v!r}")

    def _check_flash(self) -> None:
        """With `flash`, only the settings Flash-dLLM reads may differ from their defaults."""
        if not isinstance(self.flash, FlashConfig):
            raise ValueError(f"flash must be a FlashConfig or None, got "
                             f"{type(self.flash).__name__}")
        if self.threshold is None:
            raise ValueError("threshold is required with flash (it is the acceptance epsilon, "
                             "e.g. threshold=0.9)")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        if self.block_length not in (defaults["block_length"], self.gen_length):
            raise ValueError(f"block_length={self.block_length} does not apply with flash "
                             "(it decodes from a sliding window, not blocks): leave it unset")
        for name, why in (("steps", "decoding runs until every position is decoded"),
                          ("factor", "acceptance is the threshold rule"),
                          ("cache", "flash keeps its own K/V cache"),
                          ("refresh_interval", "flash refreshes the cache rows it queries"),
                          ("dpad", "flash queries a bounded look-ahead instead"),
                          ("cfg_scale", "classifier-free guidance is not implemented with it"),
                          ("remasking", "confidence is the window's softmax probability"),
                          ("logits_eos_inf", "not implemented with it"),
                          ("confidence_eos_eot_inf", "not implemented with it")):
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"{name}={getattr(self, name)!r} does not apply with flash "
                                 f"({why}): leave it at {defaults[name]!r}")

    @property
    def num_blocks(self) -> int:
        """Blocks of the SAR loop; 1 with flash (progress reports the whole generation)."""
        if self.flash is not None:
            return 1
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    @property
    def parallel(self) -> bool:
        return self.threshold is not None or self.factor is not None

    @property
    def reveal_rule(self) -> str:
        """The name of the reveal rule in `sampling.REVEAL_RULES`."""
        return ("threshold" if self.threshold is not None else
                "factor" if self.factor is not None else "fixed")

    @property
    def reveal_value(self) -> float | None:
        """The reveal rule's setting (None for the fixed schedule)."""
        return self.threshold if self.threshold is not None else self.factor

    def resolve(self, model: ModelConfig) -> "GenerationConfig":
        """Fill `mask_id`/`eos_id` from the model (and `eot_id`, see the class docstring);
        check every id lies in its vocabulary."""
        eot_id = self.eot_id
        if self.confidence_eos_eot_inf and eot_id is None:
            if model.vocab_size <= LLADA_EOT_ID:
                raise ValueError("confidence_eos_eot_inf needs eot_id: this vocabulary has no "
                                 f"LLaDA <|eot_id|> ({LLADA_EOT_ID})")
            eot_id = LLADA_EOT_ID
        out = dataclasses.replace(
            self, mask_id=model.mask_id if self.mask_id is None else self.mask_id,
            eos_id=model.eos_id if self.eos_id is None else self.eos_id, eot_id=eot_id)
        for name in ("mask_id", "eos_id", "eot_id"):
            v = getattr(out, name)
            if v is not None and v >= model.vocab_size:
                raise ValueError(f"{name}={v} is outside the model's vocabulary "
                                 f"({model.vocab_size})")
        if out.mask_id == out.eos_id:
            raise ValueError(f"mask_id and eos_id must differ, both are {out.mask_id}")
        return out


def _python_scalars(config: Any) -> None:
    """NumPy scalars (np.int64(24), np.float32(0.5): what arithmetic on arrays hands out)
    stored as the Python numbers they are, so checks and hashing see plain ints and floats.
    A float keeps the value it holds: np.float32(0.9) is 0.8999999761581421, not 0.9."""
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if isinstance(v, np.bool_):
            object.__setattr__(config, f.name, bool(v))
        elif isinstance(v, np.integer):
            object.__setattr__(config, f.name, int(v))
        elif isinstance(v, np.floating):
            object.__setattr__(config, f.name, float(v))


def _positive_int(v: Any, name: str, error: type[ValueError] = ValueError) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise error(f"{name} must be a positive integer, got {v!r}")


def _number(v: Any, name: str, lo: float | None = None) -> None:
    try:
        finite = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    except OverflowError:  # an int beyond float's range
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
