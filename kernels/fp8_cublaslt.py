"""The per-group FP8 GEMM (contract: `kernels/fp8_matmul.py::fp8_matmul_ref`) through cuBLASLt's
block scaling on Hopper (cuBLAS >= 12.9: 128 x 128 weight blocks and 1 x 128 activation groups,
each group's product promoted to fp32), called inside jit as an XLA FFI custom call.

The handler (`csrc/fp8_cublaslt.cc`) is built on first use on a GPU machine, DeepGEMM-style:
g++ (or $CXX) against `jax.ffi.include_dir()`, the CUDA headers and the cuBLASLt / CUDA
runtime libraries found there (the ones this process already loaded, else the pip `nvidia-*`
packages, $CUDA_HOME, /usr/local/cuda), and cached in ~/.cache/lacache_jax (or
$LACACHE_JAX_CACHE) under a hash of the source, the compiler, the CUDA versions and jax's.
`available()` says whether that worked (once per process; one warning when not, and
`kernels/fp8_matmul.py::fp8_matmul` then stays on the Pallas kernels). Forward only: there is no
differentiation rule.

cuBLASLt reads the activation scales M-major ([K / 128, M]) and the weight scales with the K
blocks padded to a multiple of 4 ([N / 128, round_up(K / 128, 4)]): the wrapper passes them so.
Which operand cuBLASLt takes as A (`SWAP`: the weights, writing [M, N] directly, or the
activations, writing [N, M], transposed afterwards) and whether it writes f32
(`F32_OUT`) are probed once by `available()` on a tiny problem, so a cuBLASLt that refuses one
arrangement still serves the other (both run at the same speed on the H200: RESULTS.md).

The algorithm: asked for up to 16, cuBLASLt's heuristic offers exactly one block-scaled FP8
algorithm for every shape tried (M 8 to 4096, both FFN shapes, bf16 and f32 out; commit d9e8500,
2026-12-01), but that algorithm's configuration (tile, pipeline stages, cluster shape, CTA
swizzling, split-K, custom option) is open: `search` times every configuration cuBLASLt
accepts for a problem (`benchmarks/fp8_gemm.py --cublaslt-search`), and `TUNED` holds the
measured winners that the handler then runs (`config_for`), the heuristic's choice everywhere
else or where cuBLASLt refuses a configuration. `TUNED` is empty: on the H200 (2026-12-04,
RESULTS.md twenty-first session) 577 configurations without split-K at M 768-4096 on both FFN
shapes held none faster than the heuristic's beyond the runs' noise. A configuration may
change the output's bits (one of the ten timed at the down shape, M 768, did), so the
benchmark compares each with the heuristic's; split K only with fp32 partials summed in a
fixed order (`search`'s `max_split_k`): none of those was faster at the full canvas's down
GEMM either (twenty-second session). What did win: splitting the output's columns between
two calls in one handler call (`SPLITS`, `split_for`), the first filling whole waves of SMs,
the second with its own configuration; each output element is still one call's sum over all
of K, and the output has one call's bits. The down GEMM at the full canvas's 768 and 1280 rows
takes 13% and 15% less device time so, the gate/up GEMM at 768 rows 6% less kernel time
(H200, 2026-12-04, RESULTS.md twenty-third and twenty-fourth sessions).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels import fp8_matmul as fm

GROUP = fm.GROUP
SOURCE = Path(__file__).parent / "csrc" / "fp8_cublaslt.cc"
TARGET = "lacache_fp8_gemm_cublaslt"
HANDLER = "LacacheFp8GemmCublasLt"
MIN_CUBLASLT = 120900  # block-scaled FP8 (VEC128 / BLK128x128) arrived in cuBLAS 12.9
HEADERS = ("cublasLt.h", "cuda_runtime_api.h", "crt/host_defines.h", "nv/target")
LIBRARIES = ("libcublasLt.so", "libcudart.so")
SWAP = False     # set by available()'s probe: A = activations, output transposed afterwards
F32_OUT = True   # set by available()'s probe: cuBLASLt writes f32 in this arrangement
# A configuration: cuBLASLt's algo id, tile, stages, cluster shape, CTA swizzling, split-K,
# reduction scheme and custom option (its enum values); an algo id < 0 is the heuristic's.
CONFIG_FIELDS = ("algo", "tile", "stages", "cluster", "swizzle", "split_k", "reduction", "custom")
HEURISTIC = (-1, 0, 0, 0, 0, 1, 0, 0)
# (N, K) -> [(from M rows, config)], bf16 out, the arrangement `SWAP` False: measured winners of
# `benchmarks/fp8_gemm.py --cublaslt-search` (RESULTS.md); the last entry whose M bound is met.
TUNED: dict[tuple[int, int], list[tuple[int, tuple[int, ...]]]] = {}
# (M, N, K) -> (n_split, tail configuration), bf16 out, `SWAP` False: the output's columns
# [n_split, N) computed by a second cuBLASLt call in the same handler call, with its own
# configuration, so that the first call's tiles fill whole waves of SMs (the down GEMM at a
# full canvas's 768 rows has 192 tiles of 128 x 128 on 132 SMs, 1.45 waves: 22 of its 32
# column tiles are one wave, the other 10 in 128 x 64 tiles a second of half the length).
# Measured winners of `benchmarks/fp8_gemm.py --cublaslt-split` (RESULTS.md twenty-third
# session: device span 86.7 -> 75.3 us at 768 rows, 139.4 -> 118.4 us at 1280; the other tails
# timed within 2 us of it). The gate/up GEMM at 768 rows (1152 tiles of 128 x 128, 8.7 waves)
# split after 176 column tiles (8 waves), the other 2048 columns in the heuristic's own 128 x
# 128 configuration: kernel time 134.7 -> 126.0 us, device span 156.4 -> 140.4 (twenty-fourth
# session; the other three tails timed 125.8-126.4 / 139.7-143.5, same bits). Batch 8's rows
# fill 9+ waves: no split there. Sized for 132 SMs (H200, H100 SXM); elsewhere it may cost
# time (each output element stays one call's sum over all of K, to within the configuration's
# own summation order).
_DOWN_TAIL = (66, 18, 36, 9, 0, 1, 0, 2)
SPLITS: dict[tuple[int, int, int], tuple[int, tuple[int, ...]]] = {
    (768, 4096, 12288): (2816, _DOWN_TAIL),    # 22 of 32 column tiles: one wave of 132
    (1280, 4096, 12288): (3328, _DOWN_TAIL),   # 26 of 32: two waves (260 of 264)
    (768, 24576, 4096): (22528, (66, 20, 36, 3, 0, 1, 0, 4)),  # 176 of 192: eight waves
}
NO_SPLIT = (0, HEURISTIC)
_LIB: ctypes.CDLL | None = None  # the loaded handler, for `search`


class Unavailable(RuntimeError):
    """No compiler, header or library for the handler, or a cuBLASLt without block scaling."""


def supports(M: int, N: int, K: int, out_dtype) -> bool:
    """Shapes the handler takes (beyond the contract's N, K multiples of 128): M a multiple of
    8 (16-byte rows of the M-major scales and of the output), bf16 or f32 output."""
    dtypes = (jnp.bfloat16, jnp.float32) if F32_OUT else (jnp.bfloat16,)
    return (M > 0 and M % 8 == 0 and N % GROUP == 0 and K % GROUP == 0
            and jnp.dtype(out_dtype) in map(jnp.dtype, dtypes))


def _tabled(out_dtype, swap: bool) -> bool:
    """Whether `TUNED` and `SPLITS` speak for this call: they hold bf16 out, `SWAP` False."""
    return not swap and jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16)


def config_for(M: int, N: int, K: int, out_dtype, swap: bool) -> tuple[int, ...]:
    """The `TUNED` configuration for this problem, else `HEURISTIC`."""
    if not _tabled(out_dtype, swap):
        return HEURISTIC
    config = HEURISTIC
    for from_m, tuned in TUNED.get((N, K), ()):
        if M >= from_m:
            config = tuned
    return config


def split_for(M: int, N: int, K: int, out_dtype, swap: bool) -> tuple[int, tuple[int, ...]]:
    """The `SPLITS` entry for this problem, else `NO_SPLIT`."""
    if not _tabled(out_dtype, swap):
        return NO_SPLIT
    return SPLITS.get((M, N, K), NO_SPLIT)


def fp8_matmul_cublaslt(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16, *, swap=None,
                        config=None, split=None):
    """cuBLASLt's block-scaled FP8 GEMM; same contract as `fp8_matmul_ref` (xq [M, K] fp8,
    x_scale [M, K / 128] f32, wq [N, K] fp8, w_scale [N / 128, K / 128] f32 -> [M, N]).
    Needs `available()` (the FFI target registered) to run, CUDA only, `supports(...)`.
    `swap` (default: the probed `SWAP`), `config` (default: `config_for`) and `split`
    ((n_split, tail configuration): columns from n_split by a second call; default
    `split_for`) are for benchmarks that compare arrangements and configurations."""
    swap = SWAP if swap is None else swap
    M, N, K = xq.shape[0], wq.shape[0], xq.shape[1]
    if config is None:
        config = config_for(M, N, K, out_dtype, swap)
    if split is None:
        split = split_for(M, N, K, out_dtype, swap)
    n_split, tail = split
    for c in (config, tail):
        if len(c) != len(CONFIG_FIELDS):
            raise ValueError(f"config must be {len(CONFIG_FIELDS)} ints {CONFIG_FIELDS}, got {c}")
    if n_split % GROUP or not 0 <= n_split < N:
        raise ValueError(f"n_split must be 0 or a multiple of {GROUP} below N {N}, got {n_split}")
    return _cublaslt(xq, x_scale, wq, w_scale, out_dtype, swap=swap,
                     config=tuple(map(int, config)), n_split=int(n_split),
                     tail=tuple(map(int, tail)))


@functools.partial(jax.jit, static_argnames=("out_dtype", "swap", "config", "n_split", "tail"))
def _cublaslt(xq, x_scale, wq, w_scale, out_dtype, swap: bool, config: tuple[int, ...],
              n_split: int = 0, tail: tuple[int, ...] = HEURISTIC):
    fm._check(xq, x_scale, wq, w_scale)
    M, K = xq.shape
    N = wq.shape[0]
    if not supports(M, N, K, out_dtype):
        raise ValueError(f"the cuBLASLt FP8 GEMM needs M a multiple of 8 and a bf16"
                         f"{' or f32' if F32_OUT else ''} out_dtype; got M {M}, out_dtype "
                         f"{jnp.dtype(out_dtype).name}")
    G = K // GROUP
    pad = -G % 4
    ws = jnp.pad(w_scale, [(0, 0), (0, pad)]) if pad else w_scale
    shape = (N, M) if swap else (M, N)
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(shape, out_dtype))(
        xq, x_scale.T, wq, ws, swap=np.int32(swap), config=np.asarray(config, np.int32),
        n_split=np.int32(n_split), tail_config=np.asarray(tail, np.int32))
    return out.T if swap else out


SCALINGS = ("block", "tensor", "tensor_fast")  # the handler's `Scaling`, in its order


def search(M: int, N: int, K: int, out_dtype=jnp.bfloat16, *, swap=None, reps: int = 5,
           max_configs: int = 4096, scaling: str = "block",
           max_split_k: int = 1) -> list[tuple[tuple[int, ...], float]]:
    """Every configuration cuBLASLt accepts for this problem (the first `max_configs`) with K
    split into at most `max_split_k` parts (fp32 partials summed in a separate pass, in a
    fixed order; 1: no split), timed by the handler on operands of its own (random FP8 values
    and scales, the current device, outside XLA), `reps` calls each after a warm-up:
    [(config, ms per call)], the heuristic's choice first, then cuBLASLt's order. `scaling`
    "tensor" or "tensor_fast" times cuBLASLt's per-tensor FP8 GEMM instead (unit scales;
    precise or fast accumulation): the speed reference in the same harness. Needs
    `available()`."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if max_split_k < 1:
        raise ValueError(f"max_split_k must be >= 1, got {max_split_k}")
    if not available():
        raise Unavailable("the cuBLASLt handler is not available")
    n = len(CONFIG_FIELDS)
    configs = np.zeros((max_configs, n), np.int32)
    ms = np.zeros(max_configs, np.float32)
    error = ctypes.create_string_buffer(512)
    f32 = jnp.dtype(out_dtype) == jnp.dtype(jnp.float32)
    swap = SWAP if swap is None else swap
    count = _LIB.lacache_cublaslt_search(
        ctypes.c_int64(M), ctypes.c_int64(N), ctypes.c_int64(K), ctypes.c_int32(f32),
        ctypes.c_int32(swap), ctypes.c_int32(SCALINGS.index(scaling)),
        ctypes.c_int32(max_split_k), ctypes.c_int32(reps), ctypes.c_int32(max_configs),
        configs.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
        ms.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), error, ctypes.c_int32(len(error)))
    if count < 0:
        raise RuntimeError(f"cuBLASLt configuration search failed: {error.value.decode()}")
    return [(tuple(map(int, configs[i])), float(ms[i])) for i in range(count)]


@functools.cache
def available() -> bool:
    """Build (or find cached), load and register the handler; False (with one warning) where
    that cannot be done."""
    global _LIB
    jax.devices()  # the backend first: its cuBLASLt is then mapped and found by find_cuda
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
        lib.lacache_cublaslt_version.restype = ctypes.c_size_t
        version = lib.lacache_cublaslt_version()
        if version < MIN_CUBLASLT:
            raise Unavailable(f"cuBLASLt {version} has no block-scaled FP8 (needs >= "
                              f"{MIN_CUBLASLT})")
        lib.lacache_cublaslt_search.restype = ctypes.c_int32
        if lib.lacache_cublaslt_config_len() != len(CONFIG_FIELDS):
            raise Unavailable(f"{path.name} takes another configuration length")
        _LIB = lib
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, HANDLER)),
                                    platform="CUDA")
        probe()
    except (Unavailable, OSError) as e:
        warnings.warn(f"lacache_jax: no cuBLASLt FP8 GEMM ({e}); using the Pallas kernels",
                      stacklevel=2)
        return False
    return True


def probe() -> None:
    """Which arrangement cuBLASLt runs (weights as A first) and whether it writes f32, on one
    8 x 128 x 128 problem each; sets `SWAP` and `F32_OUT`. Evaluated now even when the first
    use is inside a jit trace (the dispatch inside generate's loop)."""
    global SWAP, F32_OUT
    errors = []
    with jax.ensure_compile_time_eval():
        xq = jnp.ones((8, GROUP), jnp.float8_e4m3fn)
        wq = jnp.ones((GROUP, GROUP), jnp.float8_e4m3fn)
        xs, ws = jnp.ones((8, 1), jnp.float32), jnp.ones((1, 1), jnp.float32)
        for swap in (False, True):
            try:
                got = float(_cublaslt(xq, xs, wq, ws, jnp.bfloat16, swap=swap,
                                      config=HEURISTIC)[0, 0])
            except Exception as e:  # noqa: BLE001 (any failure: try the other arrangement)
                errors.append(f"swap={swap}: {str(e).splitlines()[0][:200]}")
                continue
            if got != GROUP:
                errors.append(f"swap={swap} computed {got}, not {GROUP}")
                continue
            SWAP = swap
            try:
                F32_OUT = float(_cublaslt(xq, xs, wq, ws, jnp.float32, swap=swap,
                                          config=HEURISTIC)[0, 0]) == GROUP
            except Exception:  # noqa: BLE001 (no f32 output: bf16 only)
                F32_OUT = False
            return
    raise Unavailable("; ".join(errors))


def cache_dir() -> Path:
    if os.environ.get("LACACHE_JAX_CACHE"):
        return Path(os.environ["LACACHE_JAX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lacache_jax"


def build() -> Path:
    """The handler's shared library: cached, else compiled now (a few seconds)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise Unavailable("no C++ compiler (g++, c++ or $CXX)")
    includes, libs = find_cuda()
    cmd = [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-isystem", jax.ffi.include_dir()]
    for d in includes:
        cmd += ["-isystem", str(d)]
    cmd += [str(SOURCE), *map(str, libs)]
    cmd += [f"-Wl,-rpath,{d}" for d in sorted({str(p.parent) for p in libs})]
    key = hashlib.sha256(SOURCE.read_bytes())
    for part in (*cmd, compiler_version(cxx), cuda_versions(includes), jax.__version__):
        key.update(part.encode() + b"\0")
    out = cache_dir() / f"fp8_cublaslt-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # then one atomic rename
        tmp_out = Path(tmp) / out.name
        try:
            r = subprocess.run(cmd + ["-o", str(tmp_out)], capture_output=True, text=True,
                               timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable(f"{cxx} failed to run: {e}") from e
        if r.returncode:
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            raise Unavailable(f"building {SOURCE.name} failed: {last}")
        os.replace(tmp_out, out)
    return out


def cuda_roots() -> list[Path]:
    """Where CUDA headers and libraries may be: the pip `nvidia-*` packages (what jax's CUDA
    plugin loads), $CUDA_HOME / $CUDA_PATH, /usr/local/cuda."""
    roots = []
    for entry in sys.path:
        nvidia = Path(entry or ".") / "nvidia"
        if nvidia.is_dir():  # newest first: cu13 before cu12
            roots += sorted((p for p in nvidia.iterdir() if p.is_dir()), reverse=True)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            roots.append(Path(os.environ[var]))
    roots.append(Path("/usr/local/cuda"))
    roots = [r for r in dict.fromkeys(roots) if r.is_dir()]
    mapped = [str(p) for p in loaded_libraries()]  # roots of libraries already loaded first
    return sorted(roots, key=lambda r: not any(m.startswith(f"{r}/") for m in mapped))


def find_cuda() -> tuple[list[Path], list[Path]]:
    """(include dirs, [libcublasLt, libcudart]); the libraries this process already mapped
    (jax's) come first, so the handler binds to the same cuBLASLt."""
    roots = cuda_roots()
    includes = [r / sub for r in roots for sub in (
        "include", "include/cccl", "targets/x86_64-linux/include",
        "targets/x86_64-linux/include/cccl") if (r / sub).is_dir()]
    for header in HEADERS:
        if not any((d / header).exists() for d in includes):
            raise Unavailable(f"no {header} under {', '.join(map(str, roots)) or 'any CUDA root'}")
    mapped = loaded_libraries()
    libs = []
    for name in LIBRARIES:
        found = [p for p in mapped if p.name.startswith(name + ".")] or [
            p for r in roots for sub in ("lib", "lib64", "targets/x86_64-linux/lib")
            for p in sorted((r / sub).glob(name + ".*")) if re.fullmatch(
                re.escape(name) + r"\.\d+", p.name)]
        if not found:
            raise Unavailable(f"no {name}.* under {', '.join(map(str, roots))}")
        libs.append(found[0])
    return includes, libs


def loaded_libraries() -> list[Path]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return [Path(p) for p in dict.fromkeys(re.findall(r"(/\S+\.so[.\d]*)\s*$", maps, re.M))]


def compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True,
                              timeout=60).stdout.split("\n")[0]
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def cuda_versions(includes: list[Path]) -> str:
    """CUBLAS_VERSION and CUDART_VERSION of the first headers found (part of the cache key)."""
    out = []
    for header, macro in (("cublas_api.h", "CUBLAS_VER_(?:MAJOR|MINOR|PATCH)"),
                          ("cuda_runtime_api.h", "CUDART_VERSION")):
        for d in includes:
            if (d / header).exists():
                out += re.findall(rf"#define\s+{macro}\s+(\d+)", (d / header).read_text())
                break
    return ".".join(out)
