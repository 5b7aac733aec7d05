"""Several devices: a `data` x `model` mesh (jax.sharding), parameter and batch shardings.

Batch rows split over `data`. Over `model` (tensor parallel, Megatron-style) the attention and
FFN matrices split by output columns going in (w_qkv, w_gate_up, LM head) and by input rows
going out (wo, w_down); norms and the embedding are replicated. XLA's SPMD partitioner
places the collectives; caches follow the activations. The Pallas kernels are opaque to it, so
`shard_kernel` wraps them in `shard_map` when a mesh is active (`jax.set_mesh`): FACache runs
per (row shard, head shard), the FP8 FFN kernels per (row shard, FFN column shard) with one
all-reduce after the down GEMM, as the partitioner places for the bf16 FFN. Q/K/V and gate/up
are fused column-wise; `shard_params` regroups those columns for the model axis (`tp_layout`,
Layer.tp), so each shard holds whole q/k/v heads and matching gate/up halves and the
partitioner needs no per-step regrouping collective. The FP8 FFN copies (quant.FP8FFN, stored
K-major: [N, K]) follow: gate/up rows regrouped and split like the bf16 columns, down split by
its K columns, each 128 x 128 block scale with its block, so d_ff / model must be a multiple
of 128 (`check_fp8_mesh`).

Multi-host: call `jax.distributed.initialize()` first on every host; `make_mesh` then spans
all hosts' devices (`jax.devices()`), and the same program runs everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from kernels.fp8_matmul import GROUP as FP8_BLOCK  # the FP8 FFN's weight-scale block
from lacache_jax.config import ModelConfig

DATA, MODEL = "data", "model"


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> jax.sharding.Mesh:
    """A (data, model) mesh over `devices` (default all, `data` = count / `model`)."""
    devices = list(jax.devices() if devices is None else devices)
    if model < 1 or len(devices) % model:
        raise ValueError(f"model={model} must divide the {len(devices)} devices")
    data = len(devices) // model if data is None else data
    if data < 1 or data * model != len(devices):
        raise ValueError(f"data x model = {data} x {model} must equal the {len(devices)} "
                         "devices")
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, model), (DATA, MODEL), axis_types=auto, devices=devices)


def check_mesh(mesh: jax.sharding.Mesh, cfg: ModelConfig) -> None:
    """Tensor parallelism splits heads, FFN columns and the vocabulary evenly."""
    if set(mesh.axis_names) != {DATA, MODEL}:
        raise ValueError(f"mesh axes must be ({DATA!r}, {MODEL!r}), got {mesh.axis_names}")
    n = mesh.shape[MODEL]
    for what, size in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads),
                       ("d_ff", cfg.d_ff), ("d_model", cfg.d_model),
                       ("vocab_size", cfg.vocab_size)):
        if size % n:
            raise ValueError(f"{what}={size} is not divisible by the mesh's model axis ({n})")


def fp8_splits(d_ff: int, n: int) -> bool:
    """Whether the FP8 FFN splits `n` ways with whole 128 x 128 weight-scale blocks (and whole
    1 x 128 activation groups) in each shard: d_ff / n a multiple of 128."""
    return d_ff % (n * FP8_BLOCK) == 0


def check_fp8_mesh(d_ff: int, n: int) -> None:
    if n > 1 and not fp8_splits(d_ff, n):
        raise ValueError(
            f"the FP8 FFN under tensor parallelism needs d_ff / model to be a multiple of "
            f"{FP8_BLOCK} (each shard holds whole {FP8_BLOCK} x {FP8_BLOCK} scale blocks); "
            f"d_ff={d_ff} over the mesh's model axis ({n}) gives {d_ff / n:g}: use a "
            f"model axis dividing {d_ff // FP8_BLOCK}, or fp8_ffn=False")


def layer_specs() -> dict[str, PS]:
    return {"attn_norm": PS(), "w_qkv": PS(None, MODEL), "wo": PS(MODEL, None), "ff_norm": PS(),
            "w_gate_up": PS(None, MODEL), "w_down": PS(MODEL, None)}


def fp8_specs() -> dict[str, PS]:
    """quant.FP8FFN's arrays, K-major ([N, K]): gate/up by rows (its output columns, grouped
    like w_gate_up's), down by its K columns (w_down's rows); scales with their blocks."""
    return {"gate_up": PS(MODEL, None), "gate_up_scale": PS(MODEL, None),
            "down": PS(None, MODEL), "down_scale": PS(None, MODEL)}


def group_specs(cfg: ModelConfig, model: int | None = None) -> dict[str, dict[str, PS]]:
    """PartitionSpecs by checkpoint group and array name (see checkpoint.py). The FP8 FFN
    groups split over a model axis of size `model` where they can (`check_fp8_mesh`), else
    (or with `model` unknown) they are replicated."""
    specs = {"embed": {"embed": PS()}, "final": {"norm_f": PS(), "head": PS(None, MODEL)}}
    specs.update({f"layer_{i:03d}": layer_specs() for i in range(cfg.n_layers)})
    if model is not None and model > 1 and fp8_splits(cfg.d_ff, model):
        # checkpoint.fp8_group_name's groups (checkpoint imports this module, not back)
        specs.update({f"fp8_layer_{i:03d}": fp8_specs() for i in range(cfg.n_layers)})
    return specs


def param_shardings(params: Any, mesh: jax.sharding.Mesh) -> Any:
    """NamedShardings for a `Params` pytree in the column layout of the mesh's model axis
    (`tp_layout`), FP8 FFN copies included."""
    ns = lambda spec: NamedSharding(mesh, spec)
    specs = layer_specs()
    ffn8_specs = fp8_specs()

    def layer(lay):
        fields = {f.name: ns(specs[f.name]) for f in dataclasses.fields(lay) if f.name in specs}
        ffn8 = None if lay.ffn8 is None else dataclasses.replace(
            lay.ffn8, **{k: ns(s) for k, s in ffn8_specs.items()})
        return dataclasses.replace(lay, **fields, ffn8=ffn8)

    return dataclasses.replace(
        params, embed=ns(PS()), layers=[layer(lay) for lay in params.layers], norm_f=ns(PS()),
        head=None if params.head is None else ns(PS(None, MODEL)))


def group_columns(w_DN: jax.Array, parts: tuple[int, ...], n: int, inverse: bool = False):
    """Columns made of consecutive parts (q | k | v, or gate | up) -> `n` groups, group j
    holding the j-th n-th of every part in order; `inverse` undoes it."""
    D = w_DN.shape[0]
    if w_DN.ndim != 2 or sum(parts) != w_DN.shape[1] or any(p % n for p in parts):
        raise ValueError(f"w_DN {w_DN.shape}: its columns must be the parts {parts}, each "
                         f"divisible by n={n}")
    if inverse:
        pieces = jnp.split(w_DN.reshape(D, n, -1), np.cumsum([p // n for p in parts])[:-1], -1)
        return jnp.concatenate([p.reshape(D, -1) for p in pieces], axis=-1)
    return jnp.concatenate([p.reshape(D, n, -1) for p in jnp.split(
        w_DN, np.cumsum(parts)[:-1], axis=-1)], axis=-1).reshape(D, -1)


def group_rows(w_NK: jax.Array, parts: tuple[int, ...], n: int, inverse: bool = False):
    """`group_columns` for a K-major matrix, whose outputs are its rows (FP8 gate/up and its
    block scales). Only a load-time layout step: the transposes it costs are paid once."""
    return group_columns(w_NK.T, parts, n, inverse).T


def tp_layout(params: Any, cfg: ModelConfig, n: int) -> Any:
    """Params whose fused Q/K/V and gate/up columns are grouped for `n` model shards
    (Layer.tp), and the FP8 copies' gate/up rows and block scales likewise (FP8FFN.tp): a
    contiguous shard then holds whole heads and matching gate/up halves, so the partitioner
    needs no per-step regrouping collective. Same function, other order."""
    qkv_parts = (cfg.n_heads * cfg.head_dim, *(2 * (cfg.n_kv_heads * cfg.head_dim,)))
    ffn_parts = (cfg.d_ff, cfg.d_ff)
    scale_parts = (cfg.d_ff // FP8_BLOCK,) * 2
    if any(layer.ffn8 is not None for layer in params.layers):
        check_fp8_mesh(cfg.d_ff, n)

    def regroup(layer):
        if layer.tp != n:
            w_qkv, w_gu = layer.w_qkv, layer.w_gate_up
            if layer.tp != 1:
                w_qkv = group_columns(w_qkv, qkv_parts, layer.tp, inverse=True)
                w_gu = group_columns(w_gu, ffn_parts, layer.tp, inverse=True)
            layer = dataclasses.replace(layer, w_qkv=group_columns(w_qkv, qkv_parts, n),
                                        w_gate_up=group_columns(w_gu, ffn_parts, n), tp=n)
        w8 = layer.ffn8
        if w8 is None or w8.tp == n:
            return layer
        # The FP8 copy's rows follow the same groups, and its scale rows (one per 128
        # rows) with them; down needs none: shard j's K columns are FFN columns j*F/n ...
        # in order, which is what its gate/up half yields.
        gate_up, scale = w8.gate_up, w8.gate_up_scale
        if w8.tp != 1:
            gate_up = group_rows(gate_up, ffn_parts, w8.tp, inverse=True)
            scale = group_rows(scale, scale_parts, w8.tp, inverse=True)
        return dataclasses.replace(layer, ffn8=dataclasses.replace(
            w8, gate_up=group_rows(gate_up, ffn_parts, n),
            gate_up_scale=group_rows(scale, scale_parts, n), tp=n))
    return dataclasses.replace(params, layers=[regroup(layer) for layer in params.layers])


def shard_params(params: Any, cfg: ModelConfig, mesh: jax.sharding.Mesh) -> Any:
    """`params` in the mesh's column layout (`tp_layout`), placed in their shardings; a
    no-op for params already laid out and placed so (shard once, pass the result on)."""
    check_mesh(mesh, cfg)
    params = tp_layout(params, cfg, mesh.shape[MODEL])
    return jax.device_put(params, param_shardings(params, mesh))


def bytes_per_device(tree: Any) -> dict[Any, int]:
    """Bytes of `tree`'s arrays held by each device (a replicated array counts on each)."""
    held: dict[Any, int] = {}
    for a in jax.tree.leaves(tree):
        for shard in a.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def tracing_under(mesh: jax.sharding.Mesh | None):
    """Context for tracing a program whose `mesh` is a static argument: kernels see it
    (`shard_kernel`, `per_data_shard`) while the program traces."""
    return (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
            else contextlib.nullcontext())


def active_mesh():
    """The mesh set by `jax.set_mesh`, or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or set(mesh.axis_names) != {DATA, MODEL} else mesh


def per_shard(n: int, axis: str) -> int:
    """`n` entries of a dimension sharded over `axis` (batch rows over DATA, heads over MODEL)
    as one device holds them under the active mesh (a kernel's dispatch by size looks at what
    each device runs)."""
    mesh = active_mesh()
    return n if mesh is None else -(-n // mesh.shape[axis])


def per_data_shard(rows: int) -> int:
    """`rows` of a batch-sharded array as one device holds them under the active mesh."""
    return per_shard(rows, DATA)


def shard_kernel(fn: Callable, in_specs, out_specs) -> Callable:
    """`fn` under `shard_map` over the active mesh (unchanged without one): each device runs
    the kernel on its own shard. Specs name only DATA and MODEL axes."""
    mesh = active_mesh()
    if mesh is None or mesh.size == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
