"""FP8 (float8_e4m3fn) quantisation for LaCache's FFN matmuls (REFERENCE.md §7), pure jnp.

Weights: one scale per 128 x 128 block, stored K-major ([N, K], the layout Hopper's FP8 GEMMs
read fastest). Activations: one scale per 1 x 128 group along K. `scale = amax / 448`, values
clipped to +-448. The per-token and per-tensor activation scalings exist for the paper's
ablation only. `fp8_matmul_ref` is the reference of the per-group scaled GEMM: FP8 products,
fp32 accumulation, each 128-wide K group rescaled by its activation and weight scales.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128


def _scale(amax: jax.Array) -> jax.Array:
    # An all-zero group gets scale 1 (its values quantise to 0 either way) instead of 0/0.
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)


def _to_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8)


def quantize_weight(w_KN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[K, N] weight -> (fp8 [N, K], fp32 scales [N / 128, K / 128])."""
    K, N = w_KN.shape
    if K % GROUP or N % GROUP:
        raise ValueError(f"weight dims must be multiples of {GROUP}, got {w_KN.shape}")
    w_NK = w_KN.T.astype(jnp.float32)
    blocks = w_NK.reshape(N // GROUP, GROUP, K // GROUP, GROUP)
    scale = _scale(jnp.abs(blocks).max(axis=(1, 3)))
    q = _to_fp8(blocks, scale[:, None, :, None]).reshape(N, K)
    return q, scale


def dequantize_weight(q_NK: jax.Array, scale: jax.Array) -> jax.Array:
    """Inverse of `quantize_weight`, back to [K, N] fp32."""
    N, K = q_NK.shape
    blocks = q_NK.astype(jnp.float32).reshape(N // GROUP, GROUP, K // GROUP, GROUP)
    return (blocks * scale[:, None, :, None]).reshape(N, K).T


def quantize_act(x: jax.Array, granularity: str = "group") -> tuple[jax.Array, jax.Array]:
    """[..., K] activations -> (fp8 [..., K], fp32 scales [..., K / 128]).

    `granularity`: "group" (1 x 128, ours), or for the ablation "token" (one scale per row)
    and "tensor" (one scale overall), both broadcast to the group layout.
    """
    K = x.shape[-1]
    if K % GROUP:
        raise ValueError(f"activation width must be a multiple of {GROUP}, got {K}")
    groups = x.astype(jnp.float32).reshape(*x.shape[:-1], K // GROUP, GROUP)
    amax = jnp.abs(groups).max(axis=-1)
    if granularity == "token":
        amax = jnp.broadcast_to(amax.max(axis=-1, keepdims=True), amax.shape)
    elif granularity == "tensor":
        amax = jnp.broadcast_to(amax.max(), amax.shape)
    elif granularity != "group":
        raise ValueError(f"granularity must be 'group', 'token' or 'tensor', got {granularity!r}")
    scale = _scale(amax)
    return _to_fp8(groups, scale[..., None]).reshape(x.shape), scale


def dequantize_act(q: jax.Array, scale: jax.Array) -> jax.Array:
    K = q.shape[-1]
    groups = q.astype(jnp.float32).reshape(*q.shape[:-1], K // GROUP, GROUP)
    return (groups * scale[..., None]).reshape(q.shape)


def fp8_matmul_ref(xq: jax.Array, x_scale: jax.Array, wq_NK: jax.Array, w_scale: jax.Array,
                   out_dtype=jnp.bfloat16) -> jax.Array:
    """Per-group scaled FP8 GEMM: x [M, K] (groups 1 x 128) times w [N, K] (blocks 128 x 128)
    -> [M, N]. Each K group's FP8 products are summed exactly in fp32, then scaled."""
    M, K = xq.shape
    N = wq_NK.shape[0]
    xg = xq.astype(jnp.float32).reshape(M, K // GROUP, GROUP)
    wg = wq_NK.astype(jnp.float32).reshape(N, K // GROUP, GROUP)
    partial = jnp.einsum("mgk,ngk->mng", xg, wg, precision=jax.lax.Precision.HIGHEST)
    w_scale_NG = jnp.repeat(w_scale, GROUP, axis=0)  # [N, K / 128]
    out = jnp.einsum("mng,mg,ng->mn", partial, x_scale, w_scale_NG,
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FP8FFN:
    """One layer's FFN weights in FP8, K-major, with their 128 x 128 block scales."""
    gate_up: jax.Array        # [2F, D] float8_e4m3fn
    gate_up_scale: jax.Array  # [2F / 128, D / 128]
    down: jax.Array           # [D, F]
    down_scale: jax.Array     # [D / 128, F / 128]


def quantize_ffn(params: Any, skip: Iterable[int] = (0,)) -> Any:
    """`params` with FP8 FFN weights attached to every layer but those in `skip` (LaCache
    keeps the first layer in bf16). The bf16 weights stay, so one set of params serves
    both `fp8_ffn=False` and `True`."""
    skip = set(skip)
    layers = []
    for i, layer in enumerate(params.layers):
        if i in skip:
            layers.append(dataclasses.replace(layer, ffn8=None))
            continue
        gu, gu_s = quantize_weight(layer.w_gate_up)
        dn, dn_s = quantize_weight(layer.w_down)
        layers.append(dataclasses.replace(layer, ffn8=FP8FFN(gu, gu_s, dn, dn_s)))
    return dataclasses.replace(params, layers=layers)


def ffn_fp8(h_BLD: jax.Array, w: FP8FFN) -> jax.Array:
    """SwiGLU FFN on normed activations with per-group FP8 matmuls (fp32 accumulation)."""
    B, L, D = h_BLD.shape
    hq, hs = quantize_act(h_BLD.reshape(B * L, D))
    gate, up = jnp.split(fp8_matmul_ref(hq, hs, w.gate_up, w.gate_up_scale, jnp.float32), 2,
                         axis=-1)
    aq, as_ = quantize_act(jax.nn.silu(gate) * up)
    return fp8_matmul_ref(aq, as_, w.down, w.down_scale, h_BLD.dtype).reshape(B, L, D)
