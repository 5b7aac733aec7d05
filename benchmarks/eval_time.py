"""Wall time of a GSM8K-sized evaluation (issue 19): 1,319 generations of 256 tokens after
~800-token prompts, LLaDA-8B shapes, one GPU, projected from timed steps.

    python -m benchmarks.eval_time [--items 1319] [--prompt 800] [--gen 256]
        [--runs "32:exact:fixed:0:32,32:dual:threshold:1"] [--iters 1] [--layers N] [--tiny]

Each run B:cache:decoding:fp8[:steps] is one `generate` of B prompts, timed as
benchmarks/generate.py times it (`run_one`: compile, one warm-up, `--iters` timed runs; ms per
step = latency / NFE). Projection: ceil(items / B) batches x steps per item x ms per step, plus
one compile. Steps per item:
- the fixed schedule reveals one token per step: `gen` steps. A whole-canvas step (none,
  exact) costs the same at any step count, so a run may time fewer (`steps`, several tokens
  each) and the projection still multiplies by `gen` (the exact cache's block-start fills are
  then a larger share of the timed steps: a bias against it);
- threshold decoding on random weights reveals one token per step too (no confidence passes
  0.9), so its projection is the ONE-TOKEN-PER-STEP BOUND; a trained model revealing k tokens
  per step takes about 1/k of it (not measurable without LLaDA-8B's weights; the table says
  so beside the number).
The default runs: the best lossless setting (LaCache exact cache, fixed schedule, bf16) and
the best approximate one (dual cache, threshold 0.9, FP8 FFN), at batch 32.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

import lacache_jax as lj
from benchmarks.common import exit_on_sigterm, llada_8b_setup, measure_ceilings, write_result
from benchmarks.generate import run_one

DEFAULT_RUNS = "32:exact:fixed:0:32,32:dual:threshold:1"


def parse_run(spec: str, gen: int) -> dict:
    """B:cache:decoding:fp8[:steps] -> its fields (steps default: gen, one token each)."""
    parts = spec.split(":")
    if len(parts) not in (4, 5) or parts[2] not in ("fixed", "threshold") \
            or parts[3] not in ("0", "1"):
        raise ValueError(f"run {spec!r}: want B:cache:fixed|threshold:0|1[:steps]")
    steps = int(parts[4]) if len(parts) == 5 else gen
    if parts[2] == "threshold" and steps != gen:
        raise ValueError(f"run {spec!r}: threshold decoding decides its own steps")
    return dict(B=int(parts[0]), cache=parts[1], decoding=parts[2], fp8_ffn=parts[3] == "1",
                steps=steps)


def project(r: dict, items: int, gen: int) -> dict:
    """The run's timing carried to `items` generations of `gen` tokens, one per step."""
    batches = math.ceil(items / r["B"])
    seconds = batches * gen * r["ms_per_step"] / 1e3
    return dict(batches=batches, projected_s=seconds,
                projected_with_compile_s=seconds + r["compile_s"],
                bound=r["decoding"] == "threshold")


def main(argv: list[str] | None = None) -> str | None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=1319, help="GSM8K's test set: 1,319")
    ap.add_argument("--prompt", type=int, default=800, help="a 5-shot GSM8K prompt's length")
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (quick checks)")
    ap.add_argument("--tiny", action="store_true", help="a tiny fp32 model: a CPU check")
    args = ap.parse_args(argv)
    runs = [parse_run(s, args.gen) for s in args.runs.split(",")]
    if args.tiny:
        # widths of 128 multiples: the FP8 FFN's 128 x 128 weight blocks
        cfg = lj.tiny(max_seq_len=4096, d_model=128, d_ff=256)
        ceil, params = measure_ceilings(), lj.init_params(cfg, jax.random.key(0), jnp.float32)
    else:
        cfg, ceil, params = llada_8b_setup(args.layers)
    if any(r["fp8_ffn"] for r in runs):
        params = lj.quantize_ffn(params)
    rows = []
    exit_on_sigterm()
    try:
        for run in runs:
            gen = lj.GenerationConfig(
                gen_length=args.gen, block_length=args.block, steps=run["steps"],
                cache=run["cache"], threshold=0.9 if run["decoding"] == "threshold" else None,
                stop_at_eos=False, fp8_ffn=run["fp8_ffn"])
            r, _ = run_one(params, cfg, ceil, gen, run["B"], args.prompt, args.iters)
            r.update(run)
            r.update(project(r, args.items, args.gen))
            rows.append(r)
            print(f"B={r['B']} {r['cache']} {r['decoding']} fp8 {r['fp8_ffn']:d}: "
                  f"{r['ms_per_step']:.1f} ms/step over {r['nfe']:.0f} steps; {args.items} "
                  f"items {r['projected_s'] / 60:.1f} min "
                  f"{'(one-token-per-step bound) ' if r['bound'] else ''}"
                  f"+ compile {r['compile_s']:.0f} s", flush=True)
    finally:
        if not args.tiny:  # a check of the script, not a result
            path = write_result("eval_time", {"config": cfg.to_dict(), "ceilings": ceil,
                                              "args": vars(args), "rows": rows})
            print(f"-> {path}")
            return str(path)
    return None


if __name__ == "__main__":
    main()
