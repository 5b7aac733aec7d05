"""Shared benchmark plumbing: timing, measured ceilings, result files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

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


def measure_ceilings(key=jax.random.key(0)) -> dict:
    """bf16 matmul TFLOP/s (8192^3, random data) and device copy bandwidth (read + write)."""
    n = 8192
    ka, kb = jax.random.split(key)
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    mm = time_fn(jax.jit(lambda a, b: a @ b), a, b, iters=20)
    x = jax.random.normal(key, (2**30,), jnp.bfloat16)  # 2 GiB, far beyond L2
    cp = time_fn(jax.jit(lambda x: x * 1), x, iters=20)  # read + write
    del a, b, x
    return {"bf16_matmul_tflops": 2 * n**3 / mm["median_ms"] / 1e9,
            "copy_tb_per_s": 2 * 2**31 / cp["median_ms"] / 1e9}


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
    """JSON under $OUT (device runs) or benchmarks/results/, stamped with date/commit/device."""
    out_dir = Path(os.environ.get("OUT") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    payload = {"date": stamp.strftime("%Y-%m-%d"), "commit": git_commit(),
               "device": device_name(), "jax": jax.__version__, "host": platform.node(),
               **payload}
    path = out_dir / f"{name}-{stamp.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
