"""`benchmarks/lowering_digest.py`: kernel lowerings compared without a GPU."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys

import jax

from benchmarks.lowering_digest import compare, digest, fp8_operands, mosaic_modules
from benchmarks.triton_ptx import triton_modules
from tests.conftest import ROOT


def load_copy(folder, name: str, shift: int, monkeypatch):
    """kernels/fp8_matmul_mgpu_ws.py copied into `folder` and loaded as `name`, with `shift`
    comment lines before its code: the same kernel, every source line moved."""
    copy = folder / f"{name}.py"
    copy.write_text("# moved\n" * shift + (ROOT / "kernels/fp8_matmul_mgpu_ws.py").read_text())
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_moved_lines_keep_the_digest_a_changed_kernel_does_not(tmp_path, monkeypatch):
    """The Mosaic GPU GEMM from two copies of its file, one with every line moved: the CUDA
    export differs (its bytecode carries file:line locations), the digest does not; another
    pipeline depth changes it."""
    a, b = (load_copy(tmp_path, f"ws_copy_{n}", n, monkeypatch) for n in (0, 3))
    args = fp8_operands(64, 1024, 512)
    fns = [functools.partial(m.fp8_matmul_mgpu_ws, config=m.WsConfig.get_default(64, 512, 1024))
           for m in (a, b)]
    exported = [jax.export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
                for f in fns]
    assert exported[0] != exported[1]
    assert digest(fns[0], *args, modules=mosaic_modules) == digest(fns[1], *args,
                                                                   modules=mosaic_modules)
    c = a.WsConfig.get_default(64, 512, 1024)
    deeper = dataclasses.replace(c, stages=2 if c.stages != 2 else 4, steady=False)
    assert digest(functools.partial(a.fp8_matmul_mgpu_ws, config=deeper), *args,
                  modules=mosaic_modules) != digest(fns[0], *args, modules=mosaic_modules)


def test_triton_digest_sees_the_tiles():
    """The same function twice gives the same digest (its second lowering, which jax would
    serve from its cache, still builds the module), other tiles another."""
    from kernels.fp8_matmul_triton import TritonTiles, fp8_matmul_pallas
    args = fp8_operands(32, 1024, 512)
    t = TritonTiles.get_default(32, 512, 1024)
    fn = functools.partial(fp8_matmul_pallas, tiles=t)
    other = functools.partial(fp8_matmul_pallas,
                              tiles=dataclasses.replace(t, num_stages=t.num_stages + 1))
    one, again, changed = (digest(f, *args, modules=triton_modules) for f in (fn, fn, other))
    assert one == again != changed


def test_compare_names_what_changed_appeared_or_went():
    old = ["a: 111", "b: 222", "c: 333"]
    new = ["a: 111", "b: 999", "d: 444"]
    assert compare(old, new) == ["changed b", "new d", "gone c"]
    assert compare(old, old) == []
