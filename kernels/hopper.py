"""What the Mosaic GPU kernels share: Hopper's shared memory per block, the parameters of
Pallas' Mosaic GPU interpreter (their CPU tests' way of running them), a whole-ref load
that works on the jax versions the project runs on (0.10 here, 0.11 on the GPU machines), and
a load and a layout cast that the interpreter skips the layout of."""

from __future__ import annotations

import functools
import inspect

SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block
# what a kernel's buffers may not use: barriers and Mosaic's own (the FACache kernel asked
# 2,704 bytes more than its buffers, eighteenth session)
SMEM_RESERVE = 4096


def smem_refusal(need: int, fix: str) -> str | None:
    """The refusal of a kernel whose buffers need `need` bytes of shared memory, or None."""
    if need > SMEM_BYTES - SMEM_RESERVE:
        return f"{need} bytes of shared memory asked, {SMEM_BYTES - SMEM_RESERVE} fit: {fix}"
    return None


def interpret_params():
    """Pallas' Mosaic GPU interpreter at its defaults (a private module in jax 0.10-0.11;
    tests patch this function to turn on race detection)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def load_whole(ref, layout):
    """`plgpu.load` of all of `ref` in `layout`. jax 0.11 deprecates the separate index
    argument (index the ref instead) that jax 0.10 requires: pass it only where required."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if _load_needs_index():
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def load(ref, layout, interpret: bool = False):
    """All of `ref`, in `layout` where compiled (Pallas' interpreter has no layouts)."""
    return ref[...] if interpret else load_whole(ref, layout)


def layout_cast(x, layout, interpret: bool = False):
    """`x` in `layout` where compiled (Pallas' interpreter has no layouts)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return x if interpret else plgpu.layout_cast(x, layout)


@functools.cache
def _load_needs_index() -> bool:
    """Whether the installed jax's `plgpu.load` has no default for its index (jax 0.10)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    return idx is not None and idx.default is inspect.Parameter.empty
