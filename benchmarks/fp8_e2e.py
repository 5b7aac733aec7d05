"""End to end, the FP8 FFN's share (issue 23): `benchmarks/generate.py`'s measurement
(`run_one`: compile, one warm-up, `--iters` timed generations; random LLaDA-8B bf16 weights,
one token per step) over a chosen list of configurations, all in one process with one set of
weights, so a short device call covers the goal's comparisons in the same run.

    python -m benchmarks.fp8_e2e [--runs "1:512:none:fixed,1:512:exact:fixed,..." | --paper]
        [--fp8 both] [--gen 256] [--iters 1] [--tiny]

Each run is B:prompt:cache:decoding[:fp8[:steps[:dpad]]], timed without and with the FP8 FFN
(`--fp8 both`; a run's own fp8 field, 0, 1 or both, overrides it; its steps field, `--steps`,
empty for the default; dpad `dpad`: DPad's default suffix dropout). `--steps` below the
answer length times fewer steps (several tokens each): a full-canvas step (none, exact) costs
the same at any count, so large batches fit a short device call; the exact cache's
block-start fills are then a larger share of its steps (1 in steps / blocks instead of 1 in
32), which biases against it.
Default: batch 1 at prompt 512 and 1024, none and exact (goal: exact + FP8 >= 1.3x none), and
threshold + dual at batch 1 and 8, prompt 512 (goal: with FP8 >= 1.2x without). `--tiny`: the
tiny fp32 model instead (a CPU check of the script, as in `benchmarks/generate.py`).

`--paper`: the LaCache paper's combinations at batch 1, prompt 512 (REFERENCE.md §7: vanilla,
+ LaCache, + Parallel, + Parallel + LaCache, where LaCache is the exact cache with the FP8 FFN
and Parallel Fast-dLLM's threshold decoding), each also with DPad, and threshold + dual with
and without FP8; then a table of ms per step and each one's ratio to its pair without LaCache,
beside the paper's. Random weights reveal one token per step at any threshold, so the table
compares the cost of a step; what parallel decoding saves in steps is the model's.
"""

from __future__ import annotations

import argparse
import dataclasses

import lacache_jax as lj
from benchmarks.common import exit_on_sigterm
from benchmarks.generate import report, run_one, setup

DEFAULT_RUNS = ("1:512:none:fixed,1:512:exact:fixed,1:1024:none:fixed,1:1024:exact:fixed,"
                "1:512:dual:threshold,8:512:dual:threshold")
# (name, run) in pairs: a run without LaCache (or the FP8 FFN), then the same with it; the
# paper's ratios (REFERENCE.md §7: GSM8K, gen 256) where it gives one
PAPER = (("vanilla", "1:512:none:fixed:0"), ("+ LaCache", "1:512:exact:fixed:1"),
         ("+ Parallel", "1:512:none:threshold:0"),
         ("+ Parallel + LaCache", "1:512:exact:threshold:1"),
         ("+ DPad", "1:512:none:fixed:0::dpad"), ("+ DPad + LaCache", "1:512:exact:fixed:1::dpad"),
         ("+ Parallel + DPad", "1:512:none:threshold:0::dpad"),
         ("+ Parallel + DPad + LaCache", "1:512:exact:threshold:1::dpad"),
         ("Fast-dLLM dual", "1:512:dual:threshold:0"),
         ("Fast-dLLM dual + FP8 FFN", "1:512:dual:threshold:1"))
PAPER_RATIOS = {"+ LaCache": 10.59 / 9.60, "+ Parallel + LaCache": 3.52 / 2.48}


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
    ap.add_argument("--paper", action="store_true",
                    help="the paper's combinations (instead of --runs) and their table")
    args = ap.parse_args(argv)
    if args.paper:
        args.runs = ",".join(run for _, run in PAPER)
    cfg, ceil, params = setup(args.tiny, args.layers)
    if args.fp8 != "off":
        params = lj.quantize_ffn(params)
    fp8s = {"off": [False], "on": [True], "both": [False, True]}[args.fp8]
    rows = []
    exit_on_sigterm()
    try:
        for run in args.runs.split(","):
            B, P, mode, decoding, *own = run.split(":")
            own += [""] * (3 - len(own))
            if own[2] not in ("", "dpad"):
                raise SystemExit(f"run {run!r}: its seventh field is 'dpad' or empty")
            dpad = lj.DPadConfig() if own[2] else None
            for fp8 in ({"0": [False], "1": [True], "both": [False, True]}[own[0]] if own[0]
                        else fp8s):
                gen = lj.GenerationConfig(
                    gen_length=args.gen, block_length=args.block,
                    steps=int(own[1]) if own[1] else args.steps or args.gen,
                    cache=mode,
                    threshold=0.9 if decoding == "threshold" else None, stop_at_eos=False,
                    fp8_ffn=fp8, dpad=dpad)
                r, _ = run_one(params, cfg, ceil, gen, int(B), int(P), args.iters)
                r.update(B=int(B), prompt=int(P), cache=mode, decoding=decoding, fp8_ffn=fp8,
                         dpad=dpad and dpad.strategy, run=run)
                rows.append(r)
                print(f"B={B} P={P} {mode:6s} {decoding:9s} fp8 {fp8:d} dpad {own[2] or 'off'} "
                      f"{r['ms_per_step']:7.2f} ms/step  {r['tokens_per_s']:8.1f} tok/s  "
                      f"compile {r['compile_s']:.0f} s", flush=True)
    finally:
        report(cfg, ceil, rows, gen=args.gen, block=args.block, tiny=args.tiny,
               dpad=dataclasses.asdict(lj.DPadConfig()) if any(r["dpad"] for r in rows)
               else None)
        if args.paper:
            paper_table(rows)


def paper_table(rows: list[dict]) -> None:
    """The paper's combinations as a table: ms per step, tokens/s, each with-LaCache row's
    speed-up over the row before it (its pair without), and the paper's where it has one."""
    by_run = {r["run"]: r for r in rows}
    print("| setting | ms/step | tokens/s | speed-up of LaCache (here) | the paper's |")
    print("|---|---|---|---|---|")
    for i, (name, run) in enumerate(PAPER):
        r = by_run.get(run)
        if r is None:  # a run that did not finish
            continue
        without = by_run.get(PAPER[i - 1][1]) if i % 2 else None  # odd entries: with LaCache
        pair = f"{without['ms_per_step'] / r['ms_per_step']:.2f}x" if without else ""
        paper = f"{PAPER_RATIOS[name]:.2f}x" if name in PAPER_RATIOS else ""
        print(f"| {name} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.1f} | {pair} | {paper} |")


if __name__ == "__main__":
    main()
