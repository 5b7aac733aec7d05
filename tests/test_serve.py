"""benchmarks/serve.py on the CPU: the refill bound's arithmetic and a tiny end-to-end run."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from benchmarks import serve
from benchmarks.serve import in_order_bound, queue_order
from tests.conftest import ROOT, xla_flags


def test_in_order_bound_is_static_over_the_in_order_makespan():
    # Static batches [4, 1] and [1, 1] cost 4 + 1; refilled, slot A runs the 4 while slot B
    # runs the three 1s: makespan 4.
    assert in_order_bound([4, 1, 1, 1], 2) == 5 / 4
    assert in_order_bound([3] * 64, 32) == 1.0  # equal lengths: nothing to gain
    # Many requests: the tail weighs less and the bound nears num_blocks / mean blocks.
    blocks = -(-np.random.default_rng(0).integers(32, 513, 4096) // 32)
    assert 1.7 < in_order_bound(blocks, 32) < 16 / blocks.mean()


def test_bound_in_the_queue_order():
    # Static batches [1, 1] and [4, 1] cost 1 + 4. In input order the 4 starts when the first
    # two end (makespan 5); longest first it starts at once while the other slot runs the three
    # 1s (makespan 4).
    assert in_order_bound([1, 1, 4, 1], 2) == 5 / 5
    assert in_order_bound([1, 1, 4, 1], 2, order=[2, 0, 1, 3]) == 5 / 4
    assert queue_order([3, 9, 3, 12]).tolist() == [3, 1, 0, 2]  # ties keep input order


def test_llada_tiny_run_reports_speedup_and_bound(tmp_path):
    """--tiny: gen 32 in blocks of 8 (serve._model); `--gpus 1,2` on 2 fake CPU devices runs
    each S per device on one device and over a 2-way data axis (2 S slots)."""
    env = {"OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "PATH": "/usr/bin:/bin",
           "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}
    done = subprocess.run([sys.executable, "-m", "benchmarks.serve", "llada", "--tiny", "--n",
                           "8", "--slots", "2", "--gpus", "1,2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(next(tmp_path.glob("serve_llada-*.json")).read_text())["rows"]
    assert [(r["S"], r["devices"]) for r in rows] == [(2, 1), (4, 2)]
    lengths = np.asarray(rows[0]["answer_lengths"])
    assert len(lengths) == 8
    for row in rows:
        assert row["n"] == 8 and row["static_s"] > 0 and row["slots_s"] > 0
        # The bound printed is the one of the drawn lengths (blocks of the run's block length).
        assert row["answer_tokens"] == lengths.sum()
        assert row["in_order_bound"] == in_order_bound(-(-lengths // 8), row["S"])


def test_timed_runs_repeats_times_and_takes_the_median(monkeypatch):
    """`_timed` calls the function `repeats` times and reports the median of their seconds
    (a slow outlier run moves nothing), every run's seconds, and the last run's output."""
    clock = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # runs of 1, 3 and 2 seconds
    monkeypatch.setattr(serve.time, "perf_counter", lambda: next(clock))
    calls = []
    out, median, runs = serve._timed(lambda: calls.append(0) or len(calls), repeats=3)
    assert (out, median, runs, len(calls)) == (3, 2.0, [1.0, 3.0, 2.0], 3)
