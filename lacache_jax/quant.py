"""FP8 (float8_e4m3fn) quantisation for LaCache's FFN matmuls (REFERENCE.md §7).

Weights: one scale per 128 x 128 block, stored K-major ([N, K], the layout Hopper's FP8 GEMMs
read fastest). Activations: one scale per 1 x 128 group along K. `scale = amax / 448`, values
clipped to +-448. The per-token and per-tensor activation scalings exist for the paper's
ablation only. The FFN runs on the kernels of `kernels/fp8_matmul.py` (per-group scaled GEMM)
and `kernels/fused_quant.py` (RMSNorm / SwiGLU fused with quantisation), and where
`kernels/gate_up_swiglu.py` takes them (Hopper from `MGPU_MIN_M` rows) on the gate/up GEMM
with SwiGLU + quantisation in its epilogue; they hold their pure-jnp references and
dispatch (Pallas on GPU, references elsewhere).
Under tensor parallelism each device holds and runs its own FFN columns (`ffn_fp8`; the layout
and the placement are sharding.py's).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as PS

from kernels.fp8_matmul import fp8_matmul, fp8_matmul_ref  # noqa: F401 (re-exported)
from kernels.fused_quant import FP8  # noqa: F401 (re-exported)
from kernels.fused_quant import (GROUP, ROWS, group_scale, quantize_groups, rms_normed,
                                 rmsnorm_quant, swiglu_quant, to_fp8)
from kernels.gate_up_swiglu import gate_up_swiglu_quant, takes as fuses_gate_up
from lacache_jax import sharding
from lacache_jax.sharding import DATA, MODEL, shard_kernel


def quantize_weight(w_KN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[K, N] weight -> (fp8 [N, K], fp32 scales [N / 128, K / 128])."""
    K, N = w_KN.shape
    if K % GROUP or N % GROUP:
        raise ValueError(f"weight dims must be multiples of {GROUP}, got {w_KN.shape}")
    w_NK = w_KN.T.astype(jnp.float32)
    blocks = w_NK.reshape(N // GROUP, GROUP, K // GROUP, GROUP)
    scale = group_scale(jnp.abs(blocks).max(axis=(1, 3)))
    q = to_fp8(blocks, scale[:, None, :, None]).reshape(N, K)
    return q, scale


def dequantize_weight(q_NK: jax.Array, scale: jax.Array) -> jax.Array:
    """Inverse of `quantize_weight`, back to [K, N] fp32."""
    N, K = q_NK.shape
    blocks = q_NK.astype(jnp.float32).reshape(N // GROUP, GROUP, K // GROUP, GROUP)
    return (blocks * scale[:, None, :, None]).reshape(N, K).T


def quantize_act(x: jax.Array, granularity: str = "group",
                 axis_name: str | None = None) -> tuple[jax.Array, jax.Array]:
    """[..., K] activations -> (fp8 [..., K], fp32 scales [..., K / 128]).

    `granularity`: "group" (1 x 128, ours), or for the ablation "token" (one scale per row)
    and "tensor" (one scale overall), both broadcast to the group layout. `axis_name`: the
    mesh axis K is split over inside `shard_map` (the row or tensor amax spans all of it).
    """
    if granularity == "group":
        return quantize_groups(x)
    K = x.shape[-1]
    if K % GROUP:
        raise ValueError(f"activation width must be a multiple of {GROUP}, got {K}")
    groups = x.astype(jnp.float32).reshape(*x.shape[:-1], K // GROUP, GROUP)
    amax = jnp.abs(groups).max(axis=-1)
    if granularity == "token":
        top = amax.max(axis=-1, keepdims=True)
    elif granularity == "tensor":
        top = amax.max()
    else:
        raise ValueError(f"granularity must be 'group', 'token' or 'tensor', got {granularity!r}")
    if axis_name is not None:
        top = jax.lax.pmax(top, axis_name)
    amax = jnp.broadcast_to(top, amax.shape)
    scale = group_scale(amax)
    return to_fp8(groups, scale[..., None]).reshape(x.shape), scale


def dequantize_act(q: jax.Array, scale: jax.Array) -> jax.Array:
    K = q.shape[-1]
    groups = q.astype(jnp.float32).reshape(*q.shape[:-1], K // GROUP, GROUP)
    return (groups * scale[..., None]).reshape(q.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FP8FFN:
    """One layer's FFN weights in FP8, K-major, with their 128 x 128 block scales."""
    gate_up: jax.Array        # [2F, D] float8_e4m3fn: rows gate | up (see `tp`)
    gate_up_scale: jax.Array  # [2F / 128, D / 128]
    down: jax.Array           # [D, F]
    down_scale: jax.Array     # [D / 128, F / 128]
    # Activation scaling: "group" (1 x 128, fused kernels); "token"/"tensor" for the ablation.
    granularity: str = dataclasses.field(default="group", metadata={"static": True})
    # Row layout of gate_up and its scales, as Layer.tp for w_gate_up's columns: `tp` groups,
    # group j holding gate | up of FFN columns j*F/tp ... (sharding.tp_layout). Kept here so
    # the FFN needs nothing but its weights.
    tp: int = dataclasses.field(default=1, metadata={"static": True})


def ffn8_shapes(d_model: int, d_ff: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's `FP8FFN` arrays, by field name."""
    D, F = d_model, d_ff
    return {"gate_up": (2 * F, D), "gate_up_scale": (2 * F // GROUP, D // GROUP),
            "down": (D, F), "down_scale": (D // GROUP, F // GROUP)}


def check_fp8_ffn_dims(d_model: int, d_ff: int) -> None:
    """One weight scale per 128 x 128 block: both FFN widths must be multiples of it."""
    if d_model % GROUP or d_ff % GROUP:
        raise ValueError(f"the FP8 FFN needs d_model and d_ff to be multiples of {GROUP} (one "
                         f"scale per {GROUP} x {GROUP} block); this model has {d_model} and "
                         f"{d_ff}")


def has_fp8_ffn(params: Any) -> bool:
    """Whether any layer carries FP8 FFN copies (`quantize_ffn`, or stored by convert/save)."""
    return any(layer.ffn8 is not None for layer in params.layers)


def quantize_ffn(params: Any, skip: Iterable[int] = (0,), granularity: str = "group") -> Any:
    """`params` with FP8 FFN weights attached to every layer but those in `skip` (LaCache
    keeps the first layer in bf16). The bf16 weights stay, so one set of params serves
    both `fp8_ffn=False` and `True`. `granularity` of the activation scales: "group" (ours),
    "token" or "tensor" (the paper's ablation; unfused quantisation)."""
    if granularity not in ("group", "token", "tensor"):
        raise ValueError(f"granularity must be 'group', 'token' or 'tensor', got {granularity!r}")
    check_fp8_ffn_dims(*params.layers[0].w_down.shape[::-1])
    skip = set(skip)
    layers = []
    for i, layer in enumerate(params.layers):
        if i in skip:
            layers.append(dataclasses.replace(layer, ffn8=None))
            continue
        # The bf16 columns' layout carries over to the quantised rows (each 128-row block
        # lies inside one group when d_ff / tp is a multiple of 128).
        sharding.check_fp8_mesh(layer.w_down.shape[0], layer.tp)
        w8 = quantize_ffn_layer(layer.w_gate_up, layer.w_down, granularity)
        layers.append(dataclasses.replace(layer, ffn8=dataclasses.replace(w8, tp=layer.tp)))
    return dataclasses.replace(params, layers=layers)


def quantize_ffn_layer(w_gate_up, w_down, granularity: str = "group") -> FP8FFN:
    """One layer's FP8 FFN weights from its [in, out] matrices."""
    return FP8FFN(*quantize_weight(jnp.asarray(w_gate_up)), *quantize_weight(jnp.asarray(w_down)),
                  granularity)


def ffn_fp8(x_BLD: jax.Array, norm_D: jax.Array, eps: float, w: FP8FFN) -> jax.Array:
    """RMSNorm + SwiGLU FFN with per-group FP8 matmuls (fp32 accumulation), on un-normed x:
    the norm is fused into the first quantisation, SwiGLU into the second (kernels on GPU).
    Under a mesh the kernels run per row shard and, over a model axis, per shard of the FFN
    columns (Megatron: gate/up by output rows, down by its K columns, scales with their
    blocks; `sharding.fp8_specs`), the partial down products summed by one all-reduce."""
    D = x_BLD.shape[-1]
    rows = PS(DATA, None, None)
    mesh = sharding.active_mesh()
    n = 1 if mesh is None else mesh.shape[MODEL]
    if w.tp % n:
        raise ValueError(f"FP8 FFN weights in the layout of {w.tp} column groups cannot run "
                         f"on a model axis of {n}: place them with sharding.shard_params")
    if n == 1:
        fn = lambda x_MD, nrm, w: _ffn_fp8_rows(x_MD, nrm, eps, w, w.tp, x_MD.dtype)
        specs = PS()
    else:
        def fn(x_MD, nrm, w):
            # This shard's share of the down product, summed over the shards in fp32: the
            # single-device GEMM accumulates all of K in fp32 before its one rounding.
            part = _ffn_fp8_rows(x_MD, nrm, eps, w, w.tp // n, jnp.float32, MODEL)
            return jax.lax.psum(part, MODEL).astype(x_MD.dtype)
        specs = dataclasses.replace(w, **sharding.fp8_specs())

    def padded(x, nrm, w):
        # Zero rows up to a multiple of ROW_ALIGN (see there); the slice back to M rows
        # fuses into the residual add. Aligned rows: the program as before, no pad op.
        x_MD = x.reshape(-1, D)
        M, pad = x_MD.shape[0], -x_MD.shape[0] % ROW_ALIGN
        if not pad:
            return fn(x_MD, nrm, w).reshape(x.shape)
        return fn(jnp.pad(x_MD, ((0, pad), (0, 0))), nrm, w)[:M].reshape(x.shape)

    run = shard_kernel(padded, (rows, PS(), specs), rows)
    return run(x_BLD, norm_D, w)


# `ffn_fp8` pads its rows once to this multiple: the quantisation kernels' row tile
# (fused_quant.ROWS; its BIG_TILES, unset, would need their rows here too), itself a multiple
# of the 8 rows cuBLASLt's GEMM needs. Unpadded, each kernel pads its own input and slices its
# output, and XLA fuses neither into a custom call: at a canvas of 633 rows (DPad's compact
# canvas at prompt 512) that is ~50 us of copies a layer (the 31 MB gate/up output alone is
# copied twice). Zero rows give zero outputs and change no scale (norm_eps > 0).
ROW_ALIGN = ROWS


def _ffn_fp8_rows(x: jax.Array, norm_D: jax.Array, eps: float, w: FP8FFN, groups: int,
                  out_dtype, axis_name: str | None = None) -> jax.Array:
    """One shard's FFN on rows x [M, D]: its gate/up rows hold `groups` column groups
    (gate | up each), its down the matching K columns; [M, D] in `out_dtype`. `axis_name`:
    the mesh axis the FFN columns are split over (for the ablation's row/tensor scales)."""

    def gate_then_up(gu_M2F):
        # Several groups in this shard (a layout for more shards than run it): all gates,
        # then all ups, in FFN column order, as the fused SwiGLU and down's K expect.
        if groups == 1:
            return gu_M2F
        M = gu_M2F.shape[0]
        return gu_M2F.reshape(M, groups, 2, -1).swapaxes(1, 2).reshape(M, -1)

    if w.granularity == "group":
        hq, hs = rmsnorm_quant(x, norm_D, eps)
        (M, K), F = hq.shape, w.gate_up.shape[0] // 2
        if groups == 1 and fuses_gate_up(M, F, K):  # SwiGLU in the GEMM's epilogue
            aq, as_ = gate_up_swiglu_quant(hq, hs, w.gate_up, w.gate_up_scale, x.dtype)
        else:
            gate_up = gate_then_up(fp8_matmul(hq, hs, w.gate_up, w.gate_up_scale, x.dtype))
            aq, as_ = swiglu_quant(gate_up)
    else:
        hq, hs = quantize_act(rms_normed(x, norm_D, eps), w.granularity)
        gate_up = gate_then_up(fp8_matmul(hq, hs, w.gate_up, w.gate_up_scale, x.dtype))
        gate, up = jnp.split(gate_up, 2, -1)
        aq, as_ = quantize_act(jax.nn.silu(gate.astype(jnp.float32)) * up, w.granularity,
                               axis_name)
    return fp8_matmul(aq, as_, w.down, w.down_scale, out_dtype)
