"""End to end, the FP8 FFN's share (issue 23): `benchmarks/generate.py`'s measurement
(`run_one`: compile, one warm-up, `--iters` timed generations; random LLaDA-8B bf16 weights,
one token per step) over a chosen list of configurations, all in one process with one set of
weights, so a short device call covers the goal's comparisons in the same run.

    python -m benchmarks.fp8_e2e [--runs "1:512:none:fixed,1:512:exact:fixed,..."]
        [--fp8 both] [--gen 256] [--iters 1] [--tiny]

Each run is B:prompt:cache:decoding[:fp8[:steps]], timed without and with the FP8 FFN (`--fp8 both`;
a run's own fp8 field, 0, 1 or both, overrides it; its steps field, `--steps`). `--steps` below the answer length times
fewer steps (several tokens each): a full-canvas step (none, exact) costs the same at any
count, so large batches fit a short device call; the exact cache's block-start fills are then
a larger share of its steps (1 in steps / blocks instead of 1 in 32), which biases against it.
Default: batch 1 at prompt 512 and 1024, none and exact (goal: exact + FP8 >= 1.3x none), and
threshold + dual at batch 1 and 8, prompt 512 (goal: with FP8 >= 1.2x without). `--tiny`: the
tiny fp32 model instead (a CPU check of the script, as in `benchmarks/generate.py`).
"""

from __future__ import annotations

import argparse

import lacache_jax as lj
from benchmarks.common import exit_on_sigterm
from benchmarks.generate import report, run_one, setup

DEFAULT_RUNS = ("1:512:none:fixed,1:512:exact:fixed,1:1024:none:fixed,1:1024:exact:fixed,"
                "1:512:dual:threshold,8:512:dual:threshold")


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--fp8", default="both", choices=["off", "on", "both"])
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="default: --gen (one token each)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tiny", action="store_true", help="the tiny fp32 model: a CPU check")
    args = ap.parse_args(argv)
    cfg, ceil, params = setup(args.tiny, args.layers)
    if args.fp8 != "off":
        params = lj.quantize_ffn(params)
    fp8s = {"off": [False], "on": [True], "both": [False, True]}[args.fp8]
    rows = []
    exit_on_sigterm()
    try:
        for run in args.runs.split(","):
            B, P, mode, decoding, *own = run.split(":")
            for fp8 in ({"0": [False], "1": [True], "both": [False, True]}[own[0]] if own
                        else fp8s):
                gen = lj.GenerationConfig(
                    gen_length=args.gen, block_length=args.block,
                    steps=int(own[1]) if len(own) > 1 else args.steps or args.gen,
                    cache=mode,
                    threshold=0.9 if decoding == "threshold" else None, stop_at_eos=False,
                    fp8_ffn=fp8)
                r, _ = run_one(params, cfg, ceil, gen, int(B), int(P), args.iters)
                r.update(B=int(B), prompt=int(P), cache=mode, decoding=decoding, fp8_ffn=fp8,
                         dpad=None)
                rows.append(r)
                print(f"B={B} P={P} {mode:6s} {decoding:9s} fp8 {fp8:d} "
                      f"{r['ms_per_step']:7.2f} ms/step  {r['tokens_per_s']:8.1f} tok/s  "
                      f"compile {r['compile_s']:.0f} s", flush=True)
    finally:
        report(cfg, ceil, rows, gen=args.gen, block=args.block, tiny=args.tiny)


if __name__ == "__main__":
    main()
