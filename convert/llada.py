"""LLaDA Hugging Face checkpoints <-> our checkpoints (REFERENCE.md §2).

HF stores `nn.Linear` weights [out, in]; we store [in, out], so matrices are transposed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from convert import safetensors_file as stf
from convert.sources import ConvertError, Entry, find_sources
from lacache_jax import checkpoint as ckpt
from lacache_jax.config import ConfigError, ModelConfig
from lacache_jax.model import Params, qkv_columns
from lacache_jax.quant import check_fp8_ffn_dims, quantize_ffn_layer

PREFIX = "model.transformer."
# LLaDA block parameter -> (our Layer field, part of its columns or None, stored transposed)
_BLOCK = {
    "attn_norm.weight": ("attn_norm", None, False), "q_proj.weight": ("w_qkv", "q", True),
    "k_proj.weight": ("w_qkv", "k", True), "v_proj.weight": ("w_qkv", "v", True),
    "attn_out.weight": ("wo", None, True), "ff_norm.weight": ("ff_norm", None, False),
    "ff_proj.weight": ("w_gate_up", "gate", True), "up_proj.weight": ("w_gate_up", "up", True),
    "ff_out.weight": ("w_down", None, True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
_FLOAT_SOURCES = {np.dtype(n) for n in ("float16", "float32", "float64")} | {
    stf.DTYPES["BF16"]}


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
    ours = ckpt.expected_shapes(cfg)
    shapes = {}
    for name, t in key_plan(cfg).items():
        shape = ours[t.group][t.array]
        if t.cols is not None:
            shape = (shape[0], t.cols[1] - t.cols[0])
        shapes[name] = shape[::-1] if t.transposed else shape
    return shapes


# --- HF -> ours ---------------------------------------------------------------------------

def convert(src: str | Path, dst: str | Path, dtype: str = "bfloat16", force: bool = False,
            progress: bool = True, fp8_skip: tuple[int, ...] | None = None) -> ModelConfig:
    """Convert the HF LLaDA directory `src` into our checkpoint `dst` (see checkpoint.py).

    Everything that can be checked before reading data is checked first; then weights are
    read, validated, cast and written one group (one layer) at a time, into a temporary
    directory renamed to `dst` on success. `fp8_skip` (a tuple, e.g. (0,)) also writes FP8
    FFN copies (`lj.quantize_ffn`) of every layer not in it, from the stored weights.
    """
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not src.is_dir():
        raise ConvertError(f"{src}: source directory not found")
    if dst.exists() and not force:
        raise ConvertError(f"{dst} already exists (use --force to replace it)")
    if dst.resolve() == src.resolve() or src.resolve().is_relative_to(dst.resolve()):
        raise ConvertError(f"{dst}: destination would overwrite the source {src}")
    try:
        cfg = ModelConfig.from_hf_file(src / "config.json")
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    fp8_layers = [] if fp8_skip is None else [
        i for i in range(cfg.n_layers) if i not in fp8_skip]
    if fp8_layers:
        try:
            check_fp8_ffn_dims(cfg.d_model, cfg.d_ff)
        except ValueError as e:
            raise ConvertError(f"--fp8-ffn: {e}") from None
    if fp8_skip is not None and any(not 0 <= i < cfg.n_layers for i in fp8_skip):
        raise ConvertError(f"--fp8-skip {list(fp8_skip)}: layers are 0..{cfg.n_layers - 1}")
    entries = _normalise_names(find_sources(src))
    plan = key_plan(cfg)
    _check_entries(entries, cfg, plan)

    by_group: dict[str, list[str]] = {}
    for name, t in plan.items():
        by_group.setdefault(t.group, []).append(name)
    shapes = ckpt.expected_shapes(cfg)
    total = sum(int(np.prod(entries[n].shape)) * entries[n].dtype.itemsize for n in plan)
    out_dtype = np.dtype(DTYPES[dtype])
    try:
        with ckpt.atomic_dir(dst, force) as tmp, tqdm(
                total=total, unit="B", unit_scale=True, desc="converting",
                disable=not progress) as bar:
            (tmp / ckpt.PARAMS_DIR).mkdir()
            for group in ckpt.group_names(cfg):
                arrays = {a: np.empty(shape, out_dtype) for a, shape in shapes[group].items()}
                for name in by_group[group]:
                    t = plan[name]
                    cols = slice(None) if t.cols is None else slice(*t.cols)
                    arrays[t.array][..., cols] = _read_checked(name, entries[name], t.transposed)
                    bar.update(int(np.prod(entries[name].shape)) * entries[name].dtype.itemsize)
                ckpt.write_group(tmp, group, arrays)
                i = int(group[len("layer_"):]) if group.startswith("layer_") else None
                if i in fp8_layers:
                    w8 = quantize_ffn_layer(arrays["w_gate_up"], arrays["w_down"])
                    ckpt.write_group(tmp, ckpt.fp8_group_name(i), ckpt.fp8_to_group(w8))
                del arrays
            ckpt.write_meta(tmp, cfg, out_dtype, fp8_layers)
            for f in TOKENIZER_FILES:
                if (src / f).is_file():
                    shutil.copy2(src / f, tmp / f)
    except (FileExistsError, FileNotFoundError) as e:
        raise ConvertError(str(e)) from None
    except OSError as e:
        raise ConvertError(f"writing {dst}: {e}") from None
    return cfg


def _normalise_names(entries: dict[str, Entry]) -> dict[str, Entry]:
    # A bare `LLaDAModel` state dict lacks the `model.` of `LLaDAModelLM`; accept both forms.
    if entries and all(n.startswith("transformer.") for n in entries):
        return {"model." + n: e for n, e in entries.items()}
    return entries


def _check_entries(entries: dict[str, Entry], cfg: ModelConfig, plan: dict) -> None:
    head = PREFIX + "ff_out.weight"
    if cfg.tie_embeddings and head in entries:
        raise ConvertError(f"{entries[head].where}: has a separate LM head {head!r} but "
                           "config.json says weight_tying=true")
    if missing := [n for n in plan if n not in entries]:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConvertError(f"missing key {missing[0]!r}{more}")
    if unexpected := sorted(n for n in entries if n not in plan):
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConvertError(f"{entries[unexpected[0]].where}: unexpected key "
                           f"{unexpected[0]!r}{more}")
    for name, shape in hf_shapes(cfg).items():
        e = entries[name]
        if e.shape != shape:
            raise ConvertError(f"{e.where}: {name!r} has shape {list(e.shape)}, "
                               f"config.json implies {list(shape)}")
        if e.dtype not in _FLOAT_SOURCES:
            raise ConvertError(f"{e.where}: {name!r} has unsupported dtype {e.dtype}")


def _read_checked(name: str, entry: Entry, transposed: bool) -> np.ndarray:
    a = entry.read()
    flat = a.reshape(-1)
    for i in range(0, flat.size, 1 << 24):  # in chunks: no full-size fp32 temporary
        if not np.isfinite(flat[i:i + (1 << 24)].astype(np.float32)).all():
            raise ConvertError(f"{entry.where}: {name!r} holds NaN or Inf (corrupt weights?)")
    return a.T if transposed else a  # cast (and made contiguous) by the assignment


# --- ours -> HF ---------------------------------------------------------------------------

def export_hf(dst: str | Path, cfg: ModelConfig, params: Params, *, dtype: Any = jnp.bfloat16,
              max_shard_bytes: int = 5 * 2**30, force: bool = False) -> None:
    """Write `params` as a HF LLaDA directory: config.json, safetensors shards and, when there
    is more than one shard, model.safetensors.index.json (the layout `convert` reads)."""
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
    with ckpt.atomic_dir(dst, force) as tmp:
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
