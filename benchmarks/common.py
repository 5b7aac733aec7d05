"""Shared benchmark plumbing: timing, measured ceilings, result files."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import functools
import glob
import importlib
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"


def time_fn(fn, *args, warmup: int = 3, iters: int = 20) -> dict:
    """Median/min wall time in ms of `fn(*args)` (synchronised), after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": float(np.median(times)), "min_ms": float(np.min(times)),
            "iters": iters}


def time_run(run, iters: int):
    """(median seconds, last output) of a compiled generation `run()` over `iters` calls,
    after one warm-up call."""
    out = jax.block_until_ready(run())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def time_chained(fn, *args, n: int = 20, iters: int = 10) -> dict:
    """Device time per call of `fn(*args)` for kernels too short for `time_fn`: `n` calls in
    one jitted program, each made to depend on the previous (one element of `args[0]` is
    bumped by 0 x an element of its output), so host dispatch is paid once per `n`. The same
    `fn` object timed again reuses its compiled program (`_chained`)."""
    t = time_fn(_chained(fn, n), *args, iters=iters)
    return {"median_ms": t["median_ms"] / n, "min_ms": t["min_ms"] / n, "iters": iters, "n": n}


def device_chained(fn, *args, n: int = 20) -> dict:
    """The device's own time per call of `fn(*args)` in `time_chained`'s program, from one
    run under the profiler: `span_ms` from the first kernel's start to the last one's end
    (idle gaps between kernels included: a loop pays them too), `kernels_ms` the kernels'
    summed time, `idle_ms` the gaps', `largest` the longest-running kernel (name, ms) and
    `wall_ms` the profiled run's wall time, `launches` each kernel name's (memsets' and
    copies' too) launches per call; NaN (largest None) where the trace holds no
    device kernels (a CPU run). `span_ms` leaves out what `time_chained` also pays: the
    program's dispatch and completion, amortised over `n` calls there, which FFI custom calls
    make larger than XLA's own ops (RESULTS.md, twenty-first session)."""
    chained = _chained(fn, n)
    jax.block_until_ready(chained(*args))
    t = trace(lambda: jax.block_until_ready(chained(*args)))
    per = lambda ns: ns / n / 1e6  # noqa: E731
    out = {"n": n, "wall_ms": t.wall / n * 1e3,
           "launches": {name: c / n for name, c in t.count.most_common()}}
    if not t.spans:
        return {**out, "span_ms": float("nan"), "kernels_ms": float("nan"),
                "idle_ms": float("nan"), "largest": None}
    (name, ns), = t.device.most_common(1)
    return {**out, "span_ms": per(max(e for _, e in t.spans) - min(b for b, _ in t.spans)),
            "kernels_ms": per(sum(t.device.values())), "idle_ms": per(idle_gaps(t.spans)[0]),
            "largest": (name, per(ns))}


@functools.lru_cache(maxsize=256)  # a tile sweep's settings of one shape fit (84 at most)
def _chained(fn, n: int):
    def chained(x, *rest):
        for _ in range(n):
            out = jax.tree.leaves(fn(x, *rest))[0]
            first = (0,) * x.ndim
            x = x.at[first].add((out[(0,) * out.ndim] * 0).astype(x.dtype))
        return x
    return jax.jit(chained)


def rel_l2(out, ref) -> float:
    """Relative L2 error of `out` against `ref`, in float64."""
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))


def measure_ceilings(key=jax.random.key(0)) -> dict:
    """Measured ceilings on random data: the best bf16 matmul rate over a few square sizes,
    and device copy bandwidth (bytes read + written) of a 4 GiB elementwise pass."""
    on_gpu = jax.default_backend() == "gpu"  # elsewhere: token sizes, only to exercise the code
    best = 0.0
    for n in (4096, 8192, 16384) if on_gpu else (256,):
        ka, kb = jax.random.split(jax.random.fold_in(key, n))
        a = jax.random.normal(ka, (n, n), jnp.bfloat16)
        b = jax.random.normal(kb, (n, n), jnp.bfloat16)
        t = time_fn(jax.jit(lambda a, b: a @ b), a, b, warmup=5, iters=30)
        best = max(best, 2 * n**3 / t["median_ms"] / 1e9)
        del a, b
    n = 2**30 if on_gpu else 2**20
    x = jax.random.bits(key, (n,), jnp.uint32)
    cp = time_fn(jax.jit(lambda x: x + 1), x, warmup=5, iters=30)
    del x
    return {"bf16_matmul_tflops": best, "copy_tb_per_s": 2 * 4 * n / cp["median_ms"] / 1e9}


# The ceilings DESIGN.md quotes for this H200 (torch matmul, device copy): goals are set
# against these; floors are reported against both these and the run's own measurement.
REFERENCE_CEILINGS = {"bf16_matmul_tflops": 790.0, "copy_tb_per_s": 4.3}


def llada_8b_setup(n_layers: int | None = None):
    """(config, measured ceilings, random bf16 params on device) for LLaDA-8B's shape;
    `n_layers` shrinks the depth for quick checks."""
    import dataclasses

    import lacache_jax as lj
    cfg = lj.llada_8b()
    if n_layers:
        cfg = dataclasses.replace(cfg, n_layers=n_layers)
    ceilings = measure_ceilings()
    return cfg, ceilings, lj.init_params(cfg, jax.random.key(0), jnp.bfloat16)


def load_model(checkpoint=None):
    """(cfg, params, tokenizer) of `checkpoint`, or of the shipped `demo_model/` converted
    into a temporary directory that is gone once they are loaded (both load whole)."""
    import lacache_jax as lj
    from convert.__main__ import main as convert_main
    from lacache_jax.tokenizer import Tokenizer
    if checkpoint is not None:
        cfg, params = lj.load(checkpoint)
        return cfg, params, Tokenizer(checkpoint)
    with tempfile.TemporaryDirectory(prefix="lacache_demo_") as d:
        ck = Path(d) / "demo_ckpt"
        if convert_main([str(ROOT / "demo_model"), str(ck), "--quiet"]) != 0:
            raise SystemExit(f"converting {ROOT / 'demo_model'} failed")
        return load_model(ck)


def floor_ms(flops: float, nbytes: float, ceilings: dict) -> float:
    """max(compute time, memory time) in ms at the given ceilings."""
    return max(flops / ceilings["bf16_matmul_tflops"] / 1e9,
               nbytes / ceilings["copy_tb_per_s"] / 1e9)


def parse_settings(spec: str) -> list[tuple[object, str, int]]:
    """`module:NAME=int[,module:NAME=int...]` as (module, NAME, value): the module-level
    switches a kernel reads while tracing (e.g. `kernels.gate_up_swiglu:MGPU_MIN_M=0`); every NAME
    must exist and hold an int or a bool (set from 0 / 1 as a bool), so that a typo fails
    before the device time is spent."""
    out = []
    for entry in filter(None, spec.split(",")):
        mod, _, kv = entry.partition(":")
        name, eq, value = kv.partition("=")
        if not (mod and name and eq):
            raise SystemExit(f"setting {entry!r}: expected module:NAME=int")
        try:
            module = importlib.import_module(mod)
        except ImportError as e:
            raise SystemExit(f"setting {entry!r}: {e}") from None
        old = getattr(module, name, None)
        if type(old) not in (int, bool):
            raise SystemExit(f"setting {entry!r}: {mod}.{name} is not a module-level int")
        try:
            v = int(value)
        except ValueError:
            raise SystemExit(f"setting {entry!r}: {value!r} is not an int") from None
        if type(old) is bool and v not in (0, 1):
            raise SystemExit(f"setting {entry!r}: {mod}.{name} is a bool: 0 or 1")
        out.append((module, name, bool(v) if type(old) is bool else v))
    return out


@contextlib.contextmanager
def module_settings(spec: str):
    """The switches of `spec` (`parse_settings`) set for the block and restored after, with
    jax's caches cleared on both sides: they are read while tracing, so a program traced under
    other settings must not be reused. An empty spec changes nothing (and clears nothing)."""
    settings = parse_settings(spec)
    old = [(m, n, getattr(m, n)) for m, n, _ in settings]
    if not settings:
        yield
        return
    jax.clear_caches()
    try:
        for m, n, v in settings:
            setattr(m, n, v)
        yield
    finally:
        for m, n, v in old:
            setattr(m, n, v)
        jax.clear_caches()


def exit_on_sigterm() -> None:
    """Turn `timeout`'s SIGTERM into SystemExit, so a time-boxed run's `finally` still writes
    the rows it finished."""
    import signal
    import sys
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))


@dataclasses.dataclass
class Trace:
    """What the profiler saw while `run()` ran: wall seconds, summed ns per kernel name on
    the device's stream lines, (start, end) ns of those kernels, summed ns per host event,
    launches per kernel name."""
    wall: float
    device: collections.Counter
    spans: list
    host: collections.Counter
    count: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def trace(run) -> Trace:
    """Trace `run()` (which must wait for its work) under jax's profiler."""
    with tempfile.TemporaryDirectory(prefix="lacache_trace_") as d:
        with jax.profiler.trace(d):
            t0 = time.perf_counter()
            run()
            wall = time.perf_counter() - t0
        (path,) = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    out = Trace(wall, collections.Counter(), [], collections.Counter())
    for plane in data.planes:
        for line in plane.lines:
            if plane.name.startswith("/device:") and line.name.startswith("Stream"):
                for e in line.events:
                    out.device[e.name] += e.duration_ns
                    out.count[e.name] += 1
                    out.spans.append((e.start_ns, e.end_ns))
            elif plane.name.startswith("/host:"):
                for e in line.events:
                    out.host[f"{line.name}: {e.name}"] += e.duration_ns
    return out


def profile(run, steps: int, top: int = 6) -> str:
    """Trace `run()` (which runs `steps` steps, or blocks, and waits for them) and summarise
    the trace per step: wall time; summed kernel time on the device's stream lines (below the
    wall time where the device waits on the host) and its `top` kernels; the device's idle
    time between its first and last kernel (spans no stream is busy), with the number of
    idle gaps over 50 us; and the `top` longest events of the host's threads, named
    `thread: event` (nested events each count; which threads a trace holds depends on the
    platform and on the python tracer, which some processes' traces lack)."""
    t = trace(run)
    idle, gaps = idle_gaps(t.spans, min_ns=50_000)
    per = lambda ns: f"{ns / steps / 1e6:.3f}"
    lines = [f"  trace: wall {t.wall / steps * 1e3:.3f} ms/step, device kernels "
             f"{per(sum(t.device.values()))} ms/step, device idle {per(idle)} ms/step "
             f"({gaps / steps:.1f} gaps over 50 us per step)"]
    lines += [f"    device {per(ns):>8s} ms  {name[:110]}"
              for name, ns in t.device.most_common(top)]
    lines += [f"    host   {per(ns):>8s} ms  {name[:110]}" for name, ns in t.host.most_common(top)]
    return "\n".join(lines)


def idle_gaps(spans: list[tuple[float, float]], min_ns: float = 0) -> tuple[float, int]:
    """Time between the first start and the last end of `spans` [(start, end)] that no span
    covers, and how many of those uncovered gaps exceed `min_ns` (all of them count in the
    time)."""
    idle, gaps, reach = 0.0, 0, None
    for start, end in sorted(spans):
        if reach is not None and start > reach:
            idle += start - reach
            gaps += start - reach > min_ns
        reach = end if reach is None else max(reach, end)
    return idle, gaps


def git_commit() -> str:
    """$COMMIT when set (the device machine's copy of the tree has no .git), else git's."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.device_kind} ({d.platform})"


def write_result(name: str, payload: dict) -> Path:
    """JSON under $OUT (device runs) or benchmarks/results/, stamped with date/commit/device
    and the XLA flags it ran under (they can change what XLA launches)."""
    out_dir = Path(os.environ.get("OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    payload = {"date": stamp.strftime("%Y-%m-%d"), "commit": git_commit(),
               "device": device_name(), "jax": jax.__version__, "host": platform.node(),
               "xla_flags": os.environ.get("XLA_FLAGS", ""), **payload}
    path = out_dir / f"{name}-{stamp.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
