"""LLaDA: weights as a dataclass pytree, pure forward functions over it, a thin NNX wrapper.

Shape suffixes follow the package legend (lacache_jax/__init__.py).

Numerics follow REFERENCE.md §3: RMSNorm statistics in fp32, cast back, then the weight;
rotate-half RoPE in fp32; softmax attention with fp32 accumulation; no biases; the head its own matrix or
the embedding's (`weight_tying`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as PS

from kernels import short_attention
from kernels.forced import Forced
from kernels.fused_quant import rms_normed
from lacache_jax import quant
from lacache_jax.config import ModelConfig
from lacache_jax.sharding import DATA, MODEL, per_shard, shard_kernel


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    """One transformer block; matrices are stored [in, out]. Q/K/V and gate/up are fused
    column-wise: one weight-streaming GEMM each instead of several (and no per-step weight
    concatenation, which XLA's dot merger otherwise inserts inside the decoding loop)."""
    attn_norm: jax.Array  # [D]
    w_qkv: jax.Array      # [D, (H + 2G) * K]: columns q | k | v
    wo: jax.Array         # [H*K, D]
    ff_norm: jax.Array    # [D]
    w_gate_up: jax.Array  # [D, 2F]: columns gate (LLaDA `ff_proj`, SiLU applies) | up
    w_down: jax.Array     # [F, D]  (LLaDA block `ff_out`)
    # FP8 copies of the FFN weights (quant.quantize_ffn); derived from the bf16 ones, so a
    # checkpoint stores them as groups of their own (checkpoint.fp8_to_group), if at all.
    ffn8: quant.FP8FFN | None = dataclasses.field(default=None, metadata={"derived": True})
    # Column layout of w_qkv and w_gate_up: `tp` contiguous groups, group j holding q | k | v
    # of heads j*H/tp ... (and gate | up of FFN columns j*F/tp ...), so a tensor-parallel
    # shard of the columns is whole heads and matching gate/up halves (sharding.py). 1 is the
    # checkpoint layout (q | k | v, gate | up).
    tp: int = dataclasses.field(default=1, metadata={"static": True, "derived": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    embed: jax.Array           # [V, D]
    layers: list[Layer]
    norm_f: jax.Array          # [D]
    head: jax.Array | None     # [D, V]; None when tied to `embed`

    @property
    def dtype(self):
        return self.embed.dtype


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's weights, by `Layer` field name."""
    D, F, K = cfg.d_model, cfg.d_ff, cfg.head_dim
    return dict(attn_norm=(D,), w_qkv=(D, (cfg.n_heads + 2 * cfg.n_kv_heads) * K),
                wo=(cfg.n_heads * K, D), ff_norm=(D,), w_gate_up=(D, 2 * F), w_down=(F, D))


def outer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the weights outside the layers, by `Params` field name (no head when the
    config ties it to the embedding)."""
    D, V = cfg.d_model, cfg.vocab_size
    return {"embed": (V, D), "norm_f": (D,), **({} if cfg.tie_embeddings else {"head": (D, V)})}


def check_params(params: Params, cfg: ModelConfig) -> None:
    """Every weight's shape (and the float weights' common dtype) against the config, once,
    before anything is traced: a mismatch is a ValueError naming the leaf and both shapes."""
    D, V = cfg.d_model, cfg.vocab_size
    if len(params.layers) != cfg.n_layers:
        raise ValueError(f"params has {len(params.layers)} layers, config says {cfg.n_layers}")
    want = outer_shapes(cfg)
    got = {"embed": params.embed, "norm_f": params.norm_f, "head": params.head}
    for i, layer in enumerate(params.layers):
        for name, shape in param_shapes(cfg).items():
            want[f"layers[{i}].{name}"] = shape
            got[f"layers[{i}].{name}"] = getattr(layer, name)
        if layer.ffn8 is not None:
            for name, shape in quant.ffn8_shapes(D, cfg.d_ff).items():
                want[f"layers[{i}].ffn8.{name}"] = shape
                got[f"layers[{i}].ffn8.{name}"] = getattr(layer.ffn8, name)
    dims = (f"d_model={D}, n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}, "
            f"d_ff={cfg.d_ff}, vocab_size={V}")
    for name, shape in want.items():
        leaf = got[name]
        if leaf is None:
            raise ValueError(f"params.{name} is missing (the config unties the LM head)")
        if tuple(leaf.shape) != shape:
            raise ValueError(f"params.{name} has shape {tuple(leaf.shape)} but the config "
                             f"({dims}) needs {shape}")
        if ".ffn8." not in name and leaf.dtype != params.embed.dtype:
            raise ValueError(f"params.{name} is {leaf.dtype} but params.embed is "
                             f"{params.embed.dtype}: weights must share one dtype")
    if cfg.tie_embeddings and params.head is not None:
        raise ValueError("params.head is set but the config ties the LM head to the embedding")


def qkv_columns(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Column ranges of q, k and v inside `w_qkv`."""
    HK, GK = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"q": (0, HK), "k": (HK, HK + GK), "v": (HK + GK, HK + 2 * GK)}


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.bfloat16,
                std: float = 0.02) -> Params:
    """Random weights (normal(0, std) matrices, unit norms), built one layer at a time on device."""
    shapes = param_shapes(cfg)

    @jax.jit
    def make_layer(key):
        keys = jax.random.split(key, len(shapes))
        return Layer(**{
            name: (jnp.ones(shape, dtype) if len(shape) == 1
                   else (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
            for k, (name, shape) in zip(keys, shapes.items())})

    def normal(key, shape):
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    k_embed, k_head, *k_layers = jax.random.split(key, cfg.n_layers + 2)
    outer = outer_shapes(cfg)
    return Params(
        embed=jax.jit(normal, static_argnums=1)(k_embed, outer["embed"]),
        layers=[make_layer(k) for k in k_layers],
        norm_f=jnp.ones(outer["norm_f"], dtype),
        head=jax.jit(normal, static_argnums=1)(k_head, outer["head"]) if "head" in outer else None,
    )


# --- building blocks ------------------------------------------------------------------

def rms_norm(x_BLD: jax.Array, w_D: jax.Array, eps: float) -> jax.Array:
    # LLaDA rounds to the activation dtype before the weight multiply (one rounding differs
    # if the weight were applied in fp32); the FP8 FFN's fused kernel shares this definition.
    return rms_normed(x_BLD, w_D, eps)


def rope_tables(positions_BL: jax.Array, head_dim: int, theta: float):
    """cos, sin [B, L, K/2] in fp32 for rotate-half RoPE at the given absolute positions."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions_BL.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BLHK: jax.Array, cos_BLk: jax.Array, sin_BLk: jax.Array) -> jax.Array:
    x = x_BLHK.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos_BLk[:, :, None, :], sin_BLk[:, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BLHK.dtype)


# `with attention_implementation("xla"): ...` while tracing overrides the default below (the
# training step picks whichever of the two runs its padded-key-mask backward faster).
attention_implementation = Forced("attention", choices=("cudnn", "xla"))
# Where cuDNN would run a few query rows over many keys (a dual-cache step's block): the
# split-keys kernel (kernels/short_attention.py) by default, or cuDNN all the same.
short_attention_implementation = Forced("short attention", choices=("split", "cudnn"))


def _attention_impl(dtype) -> str:
    # cuDNN fused attention on GPU for half types; XLA elsewhere (CPU, fp32 parity runs).
    if jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16):
        return attention_implementation.choice("cudnn")
    return "xla"


def _per_device(x_BLHK: jax.Array) -> jax.ShapeDtypeStruct:
    """The shard of a [B, L, heads, K] array one device runs under the active mesh (rows over
    DATA, heads over MODEL), for a dispatch by size."""
    B, L, H, K = x_BLHK.shape
    return jax.ShapeDtypeStruct((per_shard(B, DATA), L, per_shard(H, MODEL), K), x_BLHK.dtype)


def attention(q_BLHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array,
              key_mask_BS: jax.Array | None = None) -> jax.Array:
    """Bidirectional softmax attention, scale 1/sqrt(K); masked keys get no weight. Each
    row needs one unmasked key (every caller's rows hold at least their own or a pad token):
    a row with none is cuDNN's and XLA's mean of V, the split-keys kernel's NaN."""
    impl = _attention_impl(q_BLHK.dtype)
    if (impl == "cudnn" and short_attention.takes(*map(_per_device, (q_BLHK, k_BSGK)))
            and short_attention_implementation.choice("split") == "split"):
        if key_mask_BS is None:
            key_mask_BS = jnp.ones(k_BSGK.shape[:2], bool)
        # A Pallas call is not partitioned by XLA: under a mesh each device runs its shard.
        heads = PS(DATA, None, MODEL, None)
        kernel = shard_kernel(short_attention.short_attention_pallas,
                              (heads, heads, heads, PS(DATA, None)), heads)
        return kernel(q_BLHK, k_BSGK, v_BSGK, key_mask_BS)
    mask = None
    if key_mask_BS is not None:
        B, L, S = q_BLHK.shape[0], q_BLHK.shape[1], k_BSGK.shape[1]
        mask = key_mask_BS.astype(bool)[:, None, None, :]
        if impl == "cudnn":  # cuDNN takes a mask (bias) only at its full [B, 1, L, S] shape
            mask = jnp.broadcast_to(mask, (B, 1, L, S))
    return jax.nn.dot_product_attention(
        q_BLHK, k_BSGK, v_BSGK, mask=mask, scale=1.0 / math.sqrt(q_BLHK.shape[-1]),
        implementation=impl)


def qkv(h_BLD: jax.Array, layer: Layer, cfg: ModelConfig, cos_BLk, sin_BLk):
    """Projected queries and keys after RoPE, and values: [B, L, H|G, K]."""
    B, L, _ = h_BLD.shape
    K = cfg.head_dim
    with jax.named_scope("qkv"):
        qkv_BLN = h_BLD @ layer.w_qkv
    # Per column group (see Layer.tp): its q | k | v heads, then the groups' heads in order.
    n = layer.tp
    (_, q1), (_, k1), _ = qkv_columns(cfg).values()
    q, k, v = jnp.split(qkv_BLN.reshape(B, L, n, -1), [q1 // n, k1 // n], axis=-1)
    q = q.reshape(B, L, cfg.n_heads, K)
    k = k.reshape(B, L, cfg.n_kv_heads, K)
    v = v.reshape(B, L, cfg.n_kv_heads, K)
    with jax.named_scope("rope"):
        return apply_rope(q, cos_BLk, sin_BLk), apply_rope(k, cos_BLk, sin_BLk), v


def mlp(x_BLD: jax.Array, layer: Layer, cfg: ModelConfig) -> jax.Array:
    with jax.named_scope("ffn"):
        return _mlp(x_BLD, layer, cfg)


def _mlp(x_BLD: jax.Array, layer: Layer, cfg: ModelConfig) -> jax.Array:
    if layer.ffn8 is not None:
        return quant.ffn_fp8(x_BLD, layer.ff_norm, cfg.norm_eps, layer.ffn8)
    h = rms_norm(x_BLD, layer.ff_norm, cfg.norm_eps)
    lead = x_BLD.shape[:-1]
    gate_up = (h @ layer.w_gate_up).reshape(*lead, layer.tp, 2, -1)  # groups: see Layer.tp
    gate, up = (gate_up[..., c, :].reshape(*lead, -1) for c in (0, 1))
    return (jax.nn.silu(gate) * up) @ layer.w_down


def block(x_BLD: jax.Array, layer: Layer, cfg: ModelConfig, cos_BLk, sin_BLk,
          key_mask_BS: jax.Array | None, kv_fn=None, qkv_fn=None, rows=None):
    """One pre-norm block. `kv_fn(k, v) -> (k_all, v_all)` lets a cache supply the keys and
    values the queries attend to (default: the block's own); `qkv_fn(h) -> (q, k_all,
    v_all)` replaces the projection, RoPE and `kv_fn` together (a fused cache-update kernel).
    `rows(a)`: the rows of a [B, L, ...] array whose outputs are wanted; only their queries
    attend and only they go through the output projection and the MLP (the fused Q/K/V
    projection still runs for every row: the keys and values are needed). Returns (x of those
    rows, k_all, v_all)."""
    h = rms_norm(x_BLD, layer.attn_norm, cfg.norm_eps)
    if qkv_fn is not None:
        q, k_all, v_all = qkv_fn(h)
    else:
        q, k, v = qkv(h, layer, cfg, cos_BLk, sin_BLk)
        k_all, v_all = (k, v) if kv_fn is None else kv_fn(k, v)
    if rows is not None:
        q, x_BLD = rows(q), rows(x_BLD)
    with jax.named_scope("attention"):
        attn = attention(q, k_all, v_all, key_mask_BS)
    return finish_block(x_BLD, attn, layer, cfg), k_all, v_all


def finish_block(x_BLD: jax.Array, attn_BLHK: jax.Array, layer: Layer, cfg: ModelConfig):
    """The rest of a block once its attention output is known: projection, residual, MLP."""
    B, L, _ = x_BLD.shape
    x_BLD = x_BLD + attn_BLHK.reshape(B, L, -1) @ layer.wo
    return x_BLD + mlp(x_BLD, layer, cfg)


def lm_head(params: Params, cfg: ModelConfig, x_BLD: jax.Array) -> jax.Array:
    h = rms_norm(x_BLD, params.norm_f, cfg.norm_eps)
    return h @ params.embed.T if params.head is None else h @ params.head


def forward_hidden(params: Params, cfg: ModelConfig, tokens_BL: jax.Array,
                   attention_mask_BL: jax.Array | None = None,
                   positions_BL: jax.Array | None = None) -> jax.Array:
    """Final hidden states [B, L, D] before the last norm (layers unrolled: see DESIGN.md)."""
    B, L = tokens_BL.shape
    if positions_BL is None:
        positions_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    return forward_layers(params, cfg, tokens_BL, positions_BL, attention_mask_BL)[0]


def forward_layers(params: Params, cfg: ModelConfig, tokens_BL: jax.Array,
                   positions_BL: jax.Array, key_mask_BS: jax.Array | None, kv_fns=None):
    """Embedding and all blocks; returns (hidden [B, L, D], per-layer keys and values attended).

    `kv_fns[i]` (see `block`) substitutes cached keys/values in layer i; the query tokens
    sit at `positions_BL` and `key_mask_BS` masks the keys they attend to.
    """
    cos, sin = rope_tables(positions_BL, cfg.head_dim, cfg.rope_theta)
    return run_blocks(params.embed[tokens_BL], params.layers, cfg, cos, sin, key_mask_BS, kv_fns)


def run_blocks(x_BLD: jax.Array, layers: list[Layer], cfg: ModelConfig, cos_BLk, sin_BLk,
               key_mask_BS: jax.Array | None, kv_fns=None, qkv_fns=None, rows=None):
    """`layers` in order from hidden states x; returns (x, per-layer keys and values).
    `kv_fns[i]`, `qkv_fns[i]`: layer i's hooks (see `block`). `rows(a)`: the rows of a
    [B, L, ...] array whose final hidden states are wanted (the LM head's): the last layer
    computes the rest of its block for those only (`block`), and x holds only them."""
    ks, vs = [], []
    if rows is not None and not layers:
        x_BLD = rows(x_BLD)
    for i, layer in enumerate(layers):
        x_BLD, k, v = block(x_BLD, layer, cfg, cos_BLk, sin_BLk, key_mask_BS,
                            None if kv_fns is None else kv_fns[i],
                            None if qkv_fns is None else qkv_fns[i],
                            rows if i == len(layers) - 1 else None)
        ks.append(k)
        vs.append(v)
    return x_BLD, ks, vs


@functools.partial(jax.jit, static_argnames="cfg")
def _forward(params, cfg, tokens_BL, attention_mask_BL, positions_BL):
    return lm_head(params, cfg,
                   forward_hidden(params, cfg, tokens_BL, attention_mask_BL, positions_BL))


def forward(params: Params, config: ModelConfig, tokens: Any, attention_mask: Any = None,
            positions: Any = None) -> jax.Array:
    """Full bidirectional pass: int tokens [B, L] -> logits [B, L, V] in the weights' dtype.

    `attention_mask` [B, L] marks real tokens (1/True) against padding: padded keys get no
    attention weight. `positions` [B, L] are RoPE positions (default: the column index).
    """
    tokens = _check_tokens(tokens, config)
    B, L = tokens.shape
    if attention_mask is not None:
        attention_mask = jnp.asarray(attention_mask)
        if attention_mask.shape != (B, L):
            raise ValueError(f"attention_mask has shape {attention_mask.shape}, expected {(B, L)}")
        attention_mask = attention_mask.astype(bool)
    if positions is not None:
        positions = jnp.asarray(positions)
        if positions.shape != (B, L) or not jnp.issubdtype(positions.dtype, jnp.integer):
            raise ValueError(f"positions must be integers of shape {(B, L)}, got "
                             f"{positions.dtype}{list(positions.shape)}")
    check_params(params, config)
    return _forward(params, config, tokens, attention_mask, positions)


def _check_tokens(tokens: Any, cfg: ModelConfig) -> jax.Array:
    concrete = not isinstance(tokens, jax.core.Tracer)
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [B, L], got "
                         f"{tokens.dtype}{list(tokens.shape)}")
    B, L = tokens.shape
    if B == 0 or L == 0:
        raise ValueError(f"tokens must be non-empty, got shape {(B, L)}")
    if L > cfg.max_seq_len:
        raise ValueError(f"tokens length {L} exceeds max_seq_len={cfg.max_seq_len}")
    if concrete:
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"tokens must lie in [0, {cfg.vocab_size}), got [{lo}, {hi}]")
    return tokens.astype(jnp.int32)


# --- thin Flax NNX module -----------------------------------------------------------------

class LLaDA(nnx.Module):
    """NNX view of a `Params` pytree, for training with `nnx.Optimizer`; calls the same
    pure `forward_hidden` / `lm_head` functions as inference."""

    def __init__(self, config: ModelConfig, params: Params):
        self.config = config
        self.params = nnx.data(jax.tree.map(nnx.Param, params))

    @classmethod
    def random(cls, config: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> "LLaDA":
        return cls(config, init_params(config, key, dtype))

    def weights(self) -> Params:
        return jax.tree.map(lambda v: v[...], self.params,
                            is_leaf=lambda v: isinstance(v, nnx.Variable))

    def __call__(self, tokens_BL, attention_mask_BL=None, positions_BL=None) -> jax.Array:
        params = self.weights()
        return lm_head(params, self.config, forward_hidden(
            params, self.config, tokens_BL, attention_mask_BL, positions_BL))
