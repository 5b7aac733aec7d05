"""Where a batch-1 dual-cache step's time goes (LLaDA-8B shape, random bf16 weights).

    python -m benchmarks.profile_step [--batch 1] [--prompt 512] [--gen 256] [--block 32]

Times, each jitted on its own: the weight-streaming matmuls alone (the floor's work), the
model's dual-cache step (block queries against a full-canvas cache, with and without the
key mask), and the whole generate loop per step. The differences say what dominates. The
optimised HLO of the generate program is written for inspection (copies of weights would
show up as `copy` instructions on [4096, ...] operands).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import lacache_jax as lj
from benchmarks.common import llada_8b_setup, time_fn, write_result
from lacache_jax.model import forward_layers, lm_head


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (quick checks)")
    args = ap.parse_args()
    B, bl, T = args.batch, args.block, args.prompt + args.gen
    cfg, ceil, params = llada_8b_setup(args.layers)
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
    tokens = jax.random.randint(key, (B, bl), 0, 126000)
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
    from lacache_jax.generate import _generate, _prepare
    params, gen_r, *gargs = _prepare(params, cfg, prompts, gen, None, None)
    compiled = _generate.lower(params, cfg, gen_r, *gargs).compile()
    loop = time_fn(lambda: compiled(params, *gargs), warmup=1, iters=3)
    results["generate_ms_per_step"] = loop["median_ms"] / args.gen
    hlo = compiled.as_text()
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "dual_generate_hlo.txt").write_text(hlo)
    big_copies = [l.strip()[:160] for l in hlo.splitlines()
                  if re.search(r"= bf16\[(4096|12288|126464),", l) and " copy(" in l]
    results["weight_sized_copies"] = len(big_copies)
    results["weight_bytes_gb"] = 2 * cfg.n_params / 1e9
    results["weight_floor_ms"] = 2 * cfg.n_params / ceil["copy_tb_per_s"] / 1e9
    results["ceilings"] = ceil
    path = write_result("profile_step", {"B": B, "T": T, "block": bl, **results})
    for k, v in results.items():
        print(f"{k}: {v}")
    for line in big_copies[:10]:
        print("  ", line)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
