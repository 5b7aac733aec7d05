"""The FP8 FFN's gate/up GEMM with SwiGLU and the 1 x 128 quantisation of its output in the
GEMM's epilogue (REFERENCE.md §7): the bf16 [M, 2F] gate | up product is never written, and
the SwiGLU + quantisation kernel is not launched.

Shapes: xq [M, K] fp8 e4m3 with x_scale [M, K / 128] (the RMSNorm's quantised output), wq
[2F, K] fp8 (gate rows, then up rows) with w_scale [2F / 128, K / 128]; out (aq [M, F] fp8,
a_scale [M, F / 128] f32), what `fused_quant.swiglu_quant` gives on the GEMM's output.
`gate_up_swiglu_quant_ref` is that composition on the references; `takes` says where the
dispatch (`quant.ffn_fp8`) runs the fused kernel, `gate_up_swiglu_quant` as it runs it there:
from `MGPU_MIN_M` rows on Hopper, the Mosaic GPU GEMM with this epilogue
(`fp8_matmul_mgpu_ws.gate_up_swiglu_mgpu_ws`). A Triton kernel with the same epilogue at
decode rows (the split-K GEMM's last program summing gate and up) was bit for bit the unfused
kernels but made the batch-1 dual step 1.6% slower on an H100: removed after a5b878e
(`kernels/fp8_matmul_triton.py`'s docstring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import fp8_matmul as fm
from kernels.fp8_matmul import GROUP, fp8_matmul_ref
from kernels.fused_quant import swiglu_quant_ref


def gate_up_swiglu_quant_ref(xq, x_scale, wq, w_scale, act_dtype=jnp.bfloat16):
    """The unfused composition: the GEMM rounded to `act_dtype`, then SwiGLU + quantisation."""
    return swiglu_quant_ref(fp8_matmul_ref(xq, x_scale, wq, w_scale, act_dtype))


# Rows from which the dispatch runs the gate/up GEMM with SwiGLU + quantisation in the
# epilogue of the Mosaic GPU kernel (`fp8_matmul_mgpu_ws.gate_up_swiglu_mgpu_ws`) on Hopper,
# in place of cuBLASLt's GEMM and the SwiGLU kernel; 0: never. Timed on an H100 (RESULTS.md
# thirty-fifth session): at batch 8's 4,608 rows the FFN 1.16 ms of kernels against 1.21,
# batch 8's step at 6,144 rows 112.9 ms against 115.4 (its GEMM 8% slower than cuBLASLt's,
# the SwiGLU kernel's 4.6 ms gone), the same tokens; at batch 1's 768 rows (thirty-sixth) the
# FFN 0.234 ms against 0.238, the exact + FP8 step 16.12-16.16 ms against 16.19-16.24, the
# same tokens. Below 768 rows (DPad's compact canvases) untimed, so off there.
# Read when the FFN is traced: set it before the first call (the benchmarks' `--settings`
# time it both ways).
MGPU_MIN_M = 768


def takes(M: int, F: int, K: int) -> bool:
    """Whether the dispatch fuses into the Mosaic GPU kernel: `MGPU_MIN_M` set and reached, on
    Hopper, F and K in whole 128-wide groups, and M in whole 128-row tiles: the FFN pads its
    rows to 16 only, and the kernel's own padding to 128 would add copies of x, the FP8
    output and its scales (56 MB near 4,600 rows) that fuse into no custom call."""
    if not MGPU_MIN_M or M < MGPU_MIN_M or M % GROUP or jax.default_backend() != "gpu":
        return False
    return fm.compute_capability()[0] == 9 and F % GROUP == 0 and K % GROUP == 0


def gate_up_swiglu_quant(xq, x_scale, wq, w_scale, act_dtype=jnp.bfloat16):
    """The fused kernel as the dispatch runs it where `takes` (the caller asks; elsewhere
    `quant.ffn_fp8` runs the GEMM and `fused_quant.swiglu_quant`), on the device's SM count;
    its scales written group-major, the layout the down GEMM of these rows reads. wq holds
    one gate | up column group (all gate rows, then all up rows): a layout of several groups
    (`quant.FP8FFN.tp` above the shards running it) must be reordered first, as
    `quant.ffn_fp8` does."""
    from kernels.fp8_matmul_mgpu_ws import gate_up_swiglu_mgpu_ws
    return gate_up_swiglu_mgpu_ws(xq, x_scale, wq, w_scale, act_dtype, sm_count=fm.sm_count())
