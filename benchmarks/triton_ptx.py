"""The Pallas Triton kernels' PTX without a GPU (issues 17, 20): what their loops load and wait on.

    python -m benchmarks.triton_ptx OUT [--kernel fp8_matmul] [--shape down] [--m 32]
                                        [--tiles swap=0,...]
    python -m benchmarks.triton_ptx OUT --kernel flash_cache [--m 128] [--tiles rows=64,...]
    python -m benchmarks.triton_ptx OUT --compile [--kernel ...]   (with a Python that has triton)

Lowers the kernel for CUDA on this machine (as the tests' Triton IR check does) and writes the
Triton module Pallas makes (`OUT/<kernel>.ttir`): `fp8_matmul` (the FP8 GEMM at an FFN shape)
or `flash_cache` (the fused cache update at LLaDA-8B's widths, M query rows). Where the
`triton` package is importable it goes on to `--compile`, which needs only triton (not a
dependency: e.g. `pip install triton` in a separate venv, whose Python then runs `--compile`
from this checkout): Triton's own `make_ttir` passes first (what XLA's Triton pipeline also
runs: the combine pass folds `acc + dot(a, b, 0)` into `dot(a, b, acc)`, which decides how a
wgmma loop pipelines; compiling the module as lowered skips them), then compile for sm_90,
write the PTX beside it and print `ptx_loops`' count of the kernel and its largest loop.
That is Triton's own compiler, not the one inside XLA, whose version may differ; jax 0.11.2's
XLA writes no PTX to its dump (thirty-third session).

`--tiles` changes the default tiles' fields (`TritonTiles` or `flash_cache.BlockSizes`),
e.g. `swap=0` or `splits=6,num_stages=4`.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from benchmarks.ptx_loops import report


def lower_for_cuda(fn, *args) -> None:
    """Lower jitted `fn(*args)` for CUDA (no GPU needed) through a fresh function: a lowering
    jax cached from an earlier call on `fn` would build no kernel module to read."""
    import jax
    jax.jit(lambda *a: fn(*a)).trace(*args).lower(lowering_platforms=("cuda",))


def triton_modules(fn, *args, each=str) -> list:
    """`each(module)` for every Triton module Pallas makes while lowering jitted `fn(*args)`
    for CUDA (no GPU needed), in lowering order: the module lives only inside the lowering,
    so `each` reads it there (its text, or MLIR's verifier: tests/conftest.py)."""
    from jax._src.pallas.triton import pallas_call_registration as registration
    lower = registration.lowering.lower_jaxpr_to_triton_module
    seen = []

    def keep(*a, **kw):
        result = lower(*a, **kw)
        seen.append(each(result.module))
        return result
    registration.lowering.lower_jaxpr_to_triton_module = keep
    try:
        lower_for_cuda(fn, *args)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return seen


def _one(fn, *args) -> str:
    modules = triton_modules(fn, *args)
    if len(modules) != 1:
        raise RuntimeError(f"expected one Triton module, got {len(modules)}")
    return modules[0]


def triton_module(M: int, K: int, N: int, tiles) -> str:
    """The text of the Triton module Pallas lowers `fp8_matmul_pallas` to (no GPU needed)."""
    import jax
    import jax.numpy as jnp

    from kernels.fp8_matmul_triton import GROUP, fp8_matmul_pallas
    S = jax.ShapeDtypeStruct
    return _one(lambda *a: fp8_matmul_pallas(*a, tiles=tiles),
                S((M, K), jnp.float8_e4m3fn), S((M, K // GROUP), jnp.float32),
                S((N, K), jnp.float8_e4m3fn), S((N // GROUP, K // GROUP), jnp.float32))


def flash_cache_module(M: int, block, D: int = 4096, heads: int = 32, kv_heads: int = 32,
                       head_dim: int = 128, T: int = 1024) -> str:
    """The text of the Triton module of `flash_cache_pallas` for one batch row of M query
    rows (LLaDA-8B's widths by default)."""
    import jax
    import jax.numpy as jnp

    from kernels.flash_cache import flash_cache_pallas
    S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    cache = S((1, T, kv_heads, head_dim), bf16)
    table = S((1, M, head_dim // 2), jnp.float32)
    return _one(lambda *a: flash_cache_pallas(*a, n_heads=heads, block=block),
                S((1, M, D), bf16), S((D, (heads + 2 * kv_heads) * head_dim), bf16),
                table, table, S((1, M), jnp.int32), cache, cache)


def parse_tiles(base, spec: str):
    """`base` (a tiles dataclass) with the fields of `spec` (name=int,...) changed."""
    fields = {f.name: f.type for f in dataclasses.fields(base)}
    changes = {}
    for entry in filter(None, spec.split(",")):
        name, _, value = entry.partition("=")
        if name not in fields:
            raise SystemExit(f"--tiles {entry!r}: {type(base).__name__} has no field {name!r}")
        changes[name] = bool(int(value)) if fields[name] in (bool, "bool") else int(value)
    return dataclasses.replace(base, **changes)


def compile_ptx(out: Path, kernel: str, num_warps: int, num_stages: int) -> list[str]:
    """`out/<kernel>.ttir` through Triton's `make_ttir` passes (written to
    `out/<kernel>.made.ttir`), compiled for sm_90: its PTX written beside it, and
    `ptx_loops`' lines for it."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ir.parse_mlir_module(str(out / f"{kernel}.ttir"), context)
    module.context = context  # as triton.compile's IRSource does before its passes
    made = out / f"{kernel}.made.ttir"
    made.write_text(str(backend.make_ttir(module, {}, backend.parse_options(options), 90)))
    compiled = triton.compile(str(made), target=target, options=options)
    (out / f"{kernel}.ptx").write_text(compiled.asm["ptx"])
    return [f"triton {triton.__version__}:"] + report(out, kernel, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--kernel", default="fp8_matmul", choices=("fp8_matmul", "flash_cache"))
    ap.add_argument("--shape", default="down", choices=("down", "gate_up"),
                    help="fp8_matmul's FFN shape")
    ap.add_argument("--m", type=int, help="rows (default: 32 fp8_matmul, 128 flash_cache)")
    ap.add_argument("--tiles", default="", help="tile fields changed: name=int,...")
    ap.add_argument("--imprecise-acc", type=int, default=0,
                    help="kernels.fp8_matmul_triton.IMPRECISE_ACC while lowering (32: wgmma)")
    ap.add_argument("--compile", action="store_true",
                    help="only compile OUT/<kernel>.ttir (needs triton, not jax)")
    ap.add_argument("--warps", type=int, default=4, help="with --compile")
    ap.add_argument("--stages", type=int, default=3, help="with --compile")
    args = ap.parse_args()
    if args.compile:
        print("\n".join(compile_ptx(args.out, args.kernel, args.warps, args.stages)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.kernel == "fp8_matmul":
        from benchmarks.fp8_tiles import SHAPES
        from kernels import fp8_matmul_triton
        from kernels.fp8_matmul_triton import TritonTiles
        fp8_matmul_triton.IMPRECISE_ACC = args.imprecise_acc
        M, (K, N) = args.m or 32, SHAPES[args.shape]
        tiles = parse_tiles(TritonTiles.get_default(M, N, K), args.tiles)
        text, warps, stages = triton_module(M, K, N, tiles), tiles.num_warps, tiles.num_stages
    else:
        from kernels.flash_cache import BlockSizes
        M = args.m or 128
        tiles = parse_tiles(BlockSizes.get_default(M, 4096), args.tiles)
        text, warps, stages = flash_cache_module(M, tiles), tiles.warps, tiles.stages
    ttir = args.out / f"{args.kernel}.ttir"
    ttir.write_text(text)
    print(tiles, "->", ttir)
    try:
        lines = compile_ptx(args.out, args.kernel, warps, stages)
    except ImportError:
        print(f"no triton package here: compile with --compile --kernel {args.kernel} "
              f"--warps {warps} --stages {stages} where there is one")
        return
    print("\n".join(lines))


if __name__ == "__main__":
    main()
