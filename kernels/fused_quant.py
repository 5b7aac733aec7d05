"""Activation quantisation to float8_e4m3fn with one scale per 1 x 128 group, fused with the op
that produces the activation (REFERENCE.md §7), so the bf16 activation is never written:

- `rmsnorm_quant`: LLaDA's RMSNorm (fp32 statistics, rounded to the activation dtype, times the
  weight) then quantisation: feeds the gate/up GEMM.
- `swiglu_quant`: silu(gate) * up in fp32 then quantisation: feeds the down GEMM.

`scale = amax / 448` per group (1 for an all-zero group), values clipped to +-448 and rounded
to nearest even. Each has a pure-jnp reference (`*_ref`) and a dispatcher (Pallas with the Triton
lowering on GPU, the reference elsewhere). Shapes: x [M, D], outputs q [M, D] fp8 and scales
[M, D / 128] fp32; M is padded to the row tile inside the wrappers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
ROWS = 16  # row tile: the smallest Triton dot/tile height, and enough rows per program


def group_scale(amax: jax.Array) -> jax.Array:
    # An all-zero group gets scale 1 (its values quantise to 0 either way) instead of 0/0.
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)


def to_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8)


def quantize_groups(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., K] -> (fp8 [..., K], fp32 scales [..., K / 128]), one scale per 1 x 128 group."""
    K = x.shape[-1]
    if K % GROUP:
        raise ValueError(f"activation width must be a multiple of {GROUP}, got {K}")
    groups = x.astype(jnp.float32).reshape(*x.shape[:-1], K // GROUP, GROUP)
    scale = group_scale(jnp.abs(groups).max(axis=-1))
    return to_fp8(groups, scale[..., None]).reshape(x.shape), scale


def rms_rstd(x: jax.Array, eps: float) -> jax.Array:
    """1 / RMS over the last axis, in fp32, keepdims."""
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_normed(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """LLaDA's RMSNorm: fp32 statistics, rounded to x's dtype before the weight multiply."""
    return (x.astype(jnp.float32) * rms_rstd(x, eps)).astype(x.dtype) * w


def rmsnorm_quant_ref(x_MD, w_D, eps: float):
    return quantize_groups(rms_normed(x_MD, w_D, eps))


def swiglu_quant_ref(gate_up_M2F):
    gate, up = jnp.split(gate_up_M2F.astype(jnp.float32), 2, axis=-1)
    return quantize_groups(jax.nn.silu(gate) * up)


# --- Pallas kernels ------------------------------------------------------------------------

def _quantize_tile(a):
    """fp32 [rows, 128] -> (fp8 tile, fp32 [rows, 1] scale); same arithmetic as `to_fp8`."""
    amax = jnp.max(jnp.abs(a), axis=1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(a / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


def _rmsnorm_quant_kernel(x_ref, rstd_ref, w_ref, q_ref, s_ref):
    x = x_ref[...]
    h = (x.astype(jnp.float32) * rstd_ref[...]).astype(x.dtype) * w_ref[...][None, :]
    q_ref[...], s_ref[...] = _quantize_tile(h.astype(jnp.float32))


def _swiglu_quant_kernel(gate_ref, up_ref, q_ref, s_ref):
    gate = gate_ref[...].astype(jnp.float32)
    a = gate * jax.nn.sigmoid(gate) * up_ref[...].astype(jnp.float32)
    q, scale = _quantize_tile(a)
    q_ref[...] = q
    s_ref[...] = scale


def _pad_rows(x, rows):
    M = x.shape[0]
    Mp = pl.cdiv(M, rows) * rows
    return (x if Mp == M else jnp.pad(x, [(0, Mp - M), (0, 0)])), M, Mp


def _quantising_call(kernel, inputs, in_specs, Mp: int, G: int, name: str, interpret: bool,
                     poison: bool):
    """One program per 16 x 128 output tile: fp8 [Mp, G * 128] and scales [Mp, G]. With
    `poison` (tests) the outputs are NaN-filled inputs aliased to them, never read."""
    out_shape = [jax.ShapeDtypeStruct((Mp, G * GROUP), FP8),
                 jax.ShapeDtypeStruct((Mp, G), jnp.float32)]
    out_specs = [pl.BlockSpec((ROWS, GROUP), lambda i, g: (i, g)),
                 pl.BlockSpec((ROWS, 1), lambda i, g: (i, g))]
    poisoned = [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape] if poison else []
    n_in = len(inputs)

    def body(*refs):
        kernel(*refs[:n_in], *refs[n_in + len(poisoned):])

    return pl.pallas_call(
        body, grid=(Mp // ROWS, G), in_specs=in_specs + out_specs[:len(poisoned)],
        out_specs=out_specs, out_shape=out_shape, interpret=interpret, name=name,
        compiler_params=_triton(),
        input_output_aliases={n_in + j: j for j in range(len(poisoned))},
    )(*inputs, *poisoned)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "poison"))
def rmsnorm_quant_pallas(x_MD, w_D, eps: float, *, interpret: bool = False,
                         poison: bool = False):
    """RMSNorm fused with 1 x 128 quantisation: the normed activation is never written.
    The row statistics come first from the bf16 path's own expression (`rms_rstd`, one read
    of x by XLA); the kernel then normalises, rounds, weights and quantises one 16 x 128 tile
    per program, so even M = 32 spreads over many SMs. `poison` (tests) pre-fills outputs."""
    D = x_MD.shape[1]
    if D % GROUP:
        raise ValueError(f"width must be a multiple of {GROUP}, got {D}")
    x, M, Mp = _pad_rows(x_MD, ROWS)
    rstd, _, _ = _pad_rows(rms_rstd(x_MD, eps), ROWS)
    in_specs = [pl.BlockSpec((ROWS, GROUP), lambda i, g: (i, g)),
                pl.BlockSpec((ROWS, 1), lambda i, g: (i, 0)),
                pl.BlockSpec((GROUP,), lambda i, g: (g,))]
    q, s = _quantising_call(_rmsnorm_quant_kernel, (x, rstd, w_D), in_specs, Mp, D // GROUP,
                            "rmsnorm_quant", interpret, poison)
    return q[:M], s[:M]


@functools.partial(jax.jit, static_argnames=("interpret", "poison"))
def swiglu_quant_pallas(gate_up_M2F, *, interpret: bool = False, poison: bool = False):
    """Fused silu(gate) * up + 1 x 128 quantisation of [M, 2F] = [gate | up]."""
    F = gate_up_M2F.shape[1] // 2
    if F % GROUP or gate_up_M2F.shape[1] % 2:
        raise ValueError(f"gate|up width must be 2 x a multiple of {GROUP}, "
                         f"got {gate_up_M2F.shape[1]}")
    x, M, Mp = _pad_rows(gate_up_M2F, ROWS)
    G = F // GROUP
    in_specs = [pl.BlockSpec((ROWS, GROUP), lambda i, g: (i, g)),
                pl.BlockSpec((ROWS, GROUP), lambda i, g: (i, g + G))]
    q, s = _quantising_call(_swiglu_quant_kernel, (x, x), in_specs, Mp, G, "swiglu_quant",
                            interpret, poison)
    return q[:M], s[:M]


def _triton():
    # Triton compiler params also select the Triton lowering (the GPU default is Mosaic).
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def rmsnorm_quant(x_MD, w_D, eps: float):
    """Dispatch: the Pallas kernel on GPU, the reference elsewhere."""
    if jax.default_backend() == "gpu":
        return rmsnorm_quant_pallas(x_MD, w_D, eps)
    return rmsnorm_quant_ref(x_MD, w_D, eps)


def swiglu_quant(gate_up_M2F):
    if jax.default_backend() == "gpu":
        return swiglu_quant_pallas(gate_up_M2F)
    return swiglu_quant_ref(gate_up_M2F)
