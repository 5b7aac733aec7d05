"""Probe (issue 23): the full canvas's attention at LLaDA-8B heads, cuDNN with the model's
[B, 1, L, S] mask against no mask, key lengths, and XLA; device time per call."""
import jax
import jax.numpy as jnp
from benchmarks.common import device_chained
H, K = 32, 128
for B, L in ((1, 768), (1, 1280), (8, 768)):
    ks = jax.random.split(jax.random.key(L + B), 3)
    q, k, v = (jax.random.normal(x, (B, L, H, K), jnp.bfloat16) for x in ks)
    mask = jnp.broadcast_to(jnp.ones((B, L), bool)[:, None, None, :], (B, 1, L, L))
    lens = jnp.full((B,), L, jnp.int32)
    sc = K ** -0.5
    fns = {
        "cudnn_mask": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=sc, implementation="cudnn"),
        "cudnn_nomask": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=sc, implementation="cudnn"),
        "cudnn_kvlens": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=sc, implementation="cudnn", query_seq_lengths=lens,
            key_value_seq_lengths=lens),
        "xla_mask": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=sc, implementation="xla"),
    }
    ref = fns["xla_mask"](q, k, v).astype(jnp.float32)
    for name, fn in fns.items():
        try:
            d = device_chained(fn, q, k, v, n=20)
            err = float(jnp.max(jnp.abs(jax.jit(fn)(q, k, v).astype(jnp.float32) - ref)))
            print(f"B{B} L{L} {name:14s} kernels {d['kernels_ms']*1e3:7.1f} us span "
                  f"{d['span_ms']*1e3:7.1f} us  largest {d['largest']}  maxerr {err:.3g}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"B{B} L{L} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
