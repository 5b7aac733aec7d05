"""Slot refill against static batches (issue 16): throughput on variable-length workloads.

    python -m benchmarks.serve demo [--checkpoint DIR] [--n 2000] [--slots 64,256]
                                    [--block 8] [--settings threshold=0.9,cache=dual] [--flash]
                                    [--profile]
    python -m benchmarks.serve llada [--n 128] [--slots 32] [--layers 32] [--tiny] [--flash]
                                     [--gpus 1,2]
    python -m benchmarks.serve memory [--slots 32] [--prompt 512] [--gen 256] [--layers 32]
                                      [--tiny]
    python -m benchmarks.serve bounds [--n 2000] [--slots 64,256] [--block 2,4,8]

`demo`: the demo model (converted from demo_model/ unless --checkpoint is given) on `--n`
held-out problems (benchmarks/arith.py: answers of 1 to 5 digit columns, so 14 to 63 tokens).
Per S: (1) static batches, `lj.generate` on each run of S prompts in input order (today's way to
push a data set through); (2) slot refill, `lj.generate(..., slots=S)`; (3) the slot program
with refill off (static batches through it: its cost apart from refill). Throughput = answer
tokens up to EOS / wall seconds, every program compiled first; accuracy and token identity with
(1) are reported. Refill works at block granularity: a static batch of many rows costs its
longest row's blocks, a refilled slot each row's own, so the gain is bounded by num_blocks /
mean blocks per row (`refill_bound`, from the answers). For the 2,000 test answers (12-62 tokens
of gen 64) the bound is 1.05x at block 32, 1.21x at 16, 1.27x at 8, 1.33x at 4 (1.37x at one
token per block); hence `--block 4,8` by default and the fixed schedule (one token per step:
threshold decoding finishes a demo block in about two steps, where any per-block overhead weighs
more). On the H200 (3) ran at 0.63-0.89x of (1) when the slot program was a per-block one driven
by the host (RESULTS.md, sixth and seventh sessions); `--profile` traces each path's run once
and prints its device kernel time against its wall time and the device's idle gaps, to tell the
program's own work from the device waiting on the host.

`llada`: LLaDA-8B shapes, random bf16 weights, S slots, prompts of 128-1024 tokens, answer
lengths drawn uniformly from 32-512 (gen_length 512, block 32, dual cache, threshold 0.9).
Random weights emit no EOS, so a BENCHMARK-ONLY STOP RULE ends row i after the block holding
its drawn length (`slots.run(block_limits=)`), in both variants: slot refill vs static batches
of S through the same slot program (a batch runs until its longest row's limit). Tokens/s
counts the drawn lengths. `in_order_bound` (printed beside the speed-up) is what refill in
input order gains on the drawn lengths if every block costs the same (it does not quite: a
slot program's blocks cost more with a longer prompt bucket): 1.46x for the default 128
requests through 32 slots, 1.74x for 512 (the queue's tail, where slots idle, weighs less).
`--layers` fewer than 32 shortens a run of many requests (every step's cost scales with the
layers; the host round trip per block does not, so the measured gain is if anything
understated).

`--gpus 1,2` (llada, block decoding): each `--slots` value is per device, and runs with the
slots split over a data axis of each count of devices (`slots.run(..., mesh=)`: S = slots x
devices in the JSON's `S`, `S_per_device` beside it; static batches of S through the same
program as the baseline); 1 is one device without a mesh (issue 21).

`--flash` (demo, llada): Flash-dLLM decoding (`lj.FlashConfig()` defaults, threshold 0.9 or
the `--settings` one) through its own slot scheduler (lacache_jax/flash_slots.py), refilled at
the step a row finishes, not at a block end; `--block` does not apply. In `llada` the
benchmark-only stop rule then ends row i after as many steps as its drawn length (random
weights accept one token per step, so that is the step that decodes its last drawn token).

`memory`: compiled memory of the static `generate` program for S rows next to the slot
program's (S slots, prompt bucket = --prompt), LLaDA-8B shapes (abstract weights: nothing is
allocated; XLA's memory analysis of the compiled programs).

`bounds`: `demo`'s two bounds from the reference answers on the CPU (no model: the demo model
reproduces them): `refill_bound` (num_blocks / mean blocks per row) and `queue_bound`
(`in_order_bound` over the order slots.py admits in, longest prompt first, which counts the
queue's tail, where fewer rows than slots are left); `demo` records both from its own answers.

`--tiny` (llada, memory) swaps in `lj.tiny()` shapes and small lengths: a CPU check that the
code runs, not a measurement.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

import lacache_jax as lj
from benchmarks import arith
from benchmarks.common import exit_on_sigterm, load_model, profile, write_result
from lacache_jax import flash_slots
from lacache_jax import slots as slot_refill
from lacache_jax import sharding


def _settings(text: str) -> dict:
    """'threshold=0.9,cache=dual' -> {'threshold': 0.9, 'cache': 'dual'}."""
    out = {}
    for item in filter(None, text.split(",")):
        name, value = item.split("=")
        try:
            out[name] = float(value) if "." in value else int(value)
        except ValueError:
            out[name] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def in_order_bound(units, S: int, order=None) -> float:
    """What slot refill gains over static batches of S in input order if every unit (block,
    or step with flash) costs the same: the static batches' sum of their longest row's units
    over the makespan of refilling S slots in `order` (default: input order; slots.py admits
    the longest prompt first), a slot taking the next request when it frees. A guide, not a
    ceiling: units do not cost quite the same (a slot program's blocks cost more with a longer
    prompt bucket). The tail, where fewer than S requests are left, keeps a short queue below
    num_blocks / mean blocks (`serve llada`'s draws, 32 slots: 1.46x by blocks for 128
    requests, 1.74x for 512)."""
    units = np.asarray(units)
    static = sum(int(units[i:i + S].max()) for i in range(0, len(units), S))
    free = [0] * S
    for u in units if order is None else units[np.asarray(order)]:
        heapq.heappush(free, heapq.heappop(free) + int(u))
    return static / max(free)


def queue_order(prompt_lengths) -> np.ndarray:
    """The order slots.run admits prompts in: longest first, ties in input order."""
    return np.argsort(-np.asarray(prompt_lengths), kind="stable")


def block_bounds(answer_lengths, block: int, gen_length: int, S: int,
                 prompt_lengths) -> tuple[float, float]:
    """`demo`'s two bounds on refill at `block` tokens a block: `refill_bound` (num_blocks /
    mean blocks per row, a row decoding up to the block that holds its EOS) and `queue_bound`
    (in_order_bound in the queue's order, which counts its tail)."""
    nb = gen_length // block
    units = np.minimum(np.asarray(answer_lengths) // block + 1, nb)
    return nb / float(units.mean()), in_order_bound(units, S, queue_order(prompt_lengths))


def _timed(fn, repeats: int = 1):
    """(the last run's output, the median of `repeats` runs' seconds, every run's seconds):
    one-second runs of the same program spread by up to a quarter within a device call
    (RESULTS.md, eighth session), so a ratio of two single runs can land on either side of a
    goal."""
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        seconds.append(time.perf_counter() - t0)
    return out, float(np.median(seconds)), seconds


def _static(params, cfg, prompts, gen, keys, S):
    """`generate` on each run of S prompts in input order; returns (tokens, gen_lengths) per
    prompt, prompts left-padded to the longest of all."""
    outs = [lj.generate(params, cfg, prompts[i:i + S], gen, key=keys[i:i + S])
            for i in range(0, len(prompts), S)]
    P = max(map(len, prompts))
    toks = np.concatenate([np.pad(np.asarray(o.tokens), [(0, 0), (P + gen.gen_length
                                                                  - o.tokens.shape[1], 0)],
                                  constant_values=cfg.pad_id) for o in outs])
    return toks, np.concatenate([np.asarray(o.gen_lengths) for o in outs])


def _warm(programs: dict, params, S: int, gen, keys, cfg, mesh=None) -> None:
    """One short run of S prompts through each compiled program (first runs pay one-time
    costs): with flash two steps, else one block."""
    for P in programs:
        prompts, limits = [np.zeros(P, np.int32)] * S, np.full(S, 2 if gen.flash else 1)
        if gen.flash is not None:
            flash_slots.run(params, cfg, gen, prompts, keys[:S], S, programs=programs,
                            step_limits=limits)
        else:
            slot_refill.run(params, cfg, gen, prompts, keys[:S], S, programs=programs,
                            block_limits=limits, mesh=mesh)


def demo(args, out: dict) -> None:
    from benchmarks.train_demo import GEN_LEN
    cfg, params, tok = load_model(args.checkpoint)
    problems = arith.sample("test", args.n, seed=0)
    prompts = [tok.encode(arith.prompt_text(a, b)) for a, b in problems]
    keys = jax.random.split(jax.random.key(0), len(prompts))
    rows_in = [np.asarray(p, np.int32) for p in prompts]

    def accuracy(tokens, lens):
        start = tokens.shape[1] - GEN_LEN
        texts = [tok.decode(tokens[b, start:start + lens[b]].tolist()) for b in range(len(lens))]
        return float(np.mean([arith.check(a, b, t) for (a, b), t in zip(problems, texts)]))

    out.update(checkpoint=args.checkpoint or "demo_model", settings=args.settings or "fixed",
               flash=args.flash, rows=[])
    blocks_arg = [None] if args.flash else map(int, args.block.split(","))
    for block, S in itertools.product(blocks_arg, map(int, args.slots.split(","))):
        if args.flash:
            gen = lj.GenerationConfig(gen_length=GEN_LEN, **{"threshold": 0.9,
                                                             **_settings(args.settings)},
                                      flash=lj.FlashConfig())
        else:
            gen = lj.GenerationConfig(gen_length=GEN_LEN, block_length=block, steps=GEN_LEN,
                                      **_settings(args.settings))
        rg = gen.resolve(cfg)
        _static(params, cfg, prompts, gen, keys, S)  # compiles every batch shape
        (toks, lens), t_static, ts_static = _timed(
            lambda: _static(params, cfg, prompts, gen, keys, S), args.repeats)
        run = lj.compile_generate(params, cfg, prompts, gen, key=keys, slots=S)
        _warm(run.programs, params, min(S, len(prompts)), rg, keys, cfg)
        slots_out, t_slots, ts_slots = _timed(run, args.repeats)
        slot_refill.run(params, cfg, rg, rows_in, keys, S, refill=False)  # compiles
        _, t_blocks, ts_blocks = _timed(lambda: slot_refill.run(params, cfg, rg, rows_in, keys, S,
                                                                refill=False), args.repeats)
        answer_tokens = int(lens.sum())
        slots_tokens = np.asarray(slots_out.tokens)
        # Block decoding refills at block ends: its gain is bounded (module docstring).
        bound, queue_bound = (None, None) if args.flash else block_bounds(
            lens, block, GEN_LEN, S, [len(r) for r in rows_in])
        r = dict(S=S, block_length=block, n=len(prompts), answer_tokens=answer_tokens,
                 refill_bound=bound, queue_bound=queue_bound,
                 static_s=t_static, slots_s=t_slots, static_blocks_s=t_blocks,
                 runs_s=dict(static=ts_static, slots=ts_slots, static_blocks=ts_blocks),
                 static_tok_s=answer_tokens / t_static, slots_tok_s=answer_tokens / t_slots,
                 static_blocks_tok_s=answer_tokens / t_blocks, speedup=t_static / t_slots,
                 speedup_vs_static_blocks=t_blocks / t_slots,
                 static_accuracy=accuracy(toks, lens),
                 slots_accuracy=accuracy(slots_tokens, np.asarray(slots_out.gen_lengths)),
                 same_tokens=bool((slots_tokens == toks).all()))
        out["rows"].append(r)
        if args.profile:  # where the slot program's time goes: device work or waiting
            for name, fn in (("static generate", lambda: _static(params, cfg, prompts, gen,
                                                                 keys, S)),
                             ("static through the slot program", lambda: slot_refill.run(
                                 params, cfg, rg, rows_in, keys, S, refill=False)),
                             ("slot refill", run)):
                print(f"profile, {name} (one whole run):\n"
                      + profile(lambda: jax.block_until_ready(fn()), 1), flush=True)
        limit = "" if bound is None else f" of at most {bound:.2f}x, {queue_bound:.2f}x"
        print(f"{'flash' if block is None else f'block {block:2d}'} S={S:4d}: static "
              f"{r['static_tok_s']:8.0f} tok/s, slots "
              f"{r['slots_tok_s']:8.0f} tok/s ({r['speedup']:.2f}x{limit}; static through "
              f"the slot program "
              f"{r['static_blocks_tok_s']:.0f} tok/s), accuracy {r['static_accuracy']:.3f} / "
              f"{r['slots_accuracy']:.3f}, same tokens {r['same_tokens']}", flush=True)


def _model(args) -> lj.ModelConfig:
    import dataclasses
    if args.tiny:  # CPU check of the code path: small shapes and lengths
        args.gen, args.block, args.prompt = 32, 8, 16
        args.prompt_range, args.answer_range = (4, 40), (4, 32)
        return lj.tiny(n_layers=args.layers if args.layers < 32 else 2)
    return dataclasses.replace(lj.llada_8b(), n_layers=args.layers)


def llada(args, out: dict) -> None:
    cfg = _model(args)
    params = lj.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    rng = np.random.default_rng(0)
    lo, hi = args.prompt_range
    prompts = [rng.integers(0, min(cfg.mask_id, cfg.eos_id), rng.integers(lo, hi + 1))
               .astype(np.int32) for _ in range(args.n)]
    answer = rng.integers(args.answer_range[0], args.answer_range[1] + 1, args.n)
    if args.flash:
        gen = lj.GenerationConfig(gen_length=args.gen, threshold=0.9, stop_at_eos=False,
                                  flash=lj.FlashConfig()).resolve(cfg)
        settings = "flash (FlashConfig defaults), threshold 0.9"
        stop_rule = "benchmark only: row i ends after as many steps as its drawn length"
        limits = dict(step_limits=answer)  # one token per step with random weights
    else:
        gen = lj.GenerationConfig(gen_length=args.gen, block_length=args.block, steps=args.gen,
                                  cache="dual", threshold=0.9, stop_at_eos=False).resolve(cfg)
        settings = "dual cache, threshold 0.9"
        stop_rule = "benchmark only: row i ends after the block holding its drawn length"
        limits = dict(block_limits=-(-answer // gen.block_length))
    run = flash_slots.run if args.flash else slot_refill.run
    keys = jax.random.split(jax.random.key(0), args.n)
    out.update(layers=cfg.n_layers, d_model=cfg.d_model, prompt_range=list(args.prompt_range),
               answer_range=list(args.answer_range), gen_length=args.gen,
               block_length=None if args.flash else args.block, settings=settings, rows=[])
    gpus = [int(n) for n in args.gpus.split(",")]
    if args.flash and gpus != [1]:
        raise SystemExit("--gpus applies to block decoding (Flash-dLLM slots run on one device)")
    if max(gpus) > len(jax.devices()):
        raise SystemExit(f"--gpus {args.gpus}: only {len(jax.devices())} devices here")
    units = answer if args.flash else limits["block_limits"]
    for n_dev in gpus:  # the weights placed once per device count
        mesh = None if n_dev == 1 else lj.make_mesh(n_dev, 1, devices=jax.devices()[:n_dev])
        placed = params if mesh is None else sharding.shard_params(params, cfg, mesh)
        # flash_slots.run takes no mesh (refused above)
        mesh_kw = {} if mesh is None else dict(mesh=mesh)
        for S1 in map(int, args.slots.split(",")):
            S = S1 * n_dev
            r = dict(S=S, S_per_device=S1, devices=n_dev, n=args.n, answer_tokens=int(answer.sum()),
                     answer_lengths=answer.tolist(),
                     stop_rule=stop_rule + " (random weights emit no EOS)",
                     in_order_bound=in_order_bound(units, S))
            out["rows"].append(r)  # filled as it goes: a timed-out run keeps what it measured
            t0 = time.perf_counter()
            programs = slot_refill.compile_programs(placed, cfg, gen, prompts, keys, S, **mesh_kw)
            r["compile_s"] = time.perf_counter() - t0
            _warm(programs, placed, min(S, args.n), gen, keys, cfg, **mesh_kw)
            for name, refill in (("static", False), ("slots", True)):
                _, seconds, _ = _timed(lambda: run(placed, cfg, gen, prompts, keys, S,
                                                   refill=refill, programs=programs, **limits,
                                                   **mesh_kw))
                r[f"{name}_s"], r[f"{name}_tok_s"] = seconds, r["answer_tokens"] / seconds
                print(f"S={S} on {n_dev} device(s): {name} {r[f'{name}_tok_s']:.0f} tok/s "
                      f"({seconds:.1f} s)", flush=True)
            r["speedup"] = r["static_s"] / r["slots_s"]
            print(f"S={S} on {n_dev} device(s): slot refill {r['speedup']:.2f}x the static batches "
                  f"({'step' if args.flash else 'block'} counts alone give "
                  f"{r['in_order_bound']:.2f}x: `in_order_bound`)", flush=True)


def bounds(args, out: dict) -> None:
    """`refill_bound` (num_blocks / mean blocks) and `queue_bound` (in_order_bound over the
    queue's order, with the tail) of `serve demo`, from the reference answers' token counts."""
    from benchmarks.train_demo import GEN_LEN
    from lacache_jax.tokenizer import Tokenizer
    tok = Tokenizer("demo_model")
    problems = arith.sample("test", args.n, seed=0)
    lens = [len(tok.encode(arith.answer_text(a, b))) for a, b in problems]
    prompt_lens = [len(tok.encode(arith.prompt_text(a, b))) for a, b in problems]
    out.update(n=args.n, rows=[])
    for block, S in itertools.product(map(int, args.block.split(",")),
                                      map(int, args.slots.split(","))):
        refill, queue = block_bounds(lens, block, GEN_LEN, S, prompt_lens)
        r = dict(block_length=block, S=S, refill_bound=refill, queue_bound=queue)
        out["rows"].append(r)
        print(f"block {block:2d} S={S:4d}: refill_bound {r['refill_bound']:.3f}x, queue_bound "
              f"{r['queue_bound']:.3f}x", flush=True)


def memory(args, out: dict) -> None:
    cfg = _model(args)
    params = jax.eval_shape(lambda: lj.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    prompts = np.zeros((args.slots, args.prompt), np.int32)
    gen = lj.GenerationConfig(gen_length=args.gen, block_length=args.block, steps=args.gen,
                              cache="dual", threshold=0.9)
    out.update(layers=cfg.n_layers, d_model=cfg.d_model, S=args.slots, prompt=args.prompt,
               gen=args.gen, settings="dual cache, threshold 0.9")
    for name, kw in (("static", {}), ("slots", dict(slots=args.slots))):
        run = lj.compile_generate(params, cfg, prompts, gen, **kw)
        m = run.compiled.memory_analysis()
        out[name] = {f: int(getattr(m, f)) for f in (
            "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes")}
        mib = (sum(out[name].values()) - 2 * out[name]["alias_size_in_bytes"]) / 2**20
        out[name]["total_mib"] = mib
        print(f"{name:6s}: {mib:10.1f} MiB (arguments "
              f"{out[name]['argument_size_in_bytes'] / 2**20:.1f}, temporaries "
              f"{out[name]['temp_size_in_bytes'] / 2**20:.1f})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    d = sub.add_parser("demo")
    d.add_argument("--checkpoint")
    d.add_argument("--n", type=int, default=2000)
    d.add_argument("--slots", default="64,256")
    d.add_argument("--block", default="4,8", help="comma-separated block lengths")
    d.add_argument("--settings", default="", help="GenerationConfig fields, e.g. "
                   "threshold=0.9,cache=dual (default: the fixed schedule, no cache)")
    d.add_argument("--flash", action="store_true", help="Flash-dLLM decoding")
    d.add_argument("--repeats", type=int, default=3,
                   help="timed runs per path; the median counts (every run is recorded)")
    d.add_argument("--profile", action="store_true", help="trace each path's run once: "
                   "device kernel time against wall time, largest kernels and host events")
    g = sub.add_parser("llada")
    g.add_argument("--n", type=int, default=128)
    g.add_argument("--slots", default="32")
    g.add_argument("--layers", type=int, default=32)
    g.add_argument("--gen", type=int, default=512)
    g.add_argument("--block", type=int, default=32)
    g.add_argument("--tiny", action="store_true")
    g.add_argument("--prompt-range", type=int, nargs=2, default=(128, 1024))
    g.add_argument("--answer-range", type=int, nargs=2, default=(32, 512))
    g.add_argument("--flash", action="store_true", help="Flash-dLLM decoding")
    g.add_argument("--gpus", default="1", help="comma-separated device counts of a data axis "
                   "over which the slots split (S per device)")
    m = sub.add_parser("memory")
    m.add_argument("--slots", type=int, default=32)
    m.add_argument("--prompt", type=int, default=512)
    m.add_argument("--gen", type=int, default=256)
    m.add_argument("--layers", type=int, default=32)
    m.add_argument("--block", type=int, default=32)
    m.add_argument("--tiny", action="store_true")
    b = sub.add_parser("bounds", help="demo's refill bounds from the reference answers "
                       "(CPU, no model: the demo model reproduces them)")
    b.add_argument("--n", type=int, default=2000)
    b.add_argument("--slots", default="64,256")
    b.add_argument("--block", default="2,4,8")
    args = ap.parse_args()
    if args.what == "demo" and args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    exit_on_sigterm()
    result = {}
    try:
        {"demo": demo, "llada": llada, "memory": memory, "bounds": bounds}[args.what](
            args, result)
    finally:
        print(f"-> {write_result('serve_' + args.what, result)}")


if __name__ == "__main__":
    main()
