"""Generation on several GPUs of one host (random LLaDA-8B bf16 weights, prompt 512, gen 256,
block 32, dual cache, threshold 0.9):

    python -m benchmarks.multi_gpu [--gpus 1,2,4] [--batch 32,64] [--tp dual,dual+fp8,exact]
                                   [--hlo] [--tiny]

- data parallel: each batch split over 1, 2, 4 GPUs (mesh data=n, model=1): tokens/s;
- tensor parallel: batch 1 over 1, 2, 4 GPUs (mesh data=1, model=n): ms per step, for each
  `--tp` setting (`dual`: the dual cache with threshold 0.9; `+fp8`: FP8 FFN, its FP8 copies
  split over the GPUs like the bf16 FFN; `exact`: LaCache with the fixed schedule).
Tokens are compared with the one-GPU run of the same case. Every row reports the weight bytes
each GPU holds (`weight_gb_per_gpu`: what the program is given; with FP8 the bf16 FFN stays
too) and streams per step (`streamed_gb_per_gpu`: FP8 in place of the bf16 FFN where it runs).
`--hlo` compiles each tensor-parallel case once more for its optimised HLO and lists weight-
sized moves by loop depth and collectives as large as a weight shard (benchmarks/hlo_moves.py).
On GPUs both lists should be empty: the only collectives that belong are activation
all-reduces. On the CPU the moves list XLA's f32 copies of bf16 weights and the FP8 reference
GEMM's widened weights, the same as on one device.
`--tiny` runs `lj.tiny` shapes (prompt 16, gen 16, block 8) so the script can be checked on
fake CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m benchmarks.multi_gpu --tiny --gpus 1,2 --batch 2 --tp dual,dual+fp8 --hlo
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import lacache_jax as lj
from benchmarks.common import exit_on_sigterm, llada_8b_setup, measure_ceilings, write_result
from benchmarks.generate import run_one
from benchmarks.hlo_moves import COLLECTIVE_OPS, weight_sized_moves
from lacache_jax import sharding

# d_ff 512: the FP8 FFN splits on 128 x 128 blocks over up to 4 fake devices.
TINY = dict(d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, n_layers=2)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="1,2,4")
    ap.add_argument("--batch", default="32",
                    help="comma-separated data-parallel batches ('none': skip)")
    ap.add_argument("--tp", default="dual",
                    help="comma-separated tensor-parallel settings ('none': skip)")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--hlo", action="store_true",
                    help="weight-sized moves and collectives of each tensor-parallel program")
    ap.add_argument("--tiny", action="store_true", help="lj.tiny shapes (CPU fake devices)")
    args = ap.parse_args(argv)
    if args.tiny:
        cfg = lj.tiny(**TINY)
        ceil, params = measure_ceilings(), lj.init_params(cfg, jax.random.key(0), jnp.bfloat16)
        P, n_gen, block = 16, 16, 8
    else:
        cfg, ceil, params = llada_8b_setup()
        P, n_gen, block = 512, 256, 32
    gen = lj.GenerationConfig(gen_length=n_gen, block_length=block, steps=n_gen, cache="dual",
                              threshold=0.9, stop_at_eos=False)
    tp = {"dual": gen, "dual+fp8": dataclasses.replace(gen, fp8_ffn=True),
          "exact": dataclasses.replace(gen, cache="exact", threshold=None)}
    if unknown := [n for n in args.tp.split(",") if n not in (*tp, "none")]:
        ap.error(f"--tp: unknown settings {unknown}; choose from {sorted(tp)}")
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
                # Laid out and placed once here: generate finds them so and moves nothing.
                placed = sharding.shard_params(used_params(params, g), cfg, mesh)
                r, tokens = run_one(placed, cfg, ceil, g, B, P, args.iters, mesh)
                ref.setdefault((kind, B, name), tokens)
                r.update(parallel=kind, gpus=n, B=B, setting=name,
                         same_tokens_as_1_gpu=float(np.mean(tokens == ref[kind, B, name])),
                         **weight_bytes(placed))
                if args.hlo and kind == "model":
                    r["hlo"] = hlo_report(placed, cfg, g, P, mesh)
                rows.append(r)
                print(f"{kind:5s} x{n}: B={B} {name:8s} {r['tokens_per_s']:8.1f} tokens/s "
                      f"{r['ms_per_step']:6.2f} ms/step, compile {r['compile_s']:.0f} s, same "
                      f"tokens {r['same_tokens_as_1_gpu']:.3f}, weights per GPU "
                      f"{r['weight_gb_per_gpu']:.4g} GB held, {r['streamed_gb_per_gpu']:.4g} "
                      f"GB streamed", flush=True)
                if "hlo" in r:
                    print(f"      HLO: weight-sized moves by loop depth "
                          f"{r['hlo']['moves_by_depth']}, weight-sized collectives "
                          f"{r['hlo']['collectives']}", flush=True)
    finally:
        path = write_result("multi_gpu", {"config": cfg.to_dict(), "rows": rows})
        print(f"-> {path}")
    return path


def used_params(params, gen):
    """The params generate keeps for `gen` (it drops FP8 copies unless `fp8_ffn`)."""
    if gen.fp8_ffn:
        return params
    return dataclasses.replace(params, layers=[dataclasses.replace(layer, ffn8=None)
                                               for layer in params.layers])


def streamed(params):
    """The weights a step reads: where a layer runs the FP8 FFN, its bf16 FFN stays unread."""
    return dataclasses.replace(params, layers=[
        layer if layer.ffn8 is None else dataclasses.replace(layer, w_gate_up=None, w_down=None)
        for layer in params.layers])


def weight_bytes(placed) -> dict:
    """GB held and streamed per step by the busiest device (all equal when the mesh splits
    every axis evenly)."""
    held = sharding.bytes_per_device(placed)
    read = sharding.bytes_per_device(streamed(placed))
    return {"weight_gb_per_gpu": max(held.values()) / 1e9,
            "streamed_gb_per_gpu": max(read.values()) / 1e9}


def hlo_report(placed, cfg, gen, P: int, mesh) -> dict:
    """Weight-sized moves and collectives of the batch-1 generate program on `mesh`, the
    threshold its smallest per-device weight matrix (FP8 block scales are not matrices)."""
    run = lj.compile_generate(placed, cfg, np.ones((1, P), np.int32), gen, mesh=mesh)
    hlo = run.compiled.as_text()
    min_bytes = min(a.addressable_shards[0].data.nbytes
                    for path, a in jax.tree_util.tree_leaves_with_path(streamed(placed))
                    if a.ndim == 2 and "scale" not in jax.tree_util.keystr(path))
    moves = weight_sized_moves(hlo, min_bytes)
    colls = weight_sized_moves(hlo, min_bytes, COLLECTIVE_OPS)
    return {"min_bytes": int(min_bytes),
            "moves_by_depth": {str(d): n for d, n in moves.by_depth().items()},
            "moves": [f"depth {m.depth}: {m.opcode} {m.type}" for m in moves.moves],
            "collectives": [f"depth {m.depth}: {m.opcode} {m.type}" for m in colls.moves]}


if __name__ == "__main__":
    main()
