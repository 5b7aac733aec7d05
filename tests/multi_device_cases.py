"""Run by tests/test_multi_device.py in a fresh process with 4 fake CPU devices (XLA_FLAGS
must be set before JAX starts). Prints one JSON line per case:

- tokens: each setting on several meshes against the single-device run (`same`);
- slot refill over the data axis: tokens, NFE and steps of the single-device run without
  slots; the compiled program's slots split by row, its collectives per-row sized;
- the split-keys block attention (a Pallas call) run per device on its shard under a mesh;
- the FP8 FFN under tensor parallelism: weights split per device, a model axis that would cut
  a 128 x 128 scale block refused;
- HLO: the optimised batch-1 dual-cache generate program on a 2-way model axis, bf16 and FP8
  FFN: its weight-sized moves (benchmarks/hlo_moves.py) by loop depth and opcode (for FP8
  against the one-device program's), and collectives as large as a weight shard; plus a
  control with a deliberately mismatched FP8 placement, which the same counts must catch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

import lacache_jax as lj
from benchmarks.hlo_moves import COLLECTIVE_OPS, weight_sized_moves
from lacache_jax import cache, quant, sharding, slots

# head_dim 16; d_model and d_ff multiples of 128 for the FP8 FFN; 8 / 4 heads split 4 ways.
# d_ff 256 splits the FP8 FFN 2 ways on 128 x 128 blocks, not 4 ways.
CFG = lj.tiny(d_model=128, n_heads=8, n_kv_heads=4, d_ff=256, n_layers=2)
MESHES = {"data4": (4, 1), "model4": (1, 4), "data2_model2": (2, 2)}
FP8_MESHES = {"data4": (4, 1), "model2": (1, 2), "data2_model2": (2, 2)}
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [3, 4, 5, 6, 7], [8]]  # 5 rows: padded to 8
# The HLO cases: batch 1, prompt 8, gen 8, so a full-canvas step's FFN activation on one of
# 2 model shards ([1, 16, 512] f32, 32 KiB) stays below the smallest weight shard (FP8 down
# [256, 512] over 2 devices: 64 KiB); on one device both double.
HLO_CFG = lj.tiny(d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, n_layers=2)


def emit(**case) -> None:
    print(json.dumps(case), flush=True)


def mesh_of(d: int, m: int) -> jax.sharding.Mesh:
    return lj.make_mesh(d, m, devices=jax.devices()[:d * m])


def sharp(params):
    # Sharper logits than init, so tokens are decided by clear margins: a sharded matmul sums
    # in another order (fp32 rounding ~1e-7), which must not flip near-ties.
    return jax.tree.map(lambda a: a * 2.5 if a.ndim == 2 else a, params)


def same_run(out, ref) -> bool:
    return bool(np.array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
                and np.array_equal(np.asarray(out.nfe), np.asarray(ref.nfe)))


def token_cases(params, fp8_params) -> None:
    flash = lj.FlashConfig(window=4, lookahead=2, track=3)
    settings = {f"cache_{c}": dict(cache=c) for c in ("none", "exact", "prefix", "dual")}
    settings["threshold_dual"] = dict(cache="dual", threshold=0.5)
    settings["flash"] = dict(threshold=0.5, flash=flash)
    settings["fp8_ffn_exact"] = dict(cache="exact", fp8_ffn=True)
    settings["fp8_ffn_dual"] = dict(cache="dual", fp8_ffn=True)
    settings["flash_fp8"] = dict(threshold=0.5, flash=flash, fp8_ffn=True)
    # DPad's compact canvas (gathered and scattered columns) under the row and head shardings
    settings["dpad_exact"] = dict(cache="exact", dpad=lj.DPadConfig(strategy="uniform",
                                                                      window=4, keep=2))
    for name, kw in settings.items():
        fp8 = kw.get("fp8_ffn", False)
        p = fp8_params if fp8 else params
        blocks = {} if "flash" in kw else dict(block_length=4, steps=8)
        gen = lj.GenerationConfig(gen_length=8, **blocks, **kw)
        ref = lj.generate(p, CFG, PROMPTS, gen, key=jax.random.key(1))
        # The dual FP8 FFN's data-parallel path is the exact one's: not run twice.
        meshes = {k: v for k, v in (FP8_MESHES if fp8 else MESHES).items()
                  if not (name == "fp8_ffn_dual" and k == "data4")}
        for mesh_name, (d, m) in meshes.items():
            out = lj.generate(p, CFG, PROMPTS, gen, key=jax.random.key(1), mesh=mesh_of(d, m))
            emit(case=f"{name}/{mesh_name}", setting=name, same=same_run(out, ref))


def slots_cases(params, fp8_params) -> None:
    # 5 prompts through 3 slots: 4 on a 2- or 4-way data axis (rounded up), so rows refill
    settings = {"dual": dict(cache="dual"), "prefix": dict(cache="prefix"),
                "exact_threshold_fp8_eos": dict(cache="exact", threshold=0.5, fp8_ffn=True,
                                                stop_at_eos=True)}
    for name, kw in settings.items():
        p = fp8_params if kw.get("fp8_ffn") else params
        gen = lj.GenerationConfig(gen_length=8, block_length=4, steps=8, **kw)
        ref = lj.generate(p, CFG, PROMPTS, gen, key=jax.random.key(1))
        for mesh_name, (d, m) in (("data2_model2", (2, 2)), ("data4", (4, 1))):
            out = lj.generate(p, CFG, PROMPTS, gen, key=jax.random.key(1), mesh=mesh_of(d, m),
                              slots=3)
            emit(case=f"slots/{name}/{mesh_name}", slots_same=same_slots(out, ref))
    # Many program calls: a queue of 2 prompts and prompts over buckets 8, 16 and 32, so the
    # host narrows the slots (read back, re-placed) and calls compiled programs again.
    # The FACache kernel is counted as it traces: it must see the mesh (`shard_kernel`).
    gen = lj.GenerationConfig(gen_length=8, block_length=4, steps=8, cache="exact")
    ragged = [list(range(3, 3 + n)) for n in (30, 1, 9, 17, 3, 12, 20, 2, 5)]
    ref = lj.generate(params, CFG, ragged, gen, key=jax.random.key(2))
    seen, real_queue, real_kernel = [], slots.queue_size, cache.shard_kernel

    def spy_kernel(*args, **kw):
        seen.append(sharding.active_mesh() is not None)
        return real_kernel(*args, **kw)
    slots.queue_size, cache.shard_kernel = (lambda B: 2), spy_kernel
    jax.clear_caches()
    try:
        mesh = mesh_of(2, 2)
        out = lj.generate(params, CFG, ragged, gen, key=jax.random.key(2), mesh=mesh, slots=3)
        aot = lj.compile_generate(params, CFG, ragged, gen, key=jax.random.key(2), mesh=mesh,
                                  slots=3)
        emit(case="slots_calls", slots_same=same_slots(out, ref) and same_slots(aot(), ref),
             buckets=sorted(aot.programs), kernel_traces=len(seen), kernel_saw_mesh=all(seen))
    finally:
        slots.queue_size, cache.shard_kernel = real_queue, real_kernel
    gen = lj.GenerationConfig(gen_length=8, block_length=4, steps=8, cache="dual")
    run = lj.compile_generate(params, CFG, PROMPTS, gen, key=jax.random.key(1),
                              mesh=mesh_of(2, 2), slots=3)
    (_, sl, q, *_), _ = run.compiled.input_shardings
    hlo = run.compiled.as_text()
    # Every result of every all-gather (tuple results included), in elements per device
    gathers = [math.prod(int(n) for n in shape.split(",") if n)
               for result in re.findall(r"= (.*?) all-gather(?:-start)?\(", hlo)
               for shape in re.findall(r"\w+\[([\d,]*)\]", result)]
    # f32 all-reduces of [rows, L, D] activations over the model axis: rows per device
    rows = sorted({int(r) for r in re.findall(r"= f32\[(\d+),\d+,%d\][^ ]* all-reduce"
                                               % CFG.d_model, hlo)})
    emit(case="slots_program", slot_spec=str(sl.x_BT.spec), queue_spec=str(q.prompt_UP.spec),
         max_gather=max(gathers, default=0), activation_rows=rows)


def same_slots(out, ref) -> bool:
    return same_run(out, ref) and bool(np.array_equal(np.asarray(out.steps),
                                                      np.asarray(ref.steps)))


def fp8_layout_cases(params, fp8_params) -> None:
    # Each device holds 1/model of every FP8 FFN array (held before: the whole of them).
    for d, m in ((1, 2), (2, 2)):
        placed = sharding.shard_params(fp8_params, CFG, mesh_of(d, m))
        full = sum(a.nbytes for a in jax.tree.leaves(fp8_params.layers[1].ffn8))
        held = sharding.bytes_per_device(placed.layers[1].ffn8)
        emit(case=f"fp8_split/data{d}_model{m}", full=full, devices=len(held),
             per_device=sorted(set(held.values())))
    # d_ff 256 over 4 model shards is 64 columns each: half a scale block.
    gen = lj.GenerationConfig(gen_length=8, block_length=4, steps=8, cache="dual",
                              fp8_ffn=True)
    try:
        lj.generate(fp8_params, CFG, PROMPTS, gen, mesh=mesh_of(1, 4))
        emit(case="fp8_model4_refused", error=None)
    except ValueError as e:
        emit(case="fp8_model4_refused", error=str(e))
    # ... while the bf16 FFN of the same params runs there (FP8 copies dropped unused).
    off = dataclasses.replace(gen, fp8_ffn=False)
    emit(case="fp8_model4_bf16_runs", same=same_run(
        lj.generate(fp8_params, CFG, PROMPTS, off, mesh=mesh_of(1, 4)),
        lj.generate(params, CFG, PROMPTS, off)))


def ffn_cases(params) -> None:
    """The FP8 FFN alone on a 2-way model axis against one device, for each activation
    scaling: the ablation's row and tensor scales span both shards' FFN columns (pmax)."""
    mesh = mesh_of(1, 2)
    x = jax.random.normal(jax.random.key(3), (2, 5, CFG.d_model), jnp.float32)
    for g in ("group", "token", "tensor"):
        p = lj.quantize_ffn(params, granularity=g)
        layer, placed = p.layers[1], sharding.shard_params(p, CFG, mesh).layers[1]
        one = quant.ffn_fp8(x, layer.ff_norm, CFG.norm_eps, layer.ffn8)

        @jax.jit
        def split(x, norm, w):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return quant.ffn_fp8(x, norm, CFG.norm_eps, w)
        out = split(x, placed.ff_norm, placed.ffn8)
        err = float(jnp.abs(out - one).max() / jnp.abs(one).max())
        emit(case=f"ffn_split/{g}", rel_err=err)


def load_case(params, fp8_params) -> None:
    # lj.load(mesh=...) restores straight into the tensor-parallel shardings; generate then
    # lays out and splits the FP8 copies it stored.
    mesh = mesh_of(2, 2)
    with tempfile.TemporaryDirectory() as d:
        lj.save(f"{d}/ck", CFG, fp8_params)  # FP8 FFN copies stored too
        _, loaded = lj.load(f"{d}/ck", mesh=mesh)
    spec = loaded.layers[0].w_qkv.sharding.spec
    gen = lj.GenerationConfig(gen_length=8, block_length=4, steps=8, cache="dual")
    same = np.array_equal(
        np.asarray(lj.generate(loaded, CFG, PROMPTS, gen, mesh=mesh).tokens),
        np.asarray(lj.generate(params, CFG, PROMPTS, gen).tokens))
    g8 = dataclasses.replace(gen, fp8_ffn=True)
    same8 = same_run(lj.generate(loaded, CFG, PROMPTS, g8, mesh=mesh),
                     lj.generate(fp8_params, CFG, PROMPTS, g8))
    placed = sharding.shard_params(loaded, CFG, mesh)
    fp8_split = all(not a.sharding.is_fully_replicated
                    for a in jax.tree.leaves(placed.layers[1].ffn8))
    emit(case="load_sharded", same=bool(same and same8 and fp8_split),
         w_qkv_spec=[str(s) for s in spec],
         embed_replicated=loaded.embed.sharding.is_fully_replicated)
    try:  # 4 model shards cannot split 2 KV heads
        lj.generate(lj.init_params(lj.tiny(n_kv_heads=2), jax.random.key(0)),
                    lj.tiny(n_kv_heads=2), PROMPTS, gen, mesh=mesh_of(1, 4))
        emit(case="bad_mesh", same=False)
    except ValueError as e:
        emit(case="bad_mesh", same="n_kv_heads=2" in str(e))


def smallest_weight(params, mesh=None) -> int:
    """Bytes of the smallest weight matrix the program streams (FP8 block scales are not
    matrices), per device under `mesh`."""
    if mesh is not None:
        params = sharding.shard_params(params, HLO_CFG, mesh)
    return min(a.addressable_shards[0].data.nbytes
               for path, a in jax.tree_util.tree_leaves_with_path(params)
               if a.ndim == 2 and "scale" not in jax.tree_util.keystr(path))


def hlo_report(params, gen, mesh):
    """(weight-sized moves as sorted [depth, opcode], weight-sized collectives as [depth,
    opcode, type], tokens) of the compiled generate program."""
    streamed = params if gen.fp8_ffn else dataclasses.replace(params, layers=[
        dataclasses.replace(layer, ffn8=None) for layer in params.layers])
    run = lj.compile_generate(params, HLO_CFG, [[5, 6, 7, 8, 9, 10, 11, 12]], gen,
                              key=jax.random.key(1), mesh=mesh)
    hlo, min_bytes = run.compiled.as_text(), smallest_weight(streamed, mesh)
    moves = sorted([m.depth, m.opcode] for m in weight_sized_moves(hlo, min_bytes).moves)
    colls = [[m.depth, m.opcode, m.type]
             for m in weight_sized_moves(hlo, min_bytes, COLLECTIVE_OPS).moves]
    return moves, colls, np.asarray(run().tokens).tolist()


def hlo_cases() -> None:
    params = lj.quantize_ffn(sharp(lj.init_params(HLO_CFG, jax.random.key(2), jnp.float32)))
    tp = mesh_of(1, 2)
    for ffn in ("bf16", "fp8"):
        gen = lj.GenerationConfig(gen_length=8, block_length=4, steps=8, cache="dual",
                                  fp8_ffn=ffn == "fp8")
        moves, colls, tokens = hlo_report(params, gen, tp)
        case = dict(moves=moves, collectives=colls)
        if ffn == "fp8":
            # On the CPU the FP8 GEMM is the reference, which widens the FP8 weights to f32
            # (the GPU kernels read them as they are): the one-device program has those moves
            # too, and the tensor-parallel one must add none.
            one_moves, one_colls, one_tokens = hlo_report(params, gen, None)
            case.update(one_device_moves=one_moves, one_device_collectives=one_colls,
                        same=tokens == one_tokens)
        emit(case=f"hlo/{ffn}", **case)
    # Control: FP8 down split by its rows instead of its K columns, against what the kernel's
    # shard_map asks for: the partitioner must move it, and the count above must see that.
    real = sharding.param_shardings

    def mismatched(p, mesh):
        placed = real(p, mesh)
        down = NamedSharding(mesh, PS(sharding.MODEL, None))
        return dataclasses.replace(placed, layers=[
            lay if lay.ffn8 is None else dataclasses.replace(
                lay, ffn8=dataclasses.replace(lay.ffn8, down=down)) for lay in placed.layers])
    sharding.param_shardings = mismatched
    try:
        moves, colls, _ = hlo_report(params, gen, tp)
    finally:
        sharding.param_shardings = real
    emit(case="hlo_control/fp8_down_by_rows", moves=moves, collectives=colls)


def benchmark_case() -> None:
    """benchmarks/multi_gpu.py --tiny, tensor parallel with the FP8 FFN on 2 devices (its
    result file goes to $OUT, which the test points at a temporary directory)."""
    from benchmarks import multi_gpu
    path = multi_gpu.main(["--tiny", "--gpus", "2", "--batch", "none", "--tp", "dual+fp8",
                           "--iters", "1", "--hlo"])
    rows = json.loads(path.read_text())["rows"]
    cfg = lj.tiny(**multi_gpu.TINY)
    params = lj.quantize_ffn(lj.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    # What each of 2 devices should hold: half of every matrix (FP8 copies and their
    # scales included), the whole embedding and norms (replicated).
    split = sum(a.nbytes // 2 if a.ndim == 2 else a.nbytes for a in jax.tree.leaves(params))
    emit(case="benchmark_tiny", rows=[{k: r[k] for k in (
        "gpus", "setting", "weight_gb_per_gpu", "streamed_gb_per_gpu", "ms_per_step")}
        | {"collectives": r["hlo"]["collectives"]} for r in rows],
        expected_bytes_per_gpu=split + params.embed.nbytes // 2)


def short_attention_case() -> None:
    # The split-keys block attention is a Pallas call, which XLA does not partition: under a
    # mesh `model.attention` runs it per device on its (rows, heads) shard. Forced here as on
    # a GPU in bf16, the kernel interpreted; against the dense reference.
    import functools

    from kernels import short_attention
    from lacache_jax import model
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (4, 8, 8, 16))
    k, v = (jax.random.normal(x, (4, 96, 4, 16)) for x in ks[1:])
    mask = jnp.arange(96)[None, :] >= jnp.array([0, 5, 0, 40])[:, None]
    shapes = []
    real_impl, real_kernel = model._attention_impl, short_attention.short_attention_pallas

    def spy_kernel(q, *rest):
        shapes.append(list(q.shape))
        return functools.partial(real_kernel, interpret=True)(q, *rest)
    model._attention_impl = lambda dtype: "cudnn"
    short_attention.short_attention_pallas = spy_kernel
    try:
        with jax.set_mesh(mesh_of(2, 2)):
            out = jax.jit(model.attention)(q, k, v, mask)
    finally:
        model._attention_impl, short_attention.short_attention_pallas = real_impl, real_kernel
    ref = short_attention.short_attention_ref(q, k, v, mask)
    emit(case="short_attention_mesh", shard_shapes=shapes,
         close=bool(np.allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)))


def dispatch_rows_case() -> None:
    # Kernels pick by the rows each device runs: batch 8 over 2 data shards is 4 per device;
    # the split-keys attention by its shard too (batch 2 x 32 heads of 256 rows over data 2 x
    # model 2: one row x 16 heads a device, which it takes; the whole array it would not).
    from kernels import short_attention
    from lacache_jax import model
    q, k = jnp.zeros((2, 256, 32, 16)), jnp.zeros((2, 768, 32, 16))
    with jax.set_mesh(mesh_of(2, 2)):
        per_mesh = sharding.per_data_shard(8)
        heads = sharding.per_shard(32, sharding.MODEL)
        takes_shard = short_attention.takes(model._per_device(q), model._per_device(k))
    emit(case="per_data_shard", rows=[sharding.per_data_shard(8), per_mesh], heads=heads,
         takes=[short_attention.takes(model._per_device(q), model._per_device(k)),
                takes_shard])


def main() -> None:
    assert len(jax.devices()) == 4, jax.devices()
    dispatch_rows_case()
    short_attention_case()
    params = sharp(lj.init_params(CFG, jax.random.key(0), jnp.float32))
    fp8_params = lj.quantize_ffn(params)
    token_cases(params, fp8_params)
    slots_cases(params, fp8_params)
    fp8_layout_cases(params, fp8_params)
    ffn_cases(params)
    load_case(params, fp8_params)
    hlo_cases()
    benchmark_case()


if __name__ == "__main__":
    sys.exit(main())
