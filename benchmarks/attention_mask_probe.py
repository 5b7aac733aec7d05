"""A full canvas's attention at LLaDA-8B's heads (H 32, K 128, bf16) as the layers call it:
cuDNN with the all-True [B, 1, L, S] mask the model passed every layer before
`Canvas.keeps_all` (cuDNN adds a mask as a bias), cuDNN without a mask (what an unpadded batch
runs now), cuDNN with key lengths (its padding mask) and XLA's with the mask (issues 20, 23).

    python -m benchmarks.attention_mask_probe [--shapes 1:768,1:1280,8:768]

Per call: the device's kernel time (`device_chained`) against the FLOP floor (4 B L S H K at
the bf16 matmul rate measured in the same run), and the largest difference from XLA's
output. On a CPU the cuDNN rows report cuDNN's absence: a check of the script only.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import device_chained, exit_on_sigterm, measure_ceilings, write_result

H, K = 32, 128


def variants(B: int, L: int) -> dict:
    mask = jnp.broadcast_to(jnp.ones((B, L), bool)[:, None, None, :], (B, 1, L, L))
    lens = jnp.full((B,), L, jnp.int32)

    def attend(impl, **kw):
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=K ** -0.5, implementation=impl, **kw)

    return {"cudnn_mask": attend("cudnn", mask=mask), "cudnn_nomask": attend("cudnn"),
            "cudnn_kvlens": attend("cudnn", query_seq_lengths=lens, key_value_seq_lengths=lens),
            "xla_mask": attend("xla", mask=mask)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1:768,1:1280,8:768", help="B:L,... (L = S)")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    ceil = measure_ceilings()
    rows = []
    for shape in args.shapes.split(","):
        B, L = map(int, shape.split(":"))
        q, k, v = (jax.random.normal(x, (B, L, H, K), jnp.bfloat16)
                   for x in jax.random.split(jax.random.key(L + B), 3))
        fns = variants(B, L)
        ref = jax.jit(fns["xla_mask"])(q, k, v).astype(jnp.float32)
        floor_us = 4 * B * L * L * H * K / ceil["bf16_matmul_tflops"] / 1e6
        for name, fn in fns.items():
            row = {"B": B, "L": L, "variant": name, "floor_us": floor_us}
            try:
                d = device_chained(fn, q, k, v, n=20)
                out = jax.jit(fn)(q, k, v).astype(jnp.float32)
                row.update(kernels_us=d["kernels_ms"] * 1e3, span_us=d["span_ms"] * 1e3,
                           x_floor=d["kernels_ms"] * 1e3 / floor_us,
                           max_diff_vs_xla=float(jnp.max(jnp.abs(out - ref))))
                print(f"B{B} L{L} {name:13s} kernels {row['kernels_us']:7.1f} us (x"
                      f"{row['x_floor']:.2f} of {floor_us:.1f}) span {row['span_us']:7.1f} us  "
                      f"max diff {row['max_diff_vs_xla']:.3g}", flush=True)
            except Exception as e:  # noqa: BLE001 (cuDNN absent on a CPU)
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"B{B} L{L} {name:13s} {row['error']}", flush=True)
            rows.append(row)
    print(f"ceilings: bf16 matmul {ceil['bf16_matmul_tflops']:.0f} TFLOP/s -> "
          f"{write_result('attention_mask', {'ceilings': ceil, 'rows': rows})}")


if __name__ == "__main__":
    main()
