"""Cost of the per-block progress callback (`lj.generate(..., progress=)`, the CLI's bar).

    python -m benchmarks.progress_cost [--batch 1] [--prompt 512] [--cache dual] [--iters 5]

Random LLaDA-8B bf16 weights; the same generation compiled with and without the callback,
timed alternately (median of `--iters` each). The callback updates a tqdm bar writing to
/dev/null, as the CLI's does on a terminal. Goal (issue 14): < 1% of a batch-1 dual-cache
generation.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np
from tqdm.auto import tqdm

import lacache_jax as lj
from benchmarks.common import exit_on_sigterm, llada_8b_setup, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--cache", default="dual")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (quick checks)")
    args = ap.parse_args()
    exit_on_sigterm()
    cfg, ceilings, params = llada_8b_setup(args.layers)
    prompts = np.random.default_rng(0).integers(0, cfg.mask_id, (args.batch, args.prompt))
    gen = lj.GenerationConfig(gen_length=args.gen, block_length=32, steps=args.gen,
                              cache=args.cache)
    sink = open(os.devnull, "w")
    bar = tqdm(total=gen.num_blocks, file=sink)

    def progress(done, total):
        bar.n = done
        bar.refresh()
    plain = lj.compile_generate(params, cfg, prompts, gen)
    shown = lj.compile_generate(params, cfg, prompts, gen, progress=progress)
    same = bool((np.asarray(plain().tokens) == np.asarray(shown().tokens)).all())
    times = {"plain": [], "progress": []}
    for _ in range(args.iters):
        for name, run in (("plain", plain), ("progress", shown)):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    overhead = med["progress"] / med["plain"] - 1
    path = write_result("progress_cost", dict(
        batch=args.batch, prompt=args.prompt, gen=args.gen, cache=args.cache,
        layers=cfg.n_layers, times_s=times, median_s=med, overhead=overhead,
        same_tokens=same, ceilings=ceilings))
    print(f"plain {med['plain']:.3f} s, with progress {med['progress']:.3f} s: "
          f"overhead {100 * overhead:+.2f}% (same tokens: {same}) -> {path}")


if __name__ == "__main__":
    main()
