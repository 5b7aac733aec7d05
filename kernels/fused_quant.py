"""Activation quantisation to float8_e4m3fn with one scale per 1 x 128 group, fused with the op
that produces the activation (REFERENCE.md §7), so the bf16 activation is never written:

- `rmsnorm_quant`: LLaDA's RMSNorm (fp32 statistics, rounded to the activation dtype, times the
  weight) then quantisation: feeds the gate/up GEMM.
- `swiglu_quant`: silu(gate) * up in fp32 then quantisation: feeds the down GEMM.

`scale = amax / 448` per group (1 for an all-zero group), values clipped to +-448 and rounded
to nearest even. Each has a pure-jnp reference (`*_ref`) and a dispatcher (Pallas with the Triton
lowering on GPU, the reference elsewhere). Shapes: x [M, D], outputs q [M, D] fp8 and scales
[M, D / 128] fp32; M is padded to the row tile inside the wrappers. Where the GEMM reads the
scales group-major (`fp8_matmul.scales_group_major`), the kernels write them [D / 128, M] and
return the transpose, which XLA cancels against the GEMM's. A program quantises a
`QuantTiles` tile (rows x groups of 128 columns), chosen by M (`QuantTiles.get_default`).

Whole rows (`QuantTiles(rows, groups=D / 128)`, RMSNorm only): a program also computes its
rows' statistics, so x is read from HBM once and no XLA pass runs before the kernel (the tiled
form reads x twice: `rms_rstd` in XLA, then the kernel). Its sum of squares runs in another
order than XLA's mean, so 1 / RMS can differ in the last fp32 bit, and a normed value then
rounds to the other bf16 (and rarely FP8) neighbour: the same bound the tests hold the tiled
form to against the reference. By the device's own time the per-group kernel runs at
1.16-1.42x its byte floor at M 768 and 1280 (twenty-second session), but needs XLA's
statistics pass before it (two launches at the dual step's 32 rows: 2.4 and 1.0 us against
the kernel's 1.7). Whole rows, one per program over 8 warps, take 3.0 us there against 5.0
(twenty-third session), so they are RMSNorm's default up to `WHOLE_ROWS_M` rows; with one
warp (5.7 us) or as a loop over the groups (its first form, ninth session) they were slower.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels.fp8_matmul import GROUP, scales_group_major

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
ROWS = 16  # the default row tile


@dataclasses.dataclass(frozen=True)
class QuantTiles:
    """Rows x 128-column groups per program (hashable: a static jit argument)."""
    rows: int = ROWS
    groups: int = 1  # divides the output's group count D / 128; all of them: whole rows
    warps: int = 4   # Triton warps per program

    @classmethod
    def get_default(cls, M: int, G: int, *, whole_rows: bool = False) -> QuantTiles:
        """16 x 128 (so even M = 32 spreads over many SMs), or from `BIG_M` rows `BIG_TILES`
        (fewer, longer programs), their group count cut to divide G. `BIG_TILES` stays unset:
        the first sweep (H200, 2026-12-02, M 768 and 1024, one median per cell) had the
        default fastest at M 768 and 16 x 1 x 2 / 16 x 2 x 4 1.4-1.6x faster at M 1024; its
        repeat (2026-12-03, RESULTS.md) had them within 5% of the default at M 1024.
        `whole_rows` (RMSNorm, whose statistics a whole-row program computes itself): up to
        `WHOLE_ROWS_M` rows, one row per program over 8 warps, where the row's group count is
        a power of two."""
        if whole_rows and M <= WHOLE_ROWS_M and G & (G - 1) == 0:  # Triton's block shapes
            return cls(1, G, 8)
        if BIG_TILES is None or M < BIG_M:
            return cls()
        rows, groups = BIG_TILES
        while G % groups:
            groups //= 2
        return cls(rows, groups)


BIG_M = 1024
BIG_TILES: tuple[int, int] | None = None  # (rows, groups) from BIG_M rows, once measured
# RMSNorm + quantisation at a dual step's 32 rows by the device's kernel time (H200,
# RESULTS.md twenty-third session): whole rows 1 x 32 x 8 3.0 us, 1 x 32 x 4 3.3, against
# 5.0 for the 16 x 1 x 4 tiles with XLA's statistics pass (two more launches); 1 x 32 x 1
# 5.7. At batch 1's full canvas of 768 rows (H100, RESULTS.md forty-seventh session) whole
# rows took the FFN 1.4% less device time but left the step's time as it was (14.74-14.76
# ms alternated), so the tiles stay there.
WHOLE_ROWS_M = 32


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


def rounded(x: jax.Array) -> jax.Array:
    """`x` rounded to its own (half) dtype even inside a fusion: XLA keeps fused half-precision
    intermediates in fp32 by default (`xla_allow_excess_precision`), which skips roundings
    that LLaDA's PyTorch code performs."""
    if x.dtype in (jnp.bfloat16, jnp.float16):
        info = jnp.finfo(x.dtype)
        return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x


def rms_normed(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """LLaDA's RMSNorm: fp32 statistics, rounded to x's dtype before the weight multiply,
    whose product is rounded too (as PyTorch's half-precision ops do)."""
    return rounded(rounded((x.astype(jnp.float32) * rms_rstd(x, eps)).astype(x.dtype)) * w)


def rmsnorm_quant_ref(x_MD, w_D, eps: float):
    return quantize_groups(rms_normed(x_MD, w_D, eps))


def swiglu_quant_ref(gate_up_M2F):
    gate, up = jnp.split(gate_up_M2F.astype(jnp.float32), 2, axis=-1)
    return quantize_groups(jax.nn.silu(gate) * up)


# --- Pallas kernels ------------------------------------------------------------------------

def _quantize_tile(a, keepdims: bool = True):
    """fp32 [..., 128] -> (fp8 tile, fp32 [..., 1] scales, or [rows] without `keepdims`:
    Mosaic GPU reduces a [rows, 128] tile to a row vector and has no reshape of it); same
    arithmetic as `to_fp8`."""
    amax = jnp.max(jnp.abs(a), axis=-1, keepdims=keepdims)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    full = scale if keepdims else jax.lax.broadcast_in_dim(scale, a.shape,
                                                           tuple(range(a.ndim - 1)))
    return jnp.clip(a / full, -FP8_MAX, FP8_MAX).astype(FP8), scale


def _put_scale(s_ref, g: int, scale_R1, group_major: bool):
    """Store group g's scales [rows, 1] into the tile's scale block: [rows, groups], or
    [groups, rows] where the scales are written group-major (`scales_group_major`)."""
    if group_major:
        s_ref[pl.ds(g, 1), :] = scale_R1.reshape(1, -1)
    else:
        s_ref[:, pl.ds(g, 1)] = scale_R1


def _rmsnorm_quant_kernel(x_ref, rstd_ref, w_ref, q_ref, s_ref, *, interpret: bool,
                          group_major: bool):
    _norm_quantize(x_ref, rstd_ref[...], w_ref, q_ref, s_ref, interpret, group_major)


def _normed(x, rstd, w, interpret: bool):
    """x times `rstd` [rows, 1], rounded to x's dtype, times the weight, rounded (LLaDA's
    RMSNorm, `rms_normed`), as fp32."""
    # Triton rounds at every half-precision cast and product; XLA, which runs the kernel in
    # interpret mode, may not (`rounded`), and the Triton lowering has no reduce_precision.
    round_ = rounded if interpret else (lambda a: a)
    return round_(round_((x.astype(jnp.float32) * rstd).astype(x.dtype)) * w[None, :]).astype(
        jnp.float32)


def _norm_quantize(x_ref, rstd, w_ref, q_ref, s_ref, interpret: bool, group_major: bool):
    """Normalise (times `rstd` [rows, 1]), round, weight and quantise the tile group by group."""
    for g in range(q_ref.shape[1] // GROUP):  # the tile's 128-column groups, one scale each
        cols = pl.ds(g * GROUP, GROUP)
        q_ref[:, cols], scale = _quantize_tile(_normed(x_ref[:, cols], rstd, w_ref[cols],
                                                       interpret))
        _put_scale(s_ref, g, scale, group_major)


def _rmsnorm_quant_rows_kernel(x_ref, w_ref, q_ref, s_ref, *, eps: float, interpret: bool,
                               group_major: bool):
    """Whole rows, as whole-tile vector ops (one load of the [rows, D] tile, one reduction
    per statistic, the groups as a [rows, G, 128] view): the rows' fp32 mean of squares, then
    the tiled kernel's per-element arithmetic and one amax per group. (A loop over the groups,
    its first form, unrolled into 2 x 32 group steps at D 4096, ran 8-13x its byte floor by
    chained wall time; this form, one row per program over 8 warps, is RMSNorm's default at
    up to `WHOLE_ROWS_M` rows.)"""
    R, D = x_ref.shape
    x = x_ref[...]
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.sum(x32 * x32, axis=1, keepdims=True) / D + eps)
    h = _normed(x, rstd, w_ref[...], interpret).reshape(R, D // GROUP, GROUP)
    q, scale = _quantize_tile(h)
    q_ref[...] = q.reshape(R, D)
    scale = scale.reshape(R, D // GROUP)
    s_ref[...] = scale.T if group_major else scale


def swiglu_quantize_tile(gate, up, keepdims: bool = True):
    """silu(gate) * up of one [rows, 128] group in fp32, quantised (`_quantize_tile`): the
    SwiGLU kernels' one expression (the fused gate/up kernels, kernels/gate_up_swiglu.py and
    fp8_matmul_mgpu_ws.gate_up_swiglu_mgpu_ws, use it too)."""
    gate = gate.astype(jnp.float32)
    return _quantize_tile(gate * jax.nn.sigmoid(gate) * up.astype(jnp.float32), keepdims)


def _swiglu_quant_kernel(gate_ref, up_ref, q_ref, s_ref, *, group_major: bool):
    for g in range(q_ref.shape[1] // GROUP):
        cols = pl.ds(g * GROUP, GROUP)
        q_ref[:, cols], scale = swiglu_quantize_tile(gate_ref[:, cols], up_ref[:, cols])
        _put_scale(s_ref, g, scale, group_major)


def _pad_rows(x, rows):
    M = x.shape[0]
    Mp = pl.cdiv(M, rows) * rows
    return (x if Mp == M else jnp.pad(x, [(0, Mp - M), (0, 0)])), M, Mp


def _quantising_call(kernel, inputs, in_specs, M: int, Mp: int, G: int, tiles: QuantTiles,
                     name: str, interpret: bool, poison: bool, group_major: bool):
    """One program per `tiles` tile: fp8 [M, G * 128] and scales [M, G] (the transpose of
    the [G, Mp] the kernel writes where `group_major`). With `poison` (tests) the outputs are
    NaN-filled inputs aliased to them, never read."""
    R, C = tiles.rows, tiles.groups
    out_shape = [jax.ShapeDtypeStruct((Mp, G * GROUP), FP8),
                 jax.ShapeDtypeStruct((G, Mp) if group_major else (Mp, G), jnp.float32)]
    out_specs = [pl.BlockSpec((R, C * GROUP), lambda i, g: (i, g)),
                 pl.BlockSpec((C, R), lambda i, g: (g, i)) if group_major else
                 pl.BlockSpec((R, C), lambda i, g: (i, g))]
    poisoned = [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape] if poison else []
    n_in = len(inputs)

    def body(*refs):
        kernel(*refs[:n_in], *refs[n_in + len(poisoned):], group_major=group_major)

    q, s = pl.pallas_call(
        body, grid=(Mp // R, G // C), in_specs=in_specs + out_specs[:len(poisoned)],
        out_specs=out_specs, out_shape=out_shape, interpret=interpret, name=name,
        compiler_params=_triton(tiles.warps),
        input_output_aliases={n_in + j: j for j in range(len(poisoned))},
    )(*inputs, *poisoned)
    return q[:M], (s[:, :M].T if group_major else s[:M])


def _tiles(tiles: QuantTiles | None, M: int, G: int) -> QuantTiles:
    t = tiles or QuantTiles.get_default(M, G)
    if G % t.groups or t.groups & (t.groups - 1) or t.rows < 1 or t.rows & (t.rows - 1):
        raise ValueError(f"tiles {t}: groups must be a power of two dividing the {G} groups "
                         f"of 128 and rows a power of two (Triton's block shapes)")
    if t.warps not in (1, 2, 4, 8):
        raise ValueError(f"tiles {t}: warps must be 1, 2, 4 or 8")
    return t


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret", "poison",
                                             "group_major"))
def rmsnorm_quant_pallas(x_MD, w_D, eps: float, *, tiles: QuantTiles | None = None,
                         interpret: bool = False, poison: bool = False,
                         group_major: bool = False):
    """RMSNorm fused with 1 x 128 quantisation: the normed activation is never written.
    The row statistics come first from the bf16 path's own expression (`rms_rstd`, one read
    of x by XLA); the kernel then normalises, rounds, weights and quantises one `tiles` tile
    per program. `poison` (tests) pre-fills outputs; `group_major`: the kernel writes the
    scales [D / 128, M] (the [M, D / 128] returned is their transpose)."""
    M, D = x_MD.shape
    if D % GROUP:
        raise ValueError(f"width must be a multiple of {GROUP}, got {D}")
    G = D // GROUP
    t = _tiles(tiles or QuantTiles.get_default(M, G, whole_rows=True), M, G)
    x, M, Mp = _pad_rows(x_MD, t.rows)
    cols = t.groups * GROUP
    x_spec = pl.BlockSpec((t.rows, cols), lambda i, g: (i, g))
    w_spec = pl.BlockSpec((cols,), lambda i, g: (g,))
    if t.groups == G:  # whole rows: the statistics inside the kernel
        kernel = functools.partial(_rmsnorm_quant_rows_kernel, eps=eps, interpret=interpret)
        return _quantising_call(kernel, (x, w_D), [x_spec, w_spec], M, Mp, G, t,
                                "rmsnorm_quant_rows", interpret, poison, group_major)
    rstd, _, _ = _pad_rows(rms_rstd(x_MD, eps), t.rows)
    in_specs = [x_spec, pl.BlockSpec((t.rows, 1), lambda i, g: (i, 0)), w_spec]
    kernel = functools.partial(_rmsnorm_quant_kernel, interpret=interpret)
    return _quantising_call(kernel, (x, rstd, w_D), in_specs, M, Mp, G, t, "rmsnorm_quant",
                            interpret, poison, group_major)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "poison", "group_major"))
def swiglu_quant_pallas(gate_up_M2F, *, tiles: QuantTiles | None = None,
                        interpret: bool = False, poison: bool = False,
                        group_major: bool = False):
    """Fused silu(gate) * up + 1 x 128 quantisation of [M, 2F] = [gate | up] (`group_major`:
    as `rmsnorm_quant_pallas`'s)."""
    M, F2 = gate_up_M2F.shape
    F = F2 // 2
    if F % GROUP or F2 % 2:
        raise ValueError(f"gate|up width must be 2 x a multiple of {GROUP}, got {F2}")
    G = F // GROUP
    t = _tiles(tiles, M, G)
    x, M, Mp = _pad_rows(gate_up_M2F, t.rows)
    cols, up = t.groups * GROUP, G // t.groups  # up's first block, in tiles
    in_specs = [pl.BlockSpec((t.rows, cols), lambda i, g: (i, g)),
                pl.BlockSpec((t.rows, cols), lambda i, g: (i, g + up))]
    return _quantising_call(_swiglu_quant_kernel, (x, x), in_specs, M, Mp, G, t,
                            "swiglu_quant", interpret, poison, group_major)


def _triton(warps: int = 4):
    # Triton compiler params also select the Triton lowering (the GPU default is Mosaic).
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=warps, num_stages=2)


def rmsnorm_quant(x_MD, w_D, eps: float):
    """Dispatch: the Pallas kernel on GPU (scales in the layout the GEMM of these rows
    reads), the reference elsewhere."""
    if jax.default_backend() == "gpu":
        return rmsnorm_quant_pallas(x_MD, w_D, eps,
                                    group_major=scales_group_major(x_MD.shape[0]))
    return rmsnorm_quant_ref(x_MD, w_D, eps)


def swiglu_quant(gate_up_M2F):
    if jax.default_backend() == "gpu":
        return swiglu_quant_pallas(gate_up_M2F,
                                   group_major=scales_group_major(gate_up_M2F.shape[0]))
    return swiglu_quant_ref(gate_up_M2F)

