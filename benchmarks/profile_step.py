"""Where a batch-1 dual-cache step's time goes (LLaDA-8B shape, random bf16 weights), and
whether the compiled generate loop moves weight-sized arrays.

    python -m benchmarks.profile_step [--batch 1] [--prompt 512] [--gen 256] [--block 32]
                                      [--layers N] [--tiny] [--hlo PATH]

Times, each jitted on its own: the weight-streaming matmuls alone (the floor's work), the
model's dual-cache step (block queries against a full-canvas cache, with and without the
key mask), and the whole generate loop per step (`lj.compile_generate`). The differences say
what dominates.

Moves: in the optimised HLO of that generate program (`run.compiled.as_text()`), every copy,
concatenate, transpose, reshape, convert, (dynamic-)slice, dynamic-update-slice, pad,
reverse, gather or scatter, fused or not, whose result is at least as large as the smallest
weight matrix (`benchmarks/hlo_moves.py` says exactly what counts), by while-loop depth:
0 outside the loops (once per call), 1 in the loop over blocks (once per block), 2 in the
loop over a block's steps (every step). At batch 1 a later step's activations (the block's
rows) are far smaller than any weight, so what depth 2 lists is a weight or a KV cache being
moved; the full-canvas first step of a block (depth 1) has activations that can reach
weight size ([T, 2F] bf16 is 38 MB at T 768), so read depth-1 entries by their shapes.
`--tiny` runs `lj.tiny()` shapes for a quick CPU check of the script; there activations are as
large as the weights and are listed at every depth. `--hlo` writes the HLO text (default:
`$OUT/dual_generate_hlo.txt` when $OUT is set).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import lacache_jax as lj
from benchmarks.common import llada_8b_setup, measure_ceilings, time_fn, write_result
from benchmarks.hlo_moves import weight_sized_moves
from lacache_jax.model import forward_layers, lm_head


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (quick checks)")
    ap.add_argument("--tiny", action="store_true", help="lj.tiny() shapes (CPU smoke run)")
    ap.add_argument("--hlo", default=None, help="write the generate program's optimised HLO")
    args = ap.parse_args()
    B, bl, T = args.batch, args.block, args.prompt + args.gen
    if args.tiny:
        cfg = lj.tiny(**({"n_layers": args.layers} if args.layers else {}))
        ceil = measure_ceilings()
        params = lj.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    else:
        cfg, ceil, params = llada_8b_setup(args.layers)
    if T > cfg.max_seq_len:
        ap.error(f"--prompt + --gen = {T} exceeds the model's max_seq_len {cfg.max_seq_len}")
    key = jax.random.key(1)
    x = jax.random.normal(key, (B, bl, cfg.d_model), jnp.bfloat16)

    @jax.jit
    def matmuls_only(params, x):
        # The step's weight traffic with nothing else: every projection and the head.
        acc = jnp.zeros((), jnp.float32)
        for layer in params.layers:
            acc += (x @ layer.w_qkv).astype(jnp.float32).sum()
            acc += (x @ layer.wo).astype(jnp.float32).sum()
            gate, up = jnp.split(x @ layer.w_gate_up, 2, axis=-1)
            acc += ((jax.nn.silu(gate) * up) @ layer.w_down).astype(jnp.float32).sum()
        return acc + (x @ params.head).astype(jnp.float32).sum()

    shape = (B, T, cfg.n_kv_heads, cfg.head_dim)
    cache_k = [jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)
               for i in range(cfg.n_layers)]
    cache_v = [c * 0.5 for c in cache_k]
    tokens = jax.random.randint(key, (B, bl), 0, cfg.mask_id)
    s = jnp.int32(args.prompt)
    pos = jnp.broadcast_to(s + jnp.arange(bl), (B, bl))
    keep = jnp.ones((B, T), bool)

    def dual_step(params, ck, cv, tokens, pos, s, keep):
        put = lambda c, new: jax.lax.dynamic_update_slice_in_dim(c, new, s, axis=1)
        kv_fns = [lambda k, v, i=i: (put(ck[i], k), put(cv[i], v)) for i in range(cfg.n_layers)]
        h, ks, vs = forward_layers(params, cfg, tokens, pos, keep, kv_fns)
        return lm_head(params, cfg, h), ks, vs

    step = jax.jit(dual_step, donate_argnums=(1, 2))
    step_nomask = jax.jit(lambda p, ck, cv, t, pos, s: dual_step(p, ck, cv, t, pos, s, None),
                          donate_argnums=(1, 2))

    def run_step(fn, *extra):
        state = {"k": [jnp.copy(c) for c in cache_k], "v": [jnp.copy(c) for c in cache_v]}

        def call():
            logits, state["k"], state["v"] = fn(params, state["k"], state["v"], tokens, pos, s,
                                                *extra)
            return logits
        return time_fn(call, iters=50)

    results = {
        "matmuls_only_ms": time_fn(matmuls_only, params, x, iters=50)["median_ms"],
        "dual_step_ms": run_step(step, keep)["median_ms"],
        "dual_step_nomask_ms": run_step(step_nomask)["median_ms"],
    }
    gen = lj.GenerationConfig(gen_length=args.gen, block_length=bl, steps=args.gen,
                              cache="dual", stop_at_eos=False)
    prompts = np.random.default_rng(0).integers(0, cfg.mask_id, (B, args.prompt)).astype(np.int32)
    run = lj.compile_generate(params, cfg, prompts, gen)
    loop = time_fn(run, warmup=1, iters=3)
    results["generate_ms_per_step"] = loop["median_ms"] / args.gen

    hlo = run.compiled.as_text()
    hlo_path = args.hlo or (os.environ.get("OUT") and
                            str(Path(os.environ["OUT"]) / "dual_generate_hlo.txt"))
    if hlo_path:
        Path(hlo_path).write_text(hlo)
    min_bytes = min(a.nbytes for a in jax.tree.leaves(params) if a.ndim == 2)
    report = weight_sized_moves(hlo, min_bytes)
    results["moves"] = {
        "min_bytes": int(min_bytes),
        "loop_depth": report.loop_depth,
        "by_loop_depth": {str(d): n for d, n in report.by_depth().items()},
        "per_step": report.count(report.loop_depth) if report.loop_depth else 0,
        "outside_loops": report.count(0),
        "listed": [f"depth {m.depth}: {m.opcode} {m.type} ({m.name})" for m in report.moves],
    }
    results["weight_bytes_gb"] = 2 * cfg.n_params / 1e9
    results["weight_floor_ms"] = 2 * cfg.n_params / ceil["copy_tb_per_s"] / 1e9
    results["ceilings"] = ceil
    path = write_result("profile_step", {"B": B, "T": T, "block": bl,
                                         "config": "tiny" if args.tiny else "llada_8b",
                                         "n_layers": cfg.n_layers, **results})
    for k, v in results.items():
        if k != "moves":
            print(f"{k}: {v}")
    moves = results["moves"]
    print(f"moves of >= {min_bytes} bytes by while-loop depth (0 outside, "
          f"{report.loop_depth} per step): {moves['by_loop_depth']}")
    for line in moves["listed"][:40]:
        print("  ", line)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
