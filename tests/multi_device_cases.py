"""Run by tests/test_multi_device.py in a fresh process with 4 fake CPU devices (XLA_FLAGS
must be set before JAX starts): every case compares tokens on a mesh with the single-device
run and prints one JSON line per case."""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import lacache_jax as lj

# head_dim 16; d_model and d_ff multiples of 128 for the FP8 FFN; 8 / 4 heads split 4 ways.
CFG = lj.tiny(d_model=128, n_heads=8, n_kv_heads=4, d_ff=256, n_layers=2)
MESHES = {"data4": (4, 1), "model4": (1, 4), "data2_model2": (2, 2)}
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [3, 4, 5, 6, 7], [8]]  # 5 rows: padded to 8


def main() -> None:
    assert len(jax.devices()) == 4, jax.devices()
    params = lj.init_params(CFG, jax.random.key(0), jnp.float32)
    # Sharper logits than init, so tokens are decided by clear margins: a sharded matmul sums
    # in another order (fp32 rounding ~1e-7), which must not flip near-ties.
    params = jax.tree.map(lambda a: a * 2.5 if a.ndim == 2 else a, params)
    fp8_params = lj.quantize_ffn(params)
    settings = {f"cache_{c}": dict(cache=c) for c in ("none", "exact", "prefix", "dual")}
    settings["threshold_dual"] = dict(cache="dual", threshold=0.5)
    settings["fp8_ffn_exact"] = dict(cache="exact", fp8_ffn=True)
    flash = lj.FlashConfig(window=4, lookahead=2, track=3)
    settings["flash"] = dict(threshold=0.5, flash=flash)
    settings["flash_fp8"] = dict(threshold=0.5, flash=flash, fp8_ffn=True)
    for name, kw in settings.items():
        p = fp8_params if kw.get("fp8_ffn") else params
        blocks = {} if "flash" in kw else dict(block_length=4, steps=8)
        gen = lj.GenerationConfig(gen_length=8, **blocks, **kw)
        ref = lj.generate(p, CFG, PROMPTS, gen, key=jax.random.key(1))
        for mesh_name, (d, m) in MESHES.items():
            out = lj.generate(p, CFG, PROMPTS, gen, key=jax.random.key(1),
                              mesh=lj.make_mesh(d, m))
            same = bool(np.array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
                        and np.array_equal(np.asarray(out.nfe), np.asarray(ref.nfe)))
            print(json.dumps({"case": f"{name}/{mesh_name}", "same": same}), flush=True)
    # lj.load(mesh=...) restores straight into the tensor-parallel shardings.
    mesh = lj.make_mesh(2, 2)
    with tempfile.TemporaryDirectory() as d:
        lj.save(f"{d}/ck", CFG, fp8_params)  # FP8 FFN copies stored too
        _, loaded = lj.load(f"{d}/ck", mesh=mesh)
    fp8_replicated = all(a.sharding.is_fully_replicated
                         for a in jax.tree.leaves(loaded.layers[1].ffn8))
    spec = loaded.layers[0].w_qkv.sharding.spec
    gen = lj.GenerationConfig(gen_length=8, block_length=4, steps=8, cache="dual")
    same = np.array_equal(
        np.asarray(lj.generate(loaded, CFG, PROMPTS, gen, mesh=mesh).tokens),
        np.asarray(lj.generate(params, CFG, PROMPTS, gen).tokens))
    print(json.dumps({"case": "load_sharded", "same": bool(same and fp8_replicated),
                      "w_qkv_spec": [str(s) for s in spec],
                      "embed_replicated": loaded.embed.sharding.is_fully_replicated}))
    try:  # 4 model shards cannot split 2 KV heads
        lj.make_mesh(1, 4) and lj.generate(
            lj.init_params(lj.tiny(n_kv_heads=2), jax.random.key(0)), lj.tiny(n_kv_heads=2),
            PROMPTS, gen, mesh=lj.make_mesh(1, 4))
        print(json.dumps({"case": "bad_mesh", "same": False}))
    except ValueError as e:
        print(json.dumps({"case": "bad_mesh", "same": "n_kv_heads=2" in str(e)}))


if __name__ == "__main__":
    sys.exit(main())
