"""Hugging Face LLaDA checkpoints -> our checkpoints (REFERENCE.md §2).

Owns the conversion itself: validate the source (config.json keys, tensor names, shapes,
dtypes), then read, transpose, cast and write one weight group at a time. The HF layout (which
tensor lands where) lives in `lacache_jax.hf_export`, shared with the exporter.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from convert.sources import ConvertError, Entry, find_sources
from lacache_jax import checkpoint as ckpt
from lacache_jax import safetensors_file as stf
from lacache_jax.config import HF_KEYS_READ, WEIGHT_DTYPES, ConfigError, ModelConfig
from lacache_jax.hf_export import PREFIX, hf_shapes, key_plan
from lacache_jax.quant import check_fp8_ffn_dims, quantize_ffn_layer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
DTYPES = {name: jnp.dtype(name) for name in WEIGHT_DTYPES}
_FLOAT_SOURCES = {np.dtype(n) for n in ("float16", "float32", "float64")} | {
    stf.DTYPES["BF16"]}

# config.json keys we know: read (config.HF_KEYS_READ), or inert: LLaDA's training settings
# and Hugging Face bookkeeping, which cannot change the forward pass (alibi_bias_max and
# attention_layer_norm_with_affine matter only with features that are refused). Any other key
# is ignored with a warning naming it, so a typo or a new feature is never silently dropped.
_INERT_KEYS = frozenset({
    "attention_dropout", "residual_dropout", "embedding_dropout", "init_device", "init_fn",
    "init_std", "init_cutoff_factor", "precision", "flash_attention", "alibi_bias_max",
    "attention_layer_norm_with_affine",
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "bos_token_id", "_name_or_path"})


class ConvertWarning(UserWarning):
    """Something converted but worth a look (e.g. config.json keys we ignore)."""


def unknown_config_keys(hf: dict) -> list[str]:
    """The keys of a config.json dict that neither configure the model nor are known inert."""
    return sorted(set(hf) - HF_KEYS_READ - _INERT_KEYS)


# --- HF -> ours ---------------------------------------------------------------------------

def convert(src: str | Path, dst: str | Path, dtype: str = "bfloat16", force: bool = False,
            progress: bool = True, fp8_skip: tuple[int, ...] | None = None,
            safe_point: Callable[[], None] = lambda: None) -> ModelConfig:
    """Convert the HF LLaDA directory `src` into our checkpoint `dst` (see checkpoint.py).

    Everything that can be checked before reading data is checked first; then weights are
    read, validated, cast and written one group (one layer) at a time, into a temporary
    directory renamed to `dst` on success. `fp8_skip` (a tuple, e.g. (0,)) also writes FP8
    FFN copies (`lj.quantize_ffn`) of every layer not in it, from the stored weights.
    `safe_point()` is called where stopping leaves nothing behind (before each group and just
    before `dst` is put in place); an exception it raises removes the temporary directory. The
    CLI raises a deferred Ctrl-C there. Unknown config.json keys warn (ConvertWarning).
    """
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not src.is_dir():
        raise ConvertError(f"{src}: source directory not found")
    if dst.exists() and not force:
        raise ConvertError(f"{dst} already exists (--force replaces it)")
    if dst.resolve() == src.resolve() or src.resolve().is_relative_to(dst.resolve()):
        raise ConvertError(f"{dst}: destination would overwrite the source {src}")
    try:
        cfg = ModelConfig.from_hf_file(src / "config.json")
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    if unknown := unknown_config_keys(json.loads((src / "config.json").read_text())):
        warnings.warn(f"{src / 'config.json'}: ignoring unknown key(s) {', '.join(unknown)}",
                      ConvertWarning, stacklevel=2)
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
    _check_entries(src, entries, cfg, plan)

    by_group: dict[str, list[str]] = {}
    for name, t in plan.items():
        by_group.setdefault(t.group, []).append(name)
    shapes = ckpt.expected_shapes(cfg)
    total = sum(int(np.prod(entries[n].shape)) * entries[n].dtype.itemsize for n in plan)
    out_dtype = np.dtype(DTYPES[dtype])
    written = Path(os.path.realpath(dst))  # where atomic_dir writes (a link's target)
    _check_space(written, cfg, out_dtype, len(fp8_layers))
    _warn_leftovers(written)
    if not (src / "tokenizer.json").is_file():
        warnings.warn(f"{src} has no tokenizer.json: `python -m lacache_jax generate` and "
                      "lm-eval need one beside the checkpoint (copy it into DST)",
                      ConvertWarning, stacklevel=2)
    try:
        with ckpt.atomic_dir(dst, force) as tmp, tqdm(
                total=total, unit="B", unit_scale=True, desc="converting",
                disable=not progress) as bar:
            (tmp / ckpt.PARAMS_DIR).mkdir()
            for group in ckpt.group_names(cfg):
                safe_point()
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
            safe_point()  # the last one: after it, dst is put in place whatever happens
    except (FileExistsError, FileNotFoundError) as e:
        raise ConvertError(str(e)) from None
    except OSError as e:
        raise ConvertError(f"writing {dst}: {e}") from None
    return cfg


# orbax compresses what it writes: random bf16 weights by about a fifth (the demo model:
# 10.9 MB on disk for 13.6 MB of weights), a trained model's by less or more.
SURELY_TOO_LITTLE = 0.7


def _check_space(dst: Path, cfg: ModelConfig, out_dtype: np.dtype, n_fp8: int) -> None:
    """Before writing: refuse when DST's file system holds under 70% of the uncompressed
    weights, warn under 100% (a write failing midway is reported too, by `write_group`)."""
    need = cfg.n_params * out_dtype.itemsize + n_fp8 * 3 * cfg.d_model * cfg.d_ff
    parent = dst.parent
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        return  # no parent: the write itself reports it
    said = (f"{parent}: {_size(free)} free for {_size(need)} of weights "
            "(orbax compresses them by about a fifth)")
    if free < SURELY_TOO_LITTLE * need:
        raise ConvertError(said)
    if free < need:
        warnings.warn(f"{said}: the conversion may run out of space", ConvertWarning,
                      stacklevel=3)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


def _warn_leftovers(dst: Path) -> None:
    """Temporary directories of conversions killed outright (SIGKILL, the OOM killer, power
    loss) stay beside DST, as large as the weights written so far: say so, delete nothing
    (one may belong to a conversion still running)."""
    if not dst.parent.is_dir():
        return
    left = sorted(dst.parent.glob(f".{glob.escape(dst.name)}.tmp-*"))
    if left:
        size = sum(f.stat().st_size for d in left for f in d.rglob("*") if f.is_file())
        warnings.warn(f"{len(left)} temporary director{'y' if len(left) == 1 else 'ies'} of "
                      f"an earlier conversion to {dst.name} ({_size(size)}): "
                      f"{', '.join(str(d) for d in left)}; delete unless a conversion is "
                      "still running", ConvertWarning, stacklevel=3)


def _normalise_names(entries: dict[str, Entry]) -> dict[str, Entry]:
    # A bare `LLaDAModel` state dict lacks the `model.` of `LLaDAModelLM`; accept both forms.
    if entries and all(n.startswith("transformer.") for n in entries):
        return {"model." + n: e for n, e in entries.items()}
    return entries


def _check_entries(src: Path, entries: dict[str, Entry], cfg: ModelConfig,
                   plan: dict) -> None:
    head = PREFIX + "ff_out.weight"
    if cfg.tie_embeddings and head in entries:
        raise ConvertError(f"{entries[head].where}: has a separate LM head {head!r} but "
                           "config.json says weight_tying=true")
    if missing := [n for n in plan if n not in entries]:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConvertError(f"{src}: missing key {missing[0]!r}{more}: no file of it holds "
                           "the tensor")
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
