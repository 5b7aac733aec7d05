"""Generation on several GPUs of one host (random LLaDA-8B bf16 weights, prompt 512, gen 256,
block 32, dual cache, threshold 0.9):

    python -m benchmarks.multi_gpu [--gpus 1,2,4] [--batch 32,64] [--tp dual,dual+fp8,exact]

- data parallel: each batch split over 1, 2, 4 GPUs (mesh data=n, model=1): tokens/s;
- tensor parallel: batch 1 over 1, 2, 4 GPUs (mesh data=1, model=n): ms per step, for each
  `--tp` setting (`dual`: the dual cache with threshold 0.9; `+fp8`: FP8 FFN; `exact`: LaCache
  with the fixed schedule).
Tokens are compared with the one-GPU run of the same case.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np

import lacache_jax as lj
from benchmarks.common import exit_on_sigterm, llada_8b_setup, write_result
from benchmarks.generate import run_one


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="1,2,4")
    ap.add_argument("--batch", default="32", help="comma-separated data-parallel batches ('none': skip)")
    ap.add_argument("--tp", default="dual", help="comma-separated tensor-parallel settings ('none': skip)")
    ap.add_argument("--iters", type=int, default=2)
    args = ap.parse_args()
    cfg, ceil, params = llada_8b_setup()
    gen = lj.GenerationConfig(gen_length=256, block_length=32, steps=256, cache="dual",
                              threshold=0.9, stop_at_eos=False)
    tp = {"dual": gen, "dual+fp8": dataclasses.replace(gen, fp8_ffn=True),
          "exact": dataclasses.replace(gen, cache="exact", threshold=None)}
    cases = [("data", int(B), "dual", gen) for B in args.batch.split(",") if B != "none"]
    cases += [("model", 1, name, tp[name]) for name in args.tp.split(",") if name != "none"]
    if any(g.fp8_ffn for *_, g in cases):
        params = lj.quantize_ffn(params)
    rows, ref = [], {}
    exit_on_sigterm()
    try:
        for kind, B, name, g in cases:
            for n in map(int, args.gpus.split(",")):
                if n > len(jax.devices()):
                    continue
                shape = (n, 1) if kind == "data" else (1, n)
                mesh = lj.make_mesh(*shape, devices=jax.devices()[:n])
                r, tokens = run_one(params, cfg, ceil, g, B, 512, args.iters, mesh)
                ref.setdefault((kind, B, name), tokens)
                r.update(parallel=kind, gpus=n, B=B, setting=name,
                         same_tokens_as_1_gpu=float(np.mean(tokens == ref[kind, B, name])))
                rows.append(r)
                print(f"{kind:5s} x{n}: B={B} {name:8s} {r['tokens_per_s']:8.1f} tokens/s "
                      f"{r['ms_per_step']:6.2f} ms/step, compile {r['compile_s']:.0f} s, same "
                      f"tokens {r['same_tokens_as_1_gpu']:.3f}", flush=True)
    finally:
        print(f"-> {write_result('multi_gpu', {'rows': rows})}")


if __name__ == "__main__":
    main()
