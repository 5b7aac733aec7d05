"""Checkpoints on disk: our config as JSON plus one orbax item per weight group.

Layout of a checkpoint directory:

    lacache.json        {"format": 1, "dtype": "bfloat16", "config": {ModelConfig fields}}
    params/embed        orbax item {"embed": [V, D]}
    params/layer_000    orbax item with the `Layer` fields of block 0, and so on
    params/final        orbax item {"norm_f": [D], "head": [D, V] (absent when tied)}

One item per group lets the converter write an 8B model holding one layer in memory at a time.
Every write goes to a hidden sibling directory that is renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from lacache_jax.config import ConfigError, ModelConfig
from lacache_jax.model import Layer, Params, param_shapes

FORMAT = 1
META_FILE = "lacache.json"
PARAMS_DIR = "params"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or does not match its config."""


def group_names(cfg: ModelConfig) -> list[str]:
    return ["embed", *(f"layer_{i:03d}" for i in range(cfg.n_layers)), "final"]


def expected_shapes(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Shapes of every array, by group name and array name."""
    D, V = cfg.d_model, cfg.vocab_size
    shapes = {"embed": {"embed": (V, D)}}
    shapes.update({f"layer_{i:03d}": param_shapes(cfg) for i in range(cfg.n_layers)})
    shapes["final"] = {"norm_f": (D,)} if cfg.tie_embeddings else {"norm_f": (D,), "head": (D, V)}
    return shapes


def params_to_groups(params: Params) -> dict[str, dict[str, Any]]:
    """The stored arrays by group (fields marked `derived`, the FP8 copies, are not stored)."""
    groups = {"embed": {"embed": params.embed}}
    for i, layer in enumerate(params.layers):
        groups[f"layer_{i:03d}"] = {f.name: getattr(layer, f.name)
                                    for f in dataclasses.fields(layer)
                                    if not f.metadata.get("derived")}
    groups["final"] = {"norm_f": params.norm_f}
    if params.head is not None:
        groups["final"]["head"] = params.head
    return groups


def groups_to_params(groups: Mapping[str, Mapping[str, Any]], cfg: ModelConfig) -> Params:
    return Params(embed=groups["embed"]["embed"],
                  layers=[Layer(**groups[f"layer_{i:03d}"]) for i in range(cfg.n_layers)],
                  norm_f=groups["final"]["norm_f"], head=groups["final"].get("head"))


# --- writing ------------------------------------------------------------------------------

@contextlib.contextmanager
def atomic_dir(dst: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes `dst` only if the block succeeds.

    On any failure (an exception, Ctrl-C) the temporary directory is removed and `dst` is
    untouched. With `force`, an existing `dst` is replaced only after the new one is complete.
    """
    dst = Path(dst).absolute()
    if dst.exists() and not force:
        raise FileExistsError(f"{dst} already exists (use --force to replace it)")
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"parent directory {dst.parent} does not exist")
    tag = uuid.uuid4().hex[:8]
    tmp = dst.parent / f".{dst.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        if dst.exists():
            old = dst.parent / f".{dst.name}.old-{tag}"
            dst.rename(old)
            tmp.rename(dst)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_meta(ckpt_dir: Path, cfg: ModelConfig, dtype: Any) -> None:
    meta = {"format": FORMAT, "dtype": jnp.dtype(dtype).name, "config": cfg.to_dict()}
    (ckpt_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def write_group(ckpt_dir: Path, name: str, arrays: Mapping[str, Any]) -> None:
    """Write one weight group synchronously (host numpy arrays or device arrays)."""
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    checkpointer.save(Path(ckpt_dir) / PARAMS_DIR / name, args=ocp.args.StandardSave(dict(arrays)))


def save(path: str | os.PathLike, config: ModelConfig, params: Params, *,
         force: bool = False) -> None:
    """Write `params` as a checkpoint that `load` reads; atomic (see `atomic_dir`)."""
    _check_shapes(params_to_groups(params), config, where="params")
    with atomic_dir(path, force) as tmp:
        (tmp / PARAMS_DIR).mkdir()
        for name, arrays in params_to_groups(params).items():
            write_group(tmp, name, arrays)
        write_meta(tmp, config, params.dtype)


# --- reading ------------------------------------------------------------------------------

def read_meta(path: str | os.PathLike) -> tuple[ModelConfig, str]:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    meta_file = path / META_FILE
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{meta_file}: missing (not a checkpoint written by "
                              "`python -m convert`?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_file}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_file}: unknown checkpoint format "
                              f"{meta.get('format') if isinstance(meta, dict) else meta!r}")
    try:
        return ModelConfig.from_dict(meta["config"]), meta["dtype"]
    except (ConfigError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_file}: bad config ({e})") from None


def load(path: str | os.PathLike, dtype: Any = None) -> tuple[ModelConfig, Params]:
    """Read a checkpoint onto the default device: `(config, params)`.

    `dtype` (e.g. jnp.float32) converts the weights while reading; default: as stored.
    """
    config, stored_dtype = read_meta(path)
    dtype = jnp.dtype(stored_dtype if dtype is None else dtype)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    groups = {}
    shapes = expected_shapes(config)
    for name in tqdm(group_names(config), desc="loading", unit="group", leave=False,
                     disable=None):
        item = Path(path).absolute() / PARAMS_DIR / name
        if not item.is_dir():
            raise CheckpointError(f"{item}: weight group missing (incomplete checkpoint)")
        target = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                  for k, shape in shapes[name].items()}
        try:
            stored = checkpointer.metadata(item).item_metadata.tree
        except Exception as e:  # orbax raises several types for a damaged item
            raise CheckpointError(f"{item}: unreadable ({type(e).__name__}: {e})") from None
        _check_group(str(item), {k: m.shape for k, m in stored.items()}, shapes[name])
        try:
            groups[name] = checkpointer.restore(item, args=ocp.args.StandardRestore(target))
        except Exception as e:
            raise CheckpointError(f"{item}: unreadable ({type(e).__name__}: {e})") from None
    return config, groups_to_params(groups, config)


def _check_shapes(groups: Mapping[str, Mapping[str, Any]], cfg: ModelConfig, where: str) -> None:
    shapes = expected_shapes(cfg)
    if set(groups) != set(shapes):
        raise CheckpointError(f"{where}: has groups {sorted(groups)}, expected {sorted(shapes)}")
    for name, arrays in groups.items():
        _check_group(f"{where}: {name}", {k: np.shape(a) for k, a in arrays.items()}, shapes[name])


def _check_group(where: str, got: Mapping[str, Any], want: Mapping[str, tuple[int, ...]]) -> None:
    if set(got) != set(want):
        raise CheckpointError(f"{where} holds {sorted(got)}, expected {sorted(want)}")
    for k, shape in got.items():
        if tuple(shape) != want[k]:
            raise CheckpointError(f"{where}.{k} has shape {tuple(shape)}, config implies {want[k]}")
