"""The Hugging Face LLaDA checkpoint layout (REFERENCE.md §2) and writing params in it.

Owns the map from HF tensor names to our weight groups (`key_plan`, `hf_shapes`), which the
converter reads through, and `export_hf`, which writes a params pytree as a HF LLaDA directory
(the demo command and tests use it). It lives in the engine so that the engine never imports
the converter; `convert` imports it from here.

HF stores `nn.Linear` weights [out, in]; we store [in, out], so matrices are transposed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from lacache_jax import checkpoint as ckpt
from lacache_jax import safetensors_file as stf
from lacache_jax.config import ModelConfig
from lacache_jax.model import Params, qkv_columns

PREFIX = "model.transformer."
# LLaDA block parameter -> (our Layer field, part of its columns or None, stored transposed)
_BLOCK = {
    "attn_norm.weight": ("attn_norm", None, False), "q_proj.weight": ("w_qkv", "q", True),
    "k_proj.weight": ("w_qkv", "k", True), "v_proj.weight": ("w_qkv", "v", True),
    "attn_out.weight": ("wo", None, True), "ff_norm.weight": ("ff_norm", None, False),
    "ff_proj.weight": ("w_gate_up", "gate", True), "up_proj.weight": ("w_gate_up", "up", True),
    "ff_out.weight": ("w_down", None, True),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a HF tensor goes: columns [c0, c1) of array `array` in group `group`
    (cols None: the whole array), transposed from PyTorch's [out, in] when `transposed`."""
    group: str
    array: str
    cols: tuple[int, int] | None
    transposed: bool


def key_plan(cfg: ModelConfig) -> dict[str, Target]:
    """HF name -> Target, in checkpoint order."""
    F = cfg.d_ff
    parts = {**qkv_columns(cfg), "gate": (0, F), "up": (F, 2 * F)}
    plan = {PREFIX + "wte.weight": Target("embed", "embed", None, False)}
    for i in range(cfg.n_layers):
        for suffix, (field, part, transposed) in _BLOCK.items():
            plan[f"{PREFIX}blocks.{i}.{suffix}"] = Target(
                f"layer_{i:03d}", field, parts.get(part), transposed)
    plan[PREFIX + "ln_f.weight"] = Target("final", "norm_f", None, False)
    if not cfg.tie_embeddings:
        plan[PREFIX + "ff_out.weight"] = Target("final", "head", None, True)
    return plan


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor ([out, in] for matrices), by name."""
    ours = ckpt.expected_shapes(cfg)
    shapes = {}
    for name, t in key_plan(cfg).items():
        shape = ours[t.group][t.array]
        if t.cols is not None:
            shape = (shape[0], t.cols[1] - t.cols[0])
        shapes[name] = shape[::-1] if t.transposed else shape
    return shapes


def export_hf(dst: str | Path, cfg: ModelConfig, params: Params, *, dtype: Any = jnp.bfloat16,
              max_shard_bytes: int = 5 * 2**30, force: bool = False) -> None:
    """Write `params` as a HF LLaDA directory: config.json, safetensors shards and, when there
    is more than one shard, model.safetensors.index.json (the layout `convert` reads).
    Atomic like every checkpoint write (`checkpoint.atomic_dir`)."""
    groups = ckpt.params_to_groups(params)
    out_dtype = np.dtype(dtype)
    tensors = {}
    for name, t in key_plan(cfg).items():
        a = np.asarray(groups[t.group][t.array]).astype(out_dtype)
        if t.cols is not None:
            a = a[..., t.cols[0]:t.cols[1]]
        tensors[name] = a.T if t.transposed else a
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors.items():
        if shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    with ckpt.atomic_dir(dst, force, marker="config.json") as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
        if len(shards) == 1:
            stf.write_file(tmp / "model.safetensors", shards[0], {"format": "pt"})
            return
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            stf.write_file(tmp / fname, shard, {"format": "pt"})
            weight_map.update({name: fname for name in shard})
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                 "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
