"""Where a checkpoint's tensors live: sharded or single safetensors, or a PyTorch state dict.

A source maps tensor names to `Entry`s whose shape and dtype are known before any data is
read, so a whole checkpoint can be validated first and then read one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from lacache_jax import safetensors_file as stf


class ConvertError(Exception):
    """An expected failure: printed as one line by the CLI, never as a traceback."""


@dataclasses.dataclass(frozen=True)
class Entry:
    where: str                       # file that holds it, for error messages
    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[], np.ndarray]


def find_sources(src: Path) -> dict[str, Entry]:
    """All tensors of the checkpoint in directory `src`, by name."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (src / "model.safetensors").is_file() and (src / index_name).is_file():
            raise ConvertError(f"{src}: holds both model.safetensors and {index_name}, which "
                               "may list other weights (transformers reads "
                               "model.safetensors); remove the stale one")
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (src / index_name).is_file():
            return _from_index(src, src / index_name)
    if (src / "model.safetensors").is_file():
        return _safetensors(src / "model.safetensors")
    state_dicts = sorted(p for p in src.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if len(state_dicts) == 1:
        return _torch(state_dicts[0])
    if len(state_dicts) > 1:
        raise ConvertError(f"{src}: several state dict files and no index: "
                           f"{', '.join(p.name for p in state_dicts)}")
    raise ConvertError(f"{src}: no weights found (expected model.safetensors.index.json, "
                       "model.safetensors, or a PyTorch .bin/.pt state dict)")


def _from_index(src: Path, index_path: Path) -> dict[str, Entry]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ConvertError(f"{index_path}: not a valid index (no weight_map: {e})") from None
    entries: dict[str, Entry] = {}
    root = os.path.normpath(os.path.abspath(src))
    for shard in weight_map.values():
        # By name, links not followed: a Hugging Face cache's shards link to its blobs/.
        if not isinstance(shard, str) or os.path.commonpath(
                [root, os.path.normpath(os.path.join(root, shard))]) != root or not shard:
            raise ConvertError(f"{index_path}: shard {shard!r} is not a file inside {src}")
    for shard in sorted(set(weight_map.values())):
        path = src / shard
        if not path.is_file():
            raise ConvertError(f"{index_path}: shard {shard} is missing")
        shard_entries = _safetensors(path) if path.suffix == ".safetensors" else _torch(path)
        for name, entry in shard_entries.items():
            if weight_map.get(name) != shard:
                place = f"in {weight_map[name]}" if name in weight_map else "nowhere"
                raise ConvertError(f"{path}: holds {name!r}, which the index places {place}")
            entries[name] = entry
    if missing := sorted(set(weight_map) - set(entries)):
        raise ConvertError(f"{src / weight_map[missing[0]]}: lacks {missing[0]!r} "
                           f"(listed in {index_path.name})")
    return entries


def _safetensors(path: Path) -> dict[str, Entry]:
    try:
        infos = stf.read_header(path)
    except (stf.FormatError, OSError) as e:
        raise ConvertError(str(e)) from None

    def reader(info):
        def read():
            try:
                return stf.read_tensor(info)
            except (stf.FormatError, OSError) as e:
                raise ConvertError(str(e)) from None
        return read
    return {name: Entry(str(path), info.shape, info.dtype, reader(info))
            for name, info in infos.items()}


def _torch(path: Path) -> dict[str, Entry]:
    try:
        import torch
    except ImportError:
        raise ConvertError(f"{path}: reading PyTorch state dicts needs torch installed "
                           "(pip install torch), or convert the weights to safetensors") from None
    try:
        try:  # mmap keeps the RSS to one tensor at a time; old (non-zip) files cannot mmap
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        raise ConvertError(f"{path}: cannot read as a PyTorch state dict "
                           f"({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ConvertError(f"{path}: not a flat state dict of tensors")

    def to_numpy(t):
        t = t.detach().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def dtype_of(t):
        if t.dtype == torch.bfloat16:
            return np.dtype(ml_dtypes.bfloat16)
        try:
            return np.dtype(str(t.dtype).removeprefix("torch."))
        except TypeError:  # a torch-only dtype: refused later as unsupported
            return np.dtype(object)
    return {name: Entry(str(path), tuple(t.shape), dtype_of(t), lambda t=t: to_numpy(t))
            for name, t in state.items()}
