"""The FP8 Triton GEMM's PTX without a GPU (issue 20): what its K loop loads and waits on.

    python -m benchmarks.triton_ptx OUT [--shape down] [--m 32] [--tiles scales_ahead=1,...]
    python -m benchmarks.triton_ptx OUT --compile    (with a Python that has triton)

Lowers `fp8_matmul_pallas` at an FFN shape for CUDA on this machine (as the tests' Triton IR
check does) and writes the Triton module Pallas makes (`OUT/fp8_matmul.ttir`). Where the
`triton` package is importable it goes on to `--compile`, which needs only triton (not a
dependency: e.g. `pip install triton` in a separate venv, whose Python then runs `--compile`
from this checkout): compile `OUT/fp8_matmul.ttir` for sm_90, write its PTX beside it and
print `ptx_loops`' count of the kernel and its largest loop. That is Triton's own compiler,
not the one inside XLA, whose version may differ; jax 0.11.2's XLA writes no PTX to its dump
(thirty-third session).

`--tiles` changes the default tiles' fields (`TritonTiles`), e.g. `scales_ahead=1` or
`splits=6,num_stages=4`.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from benchmarks.ptx_loops import report


def triton_module(M: int, K: int, N: int, tiles) -> str:
    """The text of the Triton module Pallas lowers `fp8_matmul_pallas` to (no GPU needed)."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as registration

    from kernels.fp8_matmul_triton import GROUP, fp8_matmul_pallas
    lower = registration.lowering.lower_jaxpr_to_triton_module
    modules = []

    def keep(*a, **kw):
        result = lower(*a, **kw)
        modules.append(str(result.module))
        return result
    registration.lowering.lower_jaxpr_to_triton_module = keep
    try:
        args = (jax.ShapeDtypeStruct((M, K), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((M, K // GROUP), jnp.float32),
                jax.ShapeDtypeStruct((N, K), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((N // GROUP, K // GROUP), jnp.float32))
        jax.jit(lambda *a: fp8_matmul_pallas(*a, tiles=tiles)).trace(*args).lower(
            lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    if len(modules) != 1:
        raise RuntimeError(f"expected one Triton module, got {len(modules)}")
    return modules[0]


def parse_tiles(base, spec: str):
    """`base` (TritonTiles) with the fields of `spec` (name=int,...) changed."""
    fields = {f.name: f.type for f in dataclasses.fields(base)}
    changes = {}
    for entry in filter(None, spec.split(",")):
        name, _, value = entry.partition("=")
        if name not in fields:
            raise SystemExit(f"--tiles {entry!r}: TritonTiles has no field {name!r}")
        changes[name] = bool(int(value)) if fields[name] in (bool, "bool") else int(value)
    return dataclasses.replace(base, **changes)


def compile_ptx(out: Path, num_warps: int, num_stages: int) -> list[str]:
    """`out/fp8_matmul.ttir` compiled by Triton for sm_90: its PTX written beside it, and
    `ptx_loops`' lines for it."""
    import triton
    from triton.backends.compiler import GPUTarget
    compiled = triton.compile(str(out / "fp8_matmul.ttir"), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    (out / "fp8_matmul.ptx").write_text(compiled.asm["ptx"])
    return [f"triton {triton.__version__}:"] + report(out, "fp8_matmul", 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="down", choices=("down", "gate_up"))
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--tiles", default="", help="TritonTiles fields changed: name=int,...")
    ap.add_argument("--imprecise-acc", type=int, default=0,
                    help="kernels.fp8_matmul_triton.IMPRECISE_ACC while lowering (32: wgmma)")
    ap.add_argument("--compile", action="store_true",
                    help="only compile OUT/fp8_matmul.ttir (needs triton, not jax)")
    ap.add_argument("--warps", type=int, default=4, help="with --compile")
    ap.add_argument("--stages", type=int, default=3, help="with --compile")
    args = ap.parse_args()
    if args.compile:
        print("\n".join(compile_ptx(args.out, args.warps, args.stages)))
        return
    from benchmarks.fp8_tiles import SHAPES
    from kernels import fp8_matmul_triton
    from kernels.fp8_matmul_triton import TritonTiles
    fp8_matmul_triton.IMPRECISE_ACC = args.imprecise_acc
    K, N = SHAPES[args.shape]
    tiles = parse_tiles(TritonTiles.get_default(args.m, N, K), args.tiles)
    args.out.mkdir(parents=True, exist_ok=True)
    ttir = args.out / "fp8_matmul.ttir"
    ttir.write_text(triton_module(args.m, K, N, tiles))
    print(tiles, "->", ttir)
    try:
        lines = compile_ptx(args.out, tiles.num_warps, tiles.num_stages)
    except ImportError:
        print(f"no triton package here: compile with --compile --warps {tiles.num_warps} "
              f"--stages {tiles.num_stages} where there is one")
        return
    print("\n".join(lines))


if __name__ == "__main__":
    main()
