"""Data and tensor parallelism on 4 fake CPU devices: tokens identical to one device in every
cache mode, with threshold decoding and with the FP8 FFN (tests/multi_device_cases.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_meshes_give_single_device_tokens():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    done = subprocess.run([sys.executable, "-m", "tests.multi_device_cases"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    cases = {r["case"]: r for r in results}
    assert len(cases) == 8 * 3 + 2, sorted(cases)
    assert all(r["same"] for r in results), [r for r in results if not r["same"]]
    assert cases["load_sharded"]["w_qkv_spec"] == ["None", "model"]
    assert cases["load_sharded"]["embed_replicated"]
