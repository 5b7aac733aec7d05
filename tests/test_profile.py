"""benchmarks.common.profile on CPU: it reads a real jax.profiler trace back."""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp

from benchmarks.common import profile


def test_profile_reads_back_the_trace_per_step():
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((64, 64))
    f(x).block_until_ready()

    def traced_steps():
        for _ in range(4):
            f(x).block_until_ready()
            time.sleep(0.05)

    text = profile(traced_steps, 4)
    wall = float(re.search(r"wall ([\d.]+) ms/step", text).group(1))
    assert wall >= 50  # each step sleeps 50 ms
    # The CPU has no device plane: no kernel time, the host's python thread named instead.
    assert "device kernels 0.00 ms/step" in text
    assert re.search(r"host +[\d.]+ ms +.*traced_steps", text)
