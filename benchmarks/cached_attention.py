"""FACache kernel time vs full attention at LLaDA's layer-0 shape (B 1, H 32, K 128, bf16).

    python -m benchmarks.cached_attention [--lengths 512,1024,2048,4096] [--block 32]
        [--mgpu 128:2,64:3] [--kernels triton,mgpu]

Times: cuDNN full attention (jax.nn.dot_product_attention); our kernel in full mode (no
caching: the baseline it must match within 1.2x), at each tile size in --tiles; fill mode (full
attention plus writing the cached state) and reuse mode (block in the middle of the canvas and
at its end, as in the last block of generation) at the default tile, with the block's tiles in
one program each (`reuse_*`) and with their keys split (`reuse_split_*`).
The Mosaic GPU kernel (`kernels/cached_attention_mgpu.py`, full and fill only): full mode at
each `block_kv:stages[:probe]` in --mgpu (`mgpu_full_kv*_s*_ms`; a timing probe such as
`no_bias` is left out of the best; a refused or failing setting is
recorded with its error and skipped), fill at the first. TFLOP/s count 4 L^2 H K per call.
`--kernels ...,fa3` also times jax's own FlashAttention-3 Mosaic GPU kernel
(`jax.experimental.pallas.ops.gpu.attention_mgpu`: f16, no masks, one phase) as a yardstick
of the recipe.
Each time is per call with 20 dependent calls in one jitted program (`time_chained`), so host
dispatch (~0.1 ms) does not hide the kernels.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import time_chained, write_result
from kernels.cached_attention import cached_attention_pallas
from kernels.cached_attention_mgpu import cached_attention_mgpu


def mgpu_rows(row, q, k, v, mask, args, tflops):
    """The Mosaic GPU kernel's columns: full at each --mgpu setting, fill at the first."""
    L = q.shape[1]
    settings = [x.split(":") for x in args.mgpu.split(",")]  # block_kv:stages[:probe]
    timed = []  # the settings that compute attention (not timing probes)
    for bk, st, *probe in settings:
        probe = probe[0] if probe else ""
        name = f"mgpu_full_kv{bk}_s{st}" + (f"_{probe}" if probe else "")
        full = jax.jit(lambda q, k, v, bk=int(bk), st=int(st), probe=probe: cached_attention_mgpu(
            q, k, v, mask, 0, args.block, mode="full", block_len=args.block, block_kv=bk,
            stages=st, probe=probe))
        try:
            row[f"{name}_ms"] = time_chained(full, q, k, v)["median_ms"]
            if not probe:
                timed.append(row[f"{name}_ms"])
        except Exception as err:  # a refused setting or a compile failure: record, go on
            row[f"{name}_error"] = str(err).splitlines()[0][:300]
    if timed:
        row["mgpu_full_over_cudnn"] = min(timed) / row["cudnn_ms"]
        row["mgpu_full_tflops"] = tflops(min(timed))
    bk, st = map(int, settings[0][:2])
    for where, s in (("mid", L // 2), ("end", L - args.block)):
        fill = jax.jit(lambda q, k, v, s, e: cached_attention_mgpu(
            q, k, v, mask, s, e, mode="fill", block_len=args.block, block_kv=bk, stages=st))
        try:
            row[f"mgpu_fill_{where}_ms"] = time_chained(fill, q, k, v, s,
                                                        s + args.block)["median_ms"]
        except Exception as err:
            row[f"mgpu_fill_{where}_error"] = str(err).splitlines()[0][:300]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--tiles", default="64,128", help="tile sizes tried in full mode")
    ap.add_argument("--mgpu", default="128:2,64:3",
                    help="the Mosaic GPU kernel's block_kv:stages tried in full mode")
    ap.add_argument("--kernels", default="triton,mgpu")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    H, K = 32, 128
    rows = []
    for L in map(int, args.lengths.split(",")):
        ks = jax.random.split(jax.random.key(L), 3)
        q, k, v = (jax.random.normal(kk, (1, L, H, K), jnp.bfloat16) for kk in ks)
        mask = jnp.ones((1, L), bool)
        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn"))
        row = {"L": L, "cudnn_ms": time_chained(cudnn, q, k, v)["median_ms"]}
        tflops = lambda ms: 4 * L * L * H * K / ms / 1e9
        row["cudnn_tflops"] = tflops(row["cudnn_ms"])
        if "mgpu" in kernels:
            mgpu_rows(row, q, k, v, mask, args, tflops)
        if "fa3" in kernels:  # the recipe's own kernel (f16, no masks, one phase): a yardstick
            from jax.experimental.pallas.ops.gpu import attention_mgpu as fa3
            cfg = fa3.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)
            f16 = [x.astype(jnp.float16) for x in (q, k, v)]
            try:
                row["fa3_ms"] = time_chained(jax.jit(lambda q, k, v: fa3.attention(
                    q, k, v, cfg)), *f16)["median_ms"]
                row["fa3_over_cudnn"] = row["fa3_ms"] / row["cudnn_ms"]
            except Exception as err:
                row["fa3_error"] = str(err).splitlines()[0][:300]
        if "triton" not in kernels:
            rows.append(row)
            print(row, flush=True)
            continue
        for tile in map(int, args.tiles.split(",")):
            full = jax.jit(lambda q, k, v, tile=tile: cached_attention_pallas(
                q, k, v, mask, 0, 0, mode="full", block_q=tile, block_k=tile))
            row[f"full_t{tile}_ms"] = time_chained(full, q, k, v)["median_ms"]
        row["full_over_cudnn"] = min(v for k, v in row.items()
                                     if k.startswith("full_t")) / row["cudnn_ms"]
        for where, s in (("mid", L // 2), ("end", L - args.block)):
            e = s + args.block
            fill = jax.jit(lambda q, k, v, s, e: cached_attention_pallas(
                q, k, v, mask, s, e, mode="fill"))
            _, state = fill(q, k, v, s, e)
            reuse = jax.jit(lambda q, k, v, s, e, st: cached_attention_pallas(
                q, k, v, mask, s, e, st, mode="reuse"))
            row[f"fill_{where}_ms"] = time_chained(fill, q, k, v, s, e)["median_ms"]
            row[f"reuse_{where}_ms"] = time_chained(reuse, q, k, v, s, e,
                                                    state)["median_ms"]
            split = jax.jit(lambda q, k, v, s, e, st: cached_attention_pallas(
                q, k, v, mask, s, e, st, mode="reuse", block_len=args.block))
            row[f"reuse_split_{where}_ms"] = time_chained(split, q, k, v, s, e,
                                                          state)["median_ms"]
        for where in ("mid", "end"):
            best = min(row[f"reuse_{where}_ms"], row[f"reuse_split_{where}_ms"])
            row[f"speedup_reuse_{where}_vs_cudnn"] = row["cudnn_ms"] / best
        rows.append(row)
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
              flush=True)
    path = write_result("cached_attention", {"H": H, "K": K, "block": args.block, "rows": rows})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
