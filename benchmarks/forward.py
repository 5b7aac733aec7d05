"""Full bidirectional forward of LLaDA-8B (random bf16 weights built on the device).

    python -m benchmarks.forward [--shapes 1x512,1x2048,8x512] [--layers N]

Reports ms, achieved TFLOP/s and the fraction of the measured bf16 matmul peak; the floor is
max(FLOPs / peak, weight bytes / copy bandwidth).
"""

from __future__ import annotations

import argparse

import jax

import lacache_jax as lj
from benchmarks.common import (REFERENCE_CEILINGS, floor_ms, llada_8b_setup, time_fn,
                               write_result)


def forward_flops(cfg: lj.ModelConfig, B: int, L: int) -> float:
    """Matmul FLOPs of one full pass (2 per multiply-add) incl. attention and the LM head."""
    D, F, K = cfg.d_model, cfg.d_ff, cfg.head_dim
    proj = D * K * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * D * F
    attn = 2 * L * cfg.n_heads * K  # QK^T and PV per query token
    return 2.0 * B * L * (cfg.n_layers * (proj + attn) + D * cfg.vocab_size)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x512,1x2048,8x512")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (quick checks)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    cfg, ceil, params = llada_8b_setup(args.layers)
    weight_bytes = 2 * cfg.n_params
    rows = []
    for shape in args.shapes.split(","):
        B, L = map(int, shape.split("x"))
        tokens = jax.random.randint(jax.random.key(B * L), (B, L), 0, cfg.vocab_size)
        t = time_fn(lambda tok: lj.forward(params, cfg, tok), tokens, iters=args.iters)
        flops = forward_flops(cfg, B, L)
        floor = floor_ms(flops, weight_bytes, ceil)
        tflops = flops / t["median_ms"] / 1e9
        rows.append({"B": B, "L": L, **t, "tflop": flops / 1e12, "tflops": tflops,
                     "frac_of_peak": tflops / ceil["bf16_matmul_tflops"],
                     "frac_of_ref_peak": tflops / REFERENCE_CEILINGS["bf16_matmul_tflops"],
                     "floor_ms": floor, "x_floor": t["median_ms"] / floor})
    path = write_result("forward", {"config": cfg.to_dict(), "ceilings": ceil, "rows": rows})
    print(f"ceilings: bf16 matmul {ceil['bf16_matmul_tflops']:.0f} TFLOP/s, "
          f"copy {ceil['copy_tb_per_s']:.2f} TB/s; n_layers {cfg.n_layers}; -> {path}")
    print("| B | L | ms (median) | TFLOP/s | of measured peak | of 790 | floor ms | × floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['L']} | {r['median_ms']:.2f} | {r['tflops']:.0f} | "
              f"{100 * r['frac_of_peak']:.0f}% | {100 * r['frac_of_ref_peak']:.0f}% | "
              f"{r['floor_ms']:.2f} | {r['x_floor']:.2f} |")


if __name__ == "__main__":
    main()
