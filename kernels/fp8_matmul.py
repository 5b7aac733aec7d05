"""Per-group scaled FP8 GEMM (REFERENCE.md §7): x [M, K] float8_e4m3fn with one fp32 scale per
1 x 128 group, times w [N, K] float8_e4m3fn (K-major, as Hopper's FP8 MMA reads it) with one
scale per 128 x 128 block, -> [M, N] in `out_dtype`.

Each 128-wide K group's FP8 products are summed by the tensor cores, then multiplied by (x scale
of the row) x (w scale of the block) and added to an fp32 accumulator. This module owns the
contract (`_check`), the pure-jnp reference (`fp8_matmul_ref`) and the dispatch (`fp8_matmul`);
one lowering per file:

- `fp8_cublaslt.py`: cuBLASLt's own block-scaled FP8 GEMM (Hopper, cuBLAS >= 12.9) as an XLA
  FFI custom call, built on first use.
- `fp8_matmul_mgpu.py`: Pallas Mosaic GPU (TMA + wgmma, Hopper only), `MgpuConfig`.
- `fp8_matmul_triton.py`: Pallas Triton (any GPU with FP8 tensor cores), `TritonTiles`.

XLA's FP8 `dot_general` (cuBLASLt without block scaling) applies one scale per tensor only, so it
cannot compute this product; it is the speed reference in the benchmarks.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

GROUP = 128  # the scheme's group width along K (REFERENCE.md §7); the FP8 kernels import it


def _check(xq, x_scale, wq, w_scale):
    M, K = xq.shape
    N = wq.shape[0]
    if K % GROUP or N % GROUP or wq.shape[1] != K:
        raise ValueError(f"need x [M, K], w [N, K] with N, K multiples of {GROUP}; "
                         f"got {xq.shape}, {wq.shape}")
    if x_scale.shape != (M, K // GROUP) or w_scale.shape != (N // GROUP, K // GROUP):
        raise ValueError(f"scales must be {(M, K // GROUP)} and {(N // GROUP, K // GROUP)}, "
                         f"got {x_scale.shape}, {w_scale.shape}")


def fp8_matmul_ref(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16):
    """Pure-jnp reference: exact per-group products in fp32, then the two scales."""
    _check(xq, x_scale, wq, w_scale)
    M, K = xq.shape
    N = wq.shape[0]
    xg = xq.astype(jnp.float32).reshape(M, K // GROUP, GROUP)
    wg = wq.astype(jnp.float32).reshape(N, K // GROUP, GROUP)
    partial = jnp.einsum("mgk,ngk->mng", xg, wg, precision=jax.lax.Precision.HIGHEST)
    w_scale_NG = jnp.repeat(w_scale, GROUP, axis=0)  # [N, K / 128]
    out = jnp.einsum("mng,mg,ng->mn", partial, x_scale, w_scale_NG,
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype)


def compute_capability() -> tuple[int, int]:
    """(major, minor) of the first GPU."""
    major, minor = jax.devices()[0].compute_capability.split(".")
    return int(major), int(minor)


def sm_count() -> int:
    """Streaming multiprocessors of the first GPU (132 on the H200 where none is reported)."""
    return getattr(jax.devices()[0], "core_count", 132)


# From `benchmarks/fp8_tiles.py` on the H200 (RESULTS.md): at M 32 the Triton kernel with
# split-K is faster (0.043 vs 0.048 ms for gate/up) than the Mosaic GPU one with x on
# wgmma's M side (with the weights there, `MGPU_SWAP_MAX_M`, it is not), from M 256 the
# Mosaic GPU one (2x).
MGPU_MIN_M = 128
# From `benchmarks/fp8_gemm.py` on the H200, 2026-12-03 (benchmarks/RESULTS.md, fourteenth
# session), LLaDA-8B's GEMMs, ms, Triton kernel against cuBLASLt's block-scaled GEMM in one
# run: M 32 gate/up 0.044 vs 0.053, down 0.030 vs 0.039 (Triton); M 48 0.061 vs 0.048, 0.044
# vs 0.035 (cuBLASLt), and cuBLASLt at every M measured from there to 136. Above 32 rows
# Triton's row tile grows to 64, which ran 1.3-1.5x slower (gate/up) than the 32-row tile
# at M 32 (fp8_tiles, same run), so every M > 32 goes to cuBLASLt; 33-47 rows are unmeasured. M is
# padded to a multiple of 8 for it (DPad's and the prefix cache's row counts are arbitrary).
CUBLASLT_MIN_M = 33
# Rows from and up to which Hopper runs the plain Mosaic GPU kernel at
# `WsConfig.get_wave_filling`'s tile in place of cuBLASLt, whose 128 x 128 tiles leave SMs
# idle in the last wave where few waves run (LLaDA-8B's down GEMM at batch 1's 768 rows: 192
# tiles on 132 SMs, the second wave 45% full; 907 TFLOP/s against gate/up's 1,134,
# twenty-second session); max 0: never. Off: 5% faster than cuBLASLt alone at 768 rows but
# batch 1's exact + FP8 step 0.2 ms slower with it (16.21 against 16.00 ms, H100,
# thirty-seventh session, RESULTS.md); 0.74x cuBLASLt's rate at 1,280 rows. From 512 rows:
# below, the GEMM streams its weights in about the time of its FLOPs, and the narrow tiles
# that fill a wave there re-read x (untimed). Read when traced.
WAVE_FILL_MIN_M = 512
WAVE_FILL_MAX_M = 0
# Rows up to which Hopper runs the Mosaic GPU kernel with the weights on wgmma's M side
# (`MgpuConfig.swap`, `get_decode`'s pipeline) in place of the Triton tiles; 0: never. At 32
# rows on an H100 by device time (fiftieth session, RESULTS.md): gate/up 38.3 us against
# Triton's 42.7 (XLA's per-tensor FP8 dot 40.7), down's best setting 22.1 against 24.7
# (23.2); with `get_decode`'s the FFN 0.0666 ms against 0.0717, batch 1's dual step
# 5.27-5.28 ms against 5.35-5.36 (alternated).
# Rows between 33 and 64 stay on cuBLASLt (untimed there). Read when traced.
MGPU_SWAP_MAX_M = 32


def _kernel_for(M: int, wave_fill: bool = True) -> str:
    """The dispatch's first choice for M rows on a GPU with FP8 tensor cores (see
    `fp8_matmul`; cuBLASLt also needs its shape limits, `fp8_cublaslt.supports`);
    `wave_fill=False`: the choice where the wave-filling tile does not pay."""
    cc = compute_capability()
    if wave_fill and cc[0] == 9 and max(MGPU_MIN_M, WAVE_FILL_MIN_M) <= M <= WAVE_FILL_MAX_M:
        return "mgpu_ws"
    if cc[0] == 9 and M <= MGPU_SWAP_MAX_M:
        return "mgpu_swap"
    if cc[0] == 9 and M >= CUBLASLT_MIN_M:
        from kernels import fp8_cublaslt as lt
        if lt.available():
            return "cublaslt"
    return "mgpu" if cc[0] == 9 and M >= MGPU_MIN_M else "triton"


def scales_group_major(M: int) -> bool:
    """Whether `fp8_matmul` reads the activation scales of M rows K-group-major ([K/128, M]):
    cuBLASLt's layout (M a multiple of 8, so no padding comes between), and the Triton
    kernel's transposed tiles (decode rows: `fp8_matmul_triton.swapped`), and the Mosaic GPU
    kernel with swapped operands (up to `MGPU_SWAP_MAX_M` rows). The quantisation
    kernels then write them so, handed out as the [M, K/128] transpose, and XLA cancels it
    against the GEMM's own (each was a kernel launch a layer: 3.2 us of a 768-row FP8 layer's
    ~260 us, 2.3 us of a 32-row one's ~62 us, twenty-second session's traces). The Mosaic GPU
    kernel at `WAVE_FILL_MAX_M`'s rows reads them so too. Where the guess is wrong a
    transpose stays, as before; the result is the same."""
    if jax.default_backend() != "gpu":
        return False
    kernel = _kernel_for(M)
    if kernel == "cublaslt":
        return M % 8 == 0
    if kernel == "mgpu_ws":  # its TMA reads a group's scales as one row
        return True
    if kernel == "mgpu_swap":  # so does its, with x's rows padded to 32 (a pad between)
        return M % 32 == 0
    from kernels import fp8_matmul_triton as tr
    return kernel == "triton" and tr.swapped(M)


def fp8_matmul(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16):
    """Dispatch, by GPU and shape:

    - Hopper, `WAVE_FILL_MIN_M` <= M <= `WAVE_FILL_MAX_M` (off as shipped): the Mosaic GPU
      kernel at DeepGEMM's recipe, its tile filling the last wave
      (`WsConfig.get_wave_filling`), where that leaves less work a SM than cuBLASLt's
      tiles (`WsConfig.fills_waves_better`); else as below.
    - Hopper, M <= `MGPU_SWAP_MAX_M` (32): the Mosaic GPU kernel with the weights on
      wgmma's M side (`MgpuConfig.get_decode`).
    - Hopper, M >= `CUBLASLT_MIN_M`, the handler built (`fp8_cublaslt.available()`):
      cuBLASLt's block-scaled GEMM (1.6x the Mosaic GPU kernel's rate from M 256, ~0.95x
      cuBLASLt's per-tensor FP8 rate at M 768), M padded with zero rows to a multiple of 8.
    - Hopper otherwise from `MGPU_MIN_M` rows: the Mosaic GPU kernel, its pipeline by shape
      (`MgpuConfig.get_default`).
    - else on GPU: the Triton kernel (`TritonTiles.get_default`).
    - elsewhere: the reference.
    GPUs without FP8 tensor cores (before compute capability 8.9, e.g. the A100) are refused:
    Triton cannot compile the FP8 dot."""
    if jax.default_backend() != "gpu":
        return fp8_matmul_ref(xq, x_scale, wq, w_scale, out_dtype)
    cc = compute_capability()
    if cc < (8, 9):
        raise ValueError(f"the FP8 FFN needs FP8 tensor cores (compute capability 8.9 or "
                         f"newer: Ada, Hopper); this GPU's is {cc[0]}.{cc[1]}")
    from kernels import fp8_cublaslt as lt
    from kernels import fp8_matmul_mgpu as mg
    from kernels import fp8_matmul_triton as tr
    (M, K), N = xq.shape, wq.shape[0]
    M8 = -(-M // 8) * 8
    kernel = _kernel_for(M)
    if kernel == "mgpu_ws":
        from kernels import fp8_matmul_mgpu_ws as ws
        config = ws.WsConfig.get_wave_filling(M, N, K, sm_count(), out_dtype)
        if config.fills_waves_better(M, N, sm_count()):
            return ws.fp8_matmul_mgpu_ws(xq, x_scale, wq, w_scale, out_dtype, config=config,
                                         sm_count=sm_count())
        kernel = _kernel_for(M, wave_fill=False)
    if kernel == "mgpu_swap":
        return mg.fp8_matmul_mgpu(xq, x_scale, wq, w_scale, out_dtype,
                                  config=mg.MgpuConfig.get_decode(M, N, K))
    if kernel == "cublaslt" and lt.supports(M8, N, K, out_dtype):
        if M8 == M:
            return lt.fp8_matmul_cublaslt(xq, x_scale, wq, w_scale, out_dtype)
        pad = lambda a: jnp.pad(a, ((0, M8 - M), (0, 0)))  # zero rows, zero scales: 0 out
        return lt.fp8_matmul_cublaslt(pad(xq), pad(x_scale), wq, w_scale, out_dtype)[:M]
    if cc[0] == 9 and M >= MGPU_MIN_M:
        return mg.fp8_matmul_mgpu(xq, x_scale, wq, w_scale, out_dtype,
                                  config=mg.MgpuConfig.get_default(M, N, K, sm_count()))
    return tr.fp8_matmul_pallas(xq, x_scale, wq, w_scale, out_dtype)


# The lowerings' names, importable from here as before the split (loaded on first use: the
# lowering modules import this one).
_LOWERINGS = {"fp8_matmul_pallas": "fp8_matmul_triton", "TritonTiles": "fp8_matmul_triton",
              "k_splits": "fp8_matmul_triton", "row_tile": "fp8_matmul_triton",
              "fp8_matmul_mgpu": "fp8_matmul_mgpu", "MgpuConfig": "fp8_matmul_mgpu",
              "fp8_matmul_cublaslt": "fp8_cublaslt"}


def __getattr__(name):
    if name in _LOWERINGS:
        return getattr(importlib.import_module(f"kernels.{_LOWERINGS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
