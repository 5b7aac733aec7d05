"""Accuracy, tokens per step, NFE and tokens/s of every decoding mode on held-out problems.

    python -m benchmarks.accuracy --checkpoint DIR [--n 500] [--modes fixed,threshold,...]

`DIR` is a converted demo checkpoint (with its tokenizer). All problems run as one ragged batch
per mode; tokens/s counts generated tokens up to each row's first EOS over the wall time of the
compiled run (compilation excluded). Lossless modes are also compared token for token with
their baseline.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import lacache_jax as lj
from benchmarks import arith
from benchmarks.common import write_result
from benchmarks.train_demo import GEN_LEN
from lacache_jax.tokenizer import Tokenizer

BLOCK = 32
DPAD = lj.DPadConfig(window=32)
MODES = {  # name -> (GenerationConfig settings, lossless baseline or None)
    "fixed": (dict(), None),
    "threshold": (dict(threshold=0.9), None),
    "factor": (dict(factor=1.0), None),
    "exact": (dict(cache="exact"), "fixed"),
    "prefix": (dict(cache="prefix"), None),
    "dual": (dict(cache="dual"), None),
    "dpad": (dict(dpad=DPAD), None),
    "threshold+exact": (dict(threshold=0.9, cache="exact"), "threshold"),
    "threshold+dual": (dict(threshold=0.9, cache="dual"), None),
    "threshold+dpad+dual": (dict(threshold=0.9, dpad=DPAD, cache="dual"), None),
    "fp8_ffn": (dict(fp8_ffn=True), None),
    "threshold+dual+fp8_ffn": (dict(threshold=0.9, cache="dual", fp8_ffn=True), None),
}


def evaluate(params, cfg: lj.ModelConfig, tok: Tokenizer, problems, settings: dict,
             key=jax.random.key(0)) -> dict:
    gen = lj.GenerationConfig(gen_length=GEN_LEN, block_length=BLOCK, steps=GEN_LEN,
                              **settings)
    prompts = [tok.encode(arith.prompt_text(a, b)) for a, b in problems]
    keys = jax.random.split(key, len(prompts))
    run = lj.compile_generate(params, cfg, prompts, gen, key=keys)
    t0 = time.perf_counter()
    out = jax.block_until_ready(run())
    seconds = time.perf_counter() - t0
    answers = out.answers(GEN_LEN)
    correct = [arith.check(a, b, tok.decode(ans)) for (a, b), ans in zip(problems, answers)]
    return {"accuracy": float(np.mean(correct)),
            "tokens_per_step": float(np.mean(np.asarray(out.tokens_per_step))),
            "nfe": float(np.mean(np.asarray(out.nfe))),
            "tokens_per_s": float(np.sum(np.asarray(out.gen_lengths)) / seconds),
            "seconds": seconds, "tokens": np.asarray(out.tokens)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    cfg, params = lj.load(args.checkpoint)
    params = lj.quantize_ffn(params)  # FP8 copies are dropped again by modes without fp8_ffn
    tok = Tokenizer(args.checkpoint)
    problems = arith.sample("test", args.n, seed=0)
    results = {}
    for name in args.modes.split(","):
        settings, baseline = MODES[name]
        r = evaluate(params, cfg, tok, problems, settings)
        if baseline in results:
            r["identical_to_" + baseline] = bool(
                (r["tokens"] == results[baseline]["tokens"]).all())
        results[name] = r
        print(f"{name:22s} acc {r['accuracy']:.3f}  tokens/step {r['tokens_per_step']:.2f}  "
              f"NFE {r['nfe']:.1f}  {r['tokens_per_s']:.0f} tok/s", flush=True)
    rows = {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()}
    path = write_result("accuracy", {"n": args.n, "checkpoint": args.checkpoint, "modes": rows})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
