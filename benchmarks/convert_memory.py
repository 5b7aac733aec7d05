"""Peak RAM of `python -m convert` on LLaDA-8B-width checkpoints with few layers.

    python -m benchmarks.convert_memory [--layers 2,6] [--workdir DIR]

The converter streams one weight group (one layer) at a time, so its peak RSS should not grow
with the number of layers; the full 32-layer model then needs about what these need.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import lacache_jax as lj
from convert import safetensors_file as stf
from benchmarks.common import write_result
from convert.llada import hf_shapes


def write_checkpoint(path: Path, cfg: lj.ModelConfig) -> int:
    """HF-layout shards (one per layer, like the real 8B's ~5 GB shards), random bf16."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    rng = np.random.default_rng(0)
    shards: dict[str, dict[str, np.ndarray]] = {}
    for name, shape in hf_shapes(cfg).items():
        key = name.split(".")[3] if ".blocks." in name else "outer"
        shards.setdefault(key, {})[name] = (rng.standard_normal(shape, np.float32) * 0.02).astype(
            ml_dtypes.bfloat16)
    weight_map, total = {}, 0
    for k, (key, tensors) in enumerate(shards.items(), 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        stf.write_file(path / fname, tensors)
        weight_map.update({n: fname for n in tensors})
        total += sum(a.nbytes for a in tensors.values())
        tensors.clear()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


def _peak_rss_gib(cmd: list[str]) -> float:
    """Peak RSS of `cmd`, measured by a fresh parent so earlier children do not count."""
    probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True,
                         text=True).stdout
    return int(out.split()[-1]) / 2**20  # KiB -> GiB


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="2,6")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    rows = []
    workdir = (contextlib.nullcontext(args.workdir) if args.workdir else
               tempfile.TemporaryDirectory(prefix="convert_mem_"))
    with workdir as work:
        for n in map(int, args.layers.split(",")):
            cfg = dataclasses.replace(lj.llada_8b(), n_layers=n)
            src, dst = Path(work) / f"hf{n}", Path(work) / f"ck{n}"
            try:
                nbytes = write_checkpoint(src, cfg)
                t0 = time.perf_counter()
                peak_gb = _peak_rss_gib([sys.executable, "-m", "convert", str(src), str(dst),
                                         "--quiet"])
                seconds = time.perf_counter() - t0
            finally:  # the 8B-sized files go before the next size, and on failure
                shutil.rmtree(src, ignore_errors=True)
                shutil.rmtree(dst, ignore_errors=True)
            rows.append({"layers": n, "checkpoint_gb": nbytes / 1e9, "peak_rss_gib": peak_gb,
                         "seconds": seconds})
            print(f"{n} layers: checkpoint {nbytes / 1e9:.2f} GB, converter peak RSS "
                  f"{peak_gb:.2f} GiB, {rows[-1]['seconds']:.0f} s", flush=True)
    print(f"-> {write_result('convert_memory', {'rows': rows})}")


if __name__ == "__main__":
    main()
