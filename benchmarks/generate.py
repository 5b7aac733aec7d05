"""End-to-end generation with random LLaDA-8B bf16 weights (built on the device).

    python -m benchmarks.generate [--batch 1,8] [--modes none,exact,prefix,dual]
                                  [--decoding fixed,threshold] [--prompt 512,1024]
                                  [--dpad off|on|both] [--dpad-strategy gaussian|uniform]
                                  [--dual-update xla,fused] [--short-attention split,cudnn]
                                  [--only CACHE:FP8,...] [--settings SPEC [SPEC ...]]
                                  [--trace] [--tiny]

Random weights never cross a confidence threshold, so every configuration reveals one token
per step (256 steps for gen 256): implementations compare per forward pass. Reports latency,
tokens/s, NFE, ms per step and the per-step floor max(FLOPs / peak, bytes / bandwidth), with
the ceilings measured in the same run. stop_at_eos is off so all runs do the same work.

Each row also reports the rows its forwards compute per block (`cache.block_rows`: the first
forward's columns, a later forward's query rows): prefix queries [s, T), DPad's compact canvas
[0, e) plus the kept suffix slots. `--dpad both` runs every configuration without and with
DPad suffix dropout (same weights, prompts and run), so one call measures what it saves.
`--dual-update xla,fused` runs every dual-cache configuration with its later steps' K/V
projection, RoPE and cache write through XLA's ops (the default) and through Flash-dLLM's
fused cache-update kernel (`lacache_jax.cache.dual_update`), side by side.
`--short-attention split,cudnn` runs every configuration with a few query rows' attention
(a dual-cache step's block) through the split-keys kernel (the default) and through cuDNN.
`--settings` runs every configuration under each SPEC of module-level kernel switches
(`module:NAME=int[,...]`, `common.parse_settings`; e.g.
`kernels.gate_up_swiglu:MGPU_MIN_M=0` and `kernels.gate_up_swiglu:MGPU_MIN_M=768`), in one
process with jax's caches cleared between: a switch timed both ways against the same
ceilings, weights and prompts.
`--tiny` runs a tiny random model (lj.tiny, fp32) instead: a CPU check of the harness.
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

import lacache_jax as lj
from benchmarks.common import (REFERENCE_CEILINGS, exit_on_sigterm, floor_ms, idle_gaps,
                               llada_8b_setup, measure_ceilings, module_settings,
                               parse_settings, time_run, trace, write_result)
from lacache_jax import cache as cache_module
from lacache_jax.cache import block_rows, dual_update
from lacache_jax.model import short_attention_implementation


def step_cost(cfg: lj.ModelConfig, gen: lj.GenerationConfig, B: int, P: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one step, averaged over every block's steps, where the first step of
    each block is a full forward (over DPad's compact canvas with DPad) and later steps query
    the rows `block_rows` gives. FLOPs in bf16 terms: with the FP8 FFN those of layers >= 1
    count half (Hopper's FP8 tensor cores run at twice the bf16 rate). Bytes: weights + the KV
    cache read (prefix and dual; the exact cache holds layer 0's state only, its deeper layers
    run as none's do). The last layer under `cache.HEAD_ROWS_ONLY`: the Q/K/V projection of
    every query row (one fused GEMM), attention, output projection and MLP for the block's
    rows only."""
    T = P + gen.gen_length
    D, F, K, V, L = cfg.d_model, cfg.d_ff, cfg.head_dim, cfg.vocab_size, cfg.n_layers
    qkv, o = D * K * (cfg.n_heads + 2 * cfg.n_kv_heads), D * K * cfg.n_heads
    ffn = 3 * D * F  # per row of a bf16 layer; an FP8 layer counts half
    ffn_layers = 1 + (L - 1) / 2 if gen.fp8_ffn else L
    last_ffn = ffn / 2 if gen.fp8_ffn and L > 1 else ffn

    def flops(queries, keys):
        attn = 2 * keys * cfg.n_heads * K
        head_rows = min(queries, gen.block_length) if cache_module.HEAD_ROWS_ONLY else queries
        return 2.0 * B * (queries * ((L - 1) * (o + attn) + L * qkv)
                          + (ffn_layers * ffn - last_ffn) * queries
                          + head_rows * (o + attn + last_ffn) + gen.block_length * D * V)

    spb = gen.steps_per_block
    kv_cache = gen.cache in ("prefix", "dual")
    per_block = []
    for first, later in block_rows(gen, P):
        keys = T if kv_cache else first  # a KV cache keeps the whole canvas's columns
        per_block.append((flops(first, first) + (spb - 1) * flops(later, keys)) / spb)
    kv_bytes = 2 * L * B * T * cfg.n_kv_heads * K * 2 if kv_cache else 0
    weight_bytes = 2.0 * cfg.n_params
    if gen.fp8_ffn:  # FFN weights of layers >= 1 are read as FP8 (1 byte) instead of bf16
        weight_bytes -= (L - 1) * 3 * D * F
    return float(np.mean(per_block)), weight_bytes + kv_bytes


def run_one(params, cfg, ceil, gen, B: int, P: int, iters: int, mesh=None,
            traced: bool = False, top: int = 6):
    """(timings dict, generated tokens) of one configuration; with `traced`, one more run
    under the profiler: per step, the device's kernel time, its idle time between kernels and
    the wall time, and the `top` largest kernels with their launches per step (where a
    step's time goes)."""
    prompts = np.random.default_rng(B).integers(0, cfg.mask_id, (B, P))
    t0 = time.perf_counter()
    run = lj.compile_generate(params, cfg, prompts, gen, mesh=mesh)
    compile_s = time.perf_counter() - t0
    latency, out = time_run(run, iters)
    nfe = float(np.mean(np.asarray(out.nfe)))
    flops, nbytes = step_cost(cfg, gen, B, P)
    floor, ref_floor = floor_ms(flops, nbytes, ceil), floor_ms(flops, nbytes, REFERENCE_CEILINGS)
    ms_step = latency / nfe * 1e3
    mem = run.compiled.memory_analysis()  # per-block programs (lax.switch) share temp space?
    extra = {}
    if traced:
        t = trace(lambda: jax.block_until_ready(run()))
        idle, gaps = idle_gaps(t.spans, min_ns=50_000)
        per = lambda ns: ns / nfe / 1e6  # noqa: E731
        extra = dict(trace_device_ms_per_step=per(sum(t.device.values())),
                     trace_idle_ms_per_step=per(idle), trace_gaps_over_50us=gaps,
                     trace_wall_ms_per_step=t.wall / nfe * 1e3,
                     trace_top=[(name, per(ns), t.count[name] / nfe)
                                for name, ns in t.device.most_common(top)])
    return dict(**extra, temp_gib=None if mem is None else mem.temp_size_in_bytes / 2**30,
                latency_s=latency, tokens_per_s=B * gen.gen_length / latency, nfe=nfe,
                rows_per_block=[list(r) for r in block_rows(gen, P)],
                tokens_per_step=float(np.mean(np.asarray(out.tokens_per_step))),
                ms_per_step=ms_step, floor_ms=floor, x_floor=ms_step / floor,
                ref_floor_ms=ref_floor, x_ref_floor=ms_step / ref_floor,
                compile_s=compile_s), np.asarray(out.tokens)[:, -gen.gen_length:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--modes", default="none,prefix,dual")
    ap.add_argument("--decoding", default="fixed,threshold")
    ap.add_argument("--prompt", default="512", help="comma-separated prompt lengths")
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (quick checks)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--fp8-ffn", default="off", choices=["off", "on", "both"],
                    help="FP8 FFN in layers >= 1 (weights quantised once, on the device)")
    ap.add_argument("--dpad", default="off", choices=["off", "on", "both"],
                    help="DPad suffix dropout; both: every configuration without, then with")
    ap.add_argument("--dpad-strategy", default="gaussian", choices=["gaussian", "uniform"])
    ap.add_argument("--dpad-window", type=int, default=256)
    ap.add_argument("--dpad-keep", type=int, default=32, help="uniform: positions kept")
    ap.add_argument("--dual-update", default="xla",
                    help="comma-separated among xla,fused: how dual's later steps write K/V")
    ap.add_argument("--short-attention", default="split",
                    help="comma-separated among split,cudnn: a few query rows' attention")
    ap.add_argument("--only", default=None, metavar="CACHE:FP8,...",
                    help="run only these of --modes x --fp8-ffn (e.g. none:off,exact:on: the "
                         "headline's two, where a call's time is short)")
    ap.add_argument("--settings", nargs="+", default=[""], metavar="SPEC",
                    help="module:NAME=int[,...] switches, each SPEC a run of every "
                         "configuration")
    ap.add_argument("--trace", action="store_true",
                    help="one more run of each configuration under the profiler")
    ap.add_argument("--trace-top", type=int, default=6,
                    help="with --trace: how many of the largest kernels the JSON keeps")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny random fp32 model (lj.tiny) instead of LLaDA-8B: a CPU check")
    args = ap.parse_args()
    for spec in args.settings:
        parse_settings(spec)  # a typo fails before the weights are built
    if args.only is not None:
        args.only = set(args.only.split(","))
        unknown = args.only - {f"{m}:{f}" for m in args.modes.split(",") for f in ("off", "on")}
        if unknown:
            ap.error(f"--only: {sorted(unknown)} not among --modes x off,on")

    cfg, ceil, params = setup(args.tiny, args.layers)
    if args.fp8_ffn != "off":
        params = lj.quantize_ffn(params)
    rows, baseline = [], {}
    exit_on_sigterm()
    try:
        measure_all(args, cfg, ceil, params, rows, baseline)
    finally:
        dpad = (None if args.dpad == "off" else
                dict(strategy=args.dpad_strategy, window=args.dpad_window, keep=args.dpad_keep))
        report(cfg, ceil, rows, gen=args.gen, block=args.block, dpad=dpad, tiny=args.tiny)


def setup(tiny: bool, layers: int | None):
    """(config, measured ceilings, params): random LLaDA-8B in bf16, or with `tiny` a tiny fp32
    model (a CPU check of a script; widths of 128 so that the FP8 FFN applies)."""
    if not tiny:
        return llada_8b_setup(layers)
    cfg = lj.tiny(max_seq_len=4096, d_model=128, d_ff=256,
                  **({"n_layers": layers} if layers else {}))
    return cfg, measure_ceilings(), lj.init_params(cfg, jax.random.key(0), jnp.float32)


def measure_all(args, cfg, ceil, params, rows, baseline):
    fp8s = {"off": [False], "on": [True], "both": [False, True]}[args.fp8_ffn]
    dpad = lj.DPadConfig(strategy=args.dpad_strategy, window=args.dpad_window,
                         keep=args.dpad_keep)
    dpads = {"off": [None], "on": [dpad], "both": [None, dpad]}[args.dpad]
    updates = args.dual_update.split(",")
    for u in updates:
        if u not in dual_update.choices:
            raise SystemExit(f"--dual-update: {u!r} is not one of {dual_update.choices}")
    updates.sort(key=lambda u: u != "xla")  # XLA's run first: the others compare to it
    shorts = args.short_attention.split(",")
    for a in shorts:
        if a not in short_attention_implementation.choices:
            raise SystemExit(f"--short-attention: {a!r} is not one of "
                             f"{short_attention_implementation.choices}")
    for B, P, decoding, mode, fp8, dp, update, short, spec in itertools.product(
            map(int, args.batch.split(",")), map(int, args.prompt.split(",")),
            args.decoding.split(","), args.modes.split(","), fp8s, dpads, updates, shorts,
            args.settings):
        if update != "xla" and mode != "dual":
            continue  # only the dual cache's later steps have the choice
        if args.only and f"{mode}:{'on' if fp8 else 'off'}" not in args.only:
            continue
        gen = lj.GenerationConfig(
            gen_length=args.gen, block_length=args.block, steps=args.gen, cache=mode,
            threshold=0.9 if decoding == "threshold" else None, stop_at_eos=False,
            fp8_ffn=fp8, dpad=dp)
        if len(updates) > 1 or len(shorts) > 1:  # choices read while tracing: no reuse
            jax.clear_caches()
        with dual_update(update), short_attention_implementation(short), \
                module_settings(spec):
            r, tokens = run_one(params, cfg, ceil, gen, B, P, args.iters, traced=args.trace,
                                top=args.trace_top)
        if mode == "none" and not fp8 and dp is None:
            baseline[B, P, decoding, spec] = tokens
        if update == "xla":
            baseline[B, P, decoding, mode, fp8, dp, spec] = tokens
        if spec == args.settings[0]:
            baseline[B, P, decoding, mode, fp8, dp, update, short] = tokens
        # bf16: exact caching sums layer 0's attention in another order than cuDNN does.
        r.update(B=B, prompt=P, cache=mode, decoding=decoding, fp8_ffn=fp8, dual_update=update,
                 short_attention=short, settings=spec,
                 dpad=None if dp is None else dp.strategy, same_generated_as_none=(
                     float(np.mean(tokens == baseline[B, P, decoding, spec]))
                     if (B, P, decoding, spec) in baseline and dp is None else None))
        xla = baseline.get((B, P, decoding, mode, fp8, dp, spec))
        if update != "xla" and xla is not None:  # bf16: another summation order, near-ties
            r["same_generated_as_xla_update"] = float(np.mean(tokens == xla))
        if spec != args.settings[0]:  # a switch that changes the sums' order may flip ties
            r["same_generated_as_first_settings"] = float(np.mean(
                tokens == baseline[B, P, decoding, mode, fp8, dp, update, short]))
        rows.append(r)
        rows_txt = ", ".join(f"{a}/{b}" for a, b in r["rows_per_block"])
        compared = ("" if update == "xla" else
                  f"  generated tokens as the xla update's {r.get('same_generated_as_xla_update')}")
        if spec != args.settings[0]:
            compared += (f"  generated tokens as {args.settings[0] or 'no settings'}'s "
                       f"{r['same_generated_as_first_settings']}")
        print(f"B={B} P={P} {mode:6s} {decoding:9s} fp8 {fp8:d} dpad {r['dpad'] or 'off'} "
              f"update {update} short {short} {spec} "
              f"{r['latency_s']:6.2f} s  "
              f"{r['ms_per_step']:6.2f} ms/step (floor {r['floor_ms']:.2f}, "
              f"x{r['x_floor']:.2f}; reference floor {r['ref_floor_ms']:.2f}, "
              f"x{r['x_ref_floor']:.2f})  NFE {r['nfe']:.0f}  generated tokens as none's "
              f"{r['same_generated_as_none']}  compile {r['compile_s']:.0f} s"
              f"{compared}\n"
              + (f"    trace per step: device {r['trace_device_ms_per_step']:.3f} ms, idle "
                 f"{r['trace_idle_ms_per_step']:.3f} ms, wall {r['trace_wall_ms_per_step']:.3f}"
                 f" ms; top {[(n[:60], round(ms, 3)) for n, ms, _ in r['trace_top'][:6]]}\n"
                 if "trace_top" in r else "") +
              f"    rows per block (first forward / later query rows): {rows_txt}", flush=True)


def report(cfg, ceil, rows, *, gen: int, block: int, dpad: dict | None = None,
           tiny: bool = False):
    """Write the rows' JSON (`generate-*.json`) and print them as a table; `dpad`: the DPad
    settings the runs with DPad used."""
    path = write_result("generate", {"config": cfg.to_dict(), "ceilings": ceil,
                                     "gen": gen, "block": block, "dpad": dpad,
                                     "tiny": tiny, "rows": rows})
    print(f"ceilings: bf16 matmul {ceil['bf16_matmul_tflops']:.0f} TFLOP/s, "
          f"copy {ceil['copy_tb_per_s']:.2f} TB/s -> {path}")
    print("| B | prompt | cache | decoding | fp8 FFN | DPad | dual update | settings | "
          "latency s | tokens/s | NFE | "
          "ms/step | × no DPad | floor ms (measured / reference) | "
          "× floor (measured / reference) | compile s | XLA temp GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    plain = {_key(r): r["ms_per_step"] for r in rows if r["dpad"] is None}
    for r in rows:
        ratio = (f"{r['ms_per_step'] / plain[_key(r)]:.2f}"
                 if r["dpad"] is not None and _key(r) in plain else "")
        print(f"| {r['B']} | {r['prompt']} | {r['cache']} | {r['decoding']} | "
              f"{'yes' if r['fp8_ffn'] else 'no'} | {r['dpad'] or 'off'} | "
              f"{r.get('dual_update', 'xla') if r['cache'] == 'dual' else ''} | "
              f"{r.get('settings', '')} | "
              f"{r['latency_s']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {r['nfe']:.0f} | {r['ms_per_step']:.2f} | {ratio} | "
              f"{r['floor_ms']:.2f} / {r['ref_floor_ms']:.2f} | {r['x_floor']:.2f} / "
              f"{r['x_ref_floor']:.2f} | {r['compile_s']:.0f} | "
              f"{'' if r['temp_gib'] is None else format(r['temp_gib'], '.2f')} |")


def _key(r: dict) -> tuple:
    """A row's configuration without its DPad setting."""
    return (r["B"], r["prompt"], r["cache"], r["decoding"], r["fp8_ffn"], r.get("dual_update"),
            r.get("settings"))


if __name__ == "__main__":
    main()
