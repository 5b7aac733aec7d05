"""Digests of the GPU kernels' lowerings without a GPU: proof that a refactor of a kernel left
what the GPU runs unchanged, on a machine with no GPU to run it on.

    python -m benchmarks.lowering_digest > before.txt     (at the old commit)
    python -m benchmarks.lowering_digest --compare before.txt

Lowers the FP8 FFN's kernels for CUDA at their dispatched configurations and at every
configuration their device sweeps time: the Mosaic GPU GEMMs (`fp8_matmul_mgpu_ws`, plain
and with the SwiGLU epilogue, the split last wave included: `fp8_gemm.WS_SWEEP`,
`SWIGLU_SWEEP`) and the Triton GEMM (`fp8_matmul_pallas`, decode tiles and their sweep's
axes). Each line is one configuration and a digest of the kernel modules Pallas builds for it
(as text without source locations: a kernel whose lines moved gives the same digest) and of
the jitted program around them (its jaxpr: the operand copies and sums XLA runs beside the
kernels). `--compare` lists the configurations whose digest changed, appeared or went, and
exits 1 if any did. 168 configurations in about 30 s on one CPU core. First used for the
forty-ninth session's removals (the w scales read as stored, the Triton split-K sum and
gate/up epilogue): from bbe8545 to d81dcaf only the removed knob's four sweep rows went.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
from pathlib import Path


def mosaic_modules(fn, *args) -> list[str]:
    """The text, without locations, of every Mosaic GPU module Pallas builds while lowering
    jitted `fn(*args)` for CUDA, in lowering order (read before serialisation: the bytecode
    Pallas embeds carries each op's file and line)."""
    from jax.experimental.mosaic.gpu import core

    from benchmarks.triton_ptx import lower_for_cuda
    real, seen = core._run_serde_pass, []

    def keep(module, *, serialize, **kw):
        if serialize:
            seen.append(module.operation.get_asm(enable_debug_info=False))
        return real(module, serialize=serialize, **kw)
    core._run_serde_pass = keep
    try:
        lower_for_cuda(fn, *args)
    finally:
        core._run_serde_pass = real
    if not seen:
        raise RuntimeError("no Mosaic GPU module was built (a jax without the serde pass?)")
    return seen


def digest(fn, *args, modules) -> str:
    """12 hex digits over `modules(fn, *args)` and the jaxpr of `fn(*args)`."""
    import jax
    h = hashlib.sha1()
    for text in modules(fn, *args) + [str(jax.make_jaxpr(fn)(*args))]:
        h.update(text.encode())
    return h.hexdigest()[:12]


def fp8_operands(M: int, K: int, N: int):
    import jax
    import jax.numpy as jnp
    S = jax.ShapeDtypeStruct
    return (S((M, K), jnp.float8_e4m3fn), S((M, K // 128), jnp.float32),
            S((N, K), jnp.float8_e4m3fn), S((N // 128, K // 128), jnp.float32))


def mosaic_cases():
    """(name, fn, operands) of the Mosaic GPU FP8 kernels: defaults at decode to batch-8 rows,
    bf16 and f32 out; the knob sweeps at 1,024 (plain) and 768 / 4,608 rows (SwiGLU); the
    wave-filling tile at 768."""
    import functools

    import jax.numpy as jnp

    from benchmarks.fp8_gemm import SHAPES, SWIGLU_SWEEP, WS_SWEEP
    from kernels.fp8_matmul_mgpu_ws import WsConfig, fp8_matmul_mgpu_ws, gate_up_swiglu_mgpu_ws
    P = functools.partial
    for M in (64, 768, 1000, 1024, 4096):
        for shape, (K, N) in SHAPES.items():
            for dt in (jnp.bfloat16, jnp.float32):
                yield (f"mgpu_ws {shape} M{M} {jnp.dtype(dt).name}",
                       P(fp8_matmul_mgpu_ws, out_dtype=dt), fp8_operands(M, K, N))
    for kw in WS_SWEEP:
        for shape, (K, N) in SHAPES.items():
            c = dataclasses.replace(WsConfig.get_default(1024, N, K), **kw)
            yield (f"mgpu_ws {shape} M1024 {kw}", P(fp8_matmul_mgpu_ws, config=c),
                   fp8_operands(1024, K, N))
    K, N = SHAPES["down"]
    yield ("mgpu_ws down M768 wave filling",
           P(fp8_matmul_mgpu_ws, config=WsConfig.get_wave_filling(768, N, K)),
           fp8_operands(768, K, N))
    K, N = SHAPES["gate_up"]
    for M in (768, 1000, 1536, 4608, 6144):
        yield f"swiglu M{M}", gate_up_swiglu_mgpu_ws, fp8_operands(M, K, N)
    for kw in SWIGLU_SWEEP:
        for M in (768, 4608):
            c = dataclasses.replace(WsConfig.get_default_swiglu(M, N // 2, K), **kw)
            yield (f"swiglu M{M} {kw}", P(gate_up_swiglu_mgpu_ws, config=c),
                   fp8_operands(M, K, N))


def triton_cases():
    """(name, fn, operands) of the Triton FP8 GEMM: default tiles from 1 to 128 rows at both
    FFN shapes, each also transposed the other way, 4 stages and 8 warps; at decode rows the
    decode sweep's narrow tiles and splits."""
    import functools

    from benchmarks.fp8_gemm import SHAPES
    from kernels.fp8_matmul_triton import TritonTiles, fp8_matmul_pallas
    for M in (1, 9, 16, 20, 32, 40, 64, 128):
        for shape, (K, N) in SHAPES.items():
            base = TritonTiles.get_default(M, N, K)
            variants = [base, dataclasses.replace(base, swap=not base.swap),
                        dataclasses.replace(base, num_stages=4),
                        dataclasses.replace(base, num_warps=8)]
            if M <= 32:
                variants += [dataclasses.replace(base, block_n=bn, splits=s)
                             for bn, s in ((32, 1), (64, 2), (64, 4))]
            for t in variants:  # named by field (a new field must not rename every line)
                name = (f"triton {shape} M{M} {t.block_m}x{t.block_n} splits {t.splits} "
                        f"warps {t.num_warps} stages {t.num_stages} swap {int(t.swap)}")
                yield name, functools.partial(fp8_matmul_pallas, tiles=t), fp8_operands(M, K, N)


def lines() -> list[str]:
    from benchmarks.triton_ptx import triton_modules
    out = [f"{name}: {digest(fn, *args, modules=mosaic_modules)}"
           for name, fn, args in mosaic_cases()]
    return out + [f"{name}: {digest(fn, *args, modules=triton_modules)}"
                  for name, fn, args in triton_cases()]


def compare(old: list[str], new: list[str]) -> list[str]:
    """What changed between two runs' lines: `changed`, `new` or `gone`, by name."""
    split = lambda ls: dict(line.rsplit(": ", 1) for line in ls if ": " in line)
    a, b = split(old), split(new)
    return ([f"changed {k}" for k in a if k in b and a[k] != b[k]]
            + [f"new {k}" for k in b if k not in a] + [f"gone {k}" for k in a if k not in b])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", type=Path, help="an earlier run's output: list what changed")
    args = ap.parse_args(argv)
    import jax
    jax.config.update("jax_platforms", "cpu")
    now = lines()
    if args.compare is None:
        print("\n".join(now))
        return 0
    diff = compare(args.compare.read_text().splitlines(), now)
    print("\n".join(diff) if diff else f"all {len(now)} lowerings unchanged")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
