"""A few query rows' attention over a whole canvas (a dual-cache step's block) at LLaDA-8B's
heads (H 32, K 128, bf16): `model.attention` forced to cuDNN and to XLA's attention, and the
split-keys kernel (kernels/short_attention.py) at its default shares, its key shares' states
merged by XLA after it (`split`) and by the last share in it (`split_merged`), and at each of
--splits (on a CPU the model's attention is XLA's under both names: a check of the script
only).

    python -m benchmarks.short_attention [--shapes 1:32:768,8:32:768,1:128:768]
        [--splits 4,8,12]

Per call: the chained wall time (`time_chained`) and the device's own time (`device_chained`:
span and kernels), against the byte floor (q, k, v read, out written, at the copy bandwidth
measured in the same run), and each one's relative error against the fp32 dense reference.
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp

from benchmarks.common import (device_chained, exit_on_sigterm, measure_ceilings, rel_l2,
                               time_chained, write_result)
from kernels.short_attention import short_attention_pallas, short_attention_ref
from lacache_jax import model

H, K = 32, 128
# The model's attention with its choice forced while tracing (the chained programs trace
# inside the block)
FORCED = {"cudnn": lambda: model.short_attention_implementation("cudnn"),
          "xla": lambda: model.attention_implementation("xla")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1:32:768,8:32:768,1:32:1280,1:128:768,1:256:768",
                    help="B:L:S,... (batch, query rows, keys; a shape `takes` refuses times "
                         "the kernel where the step runs cuDNN)")
    ap.add_argument("--splits", default="4,8,12",
                    help="key shares per (batch, head, 64-row tile) also timed")
    args = ap.parse_args()
    exit_on_sigterm()
    ceil = measure_ceilings()
    rows = []
    try:
        for shape in args.shapes.split(","):
            B, L, S = map(int, shape.split(":"))
            ks = jax.random.split(jax.random.key(S + B), 3)
            q = jax.random.normal(ks[0], (B, L, H, K), jnp.bfloat16)
            k = jax.random.normal(ks[1], (B, S, H, K), jnp.bfloat16)
            v = jax.random.normal(ks[2], (B, S, H, K), jnp.bfloat16)
            mask = jnp.arange(S)[None, :] < S - 7 * jnp.arange(1, B + 1)[:, None]
            ref = short_attention_ref(q.astype(jnp.float32), k, v, mask)
            floor_ms = 2 * (2 * B * L * H * K + 2 * B * S * H * K) / ceil["copy_tb_per_s"] / 1e9
            fns = {name: (lambda q, k, v: model.attention(q, k, v, mask)) for name in FORCED}
            fns["split"] = lambda q, k, v: short_attention_pallas(q, k, v, mask, merge="xla")
            fns["split_merged"] = lambda q, k, v: short_attention_pallas(q, k, v, mask,
                                                                         merge="kernel")
            for n in map(int, args.splits.split(",")):
                fns[f"split{n}"] = (lambda q, k, v, n=n:
                                    short_attention_pallas(q, k, v, mask, splits=n))
            for name, fn in fns.items():
                try:
                    with FORCED.get(name, contextlib.nullcontext)():
                        out = fn(q, k, v)
                        t = time_chained(fn, q, k, v)
                        d = device_chained(fn, q, k, v)
                except Exception as e:  # noqa: BLE001 - a refused kernel is a result too
                    row = dict(B=B, L=L, S=S, kernel=name, error=str(e).splitlines()[0][:300])
                else:
                    row = dict(B=B, L=L, S=S, kernel=name, ms=t["median_ms"],
                               device_span_ms=d["span_ms"], device_kernels_ms=d["kernels_ms"],
                               floor_ms=floor_ms, x_floor=d["span_ms"] / floor_ms,
                               rel_err=rel_l2(out, ref))
                rows.append(row)
                print({k2: round(x, 5) if isinstance(x, float) else x for k2, x in row.items()},
                      flush=True)
    finally:
        print("->", write_result("short_attention", {"ceilings": ceil, "rows": rows}))


if __name__ == "__main__":
    main()
