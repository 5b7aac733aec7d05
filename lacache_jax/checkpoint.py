"""Checkpoints on disk: our config as JSON plus one orbax item per weight group.

Layout of a checkpoint directory:

    lacache.json        {"format": 1, "dtype": "bfloat16", "config": {ModelConfig fields}}
    params/embed        orbax item {"embed": [V, D]}
    params/layer_000    orbax item with the `Layer` fields of block 0, and so on
    params/final        orbax item {"norm_f": [D], "head": [D, V] (absent when tied)}
    params/fp8_layer_001 ... (optional) FP8 FFN copies of the layers listed under
                        "fp8_ffn_layers" in lacache.json: {"gate_up", "down"} as the bytes of
                        float8_e4m3fn (uint8), {"gate_up_scale", "down_scale"} fp32

One item per group lets the converter write an 8B model holding one layer in memory at a time.
Every write goes to a hidden sibling directory that is renamed into place only when complete;
Ctrl-C is held while orbax writes an item and while the directory is put in place, so an
interrupt never leaves a partial item or a hidden directory behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from lacache_jax import sharding as sharding_lib
from lacache_jax.config import WEIGHT_DTYPES, ConfigError, ModelConfig
from lacache_jax.model import Layer, Params, outer_shapes, param_shapes
from lacache_jax.quant import FP8, FP8FFN, ffn8_shapes

FORMAT = 1
META_FILE = "lacache.json"
PARAMS_DIR = "params"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or does not match its config."""


def group_names(cfg: ModelConfig) -> list[str]:
    return ["embed", *(f"layer_{i:03d}" for i in range(cfg.n_layers)), "final"]


def expected_shapes(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Shapes of every array, by group name and array name."""
    outer = outer_shapes(cfg)
    shapes = {"embed": {"embed": outer.pop("embed")}}
    shapes.update({f"layer_{i:03d}": param_shapes(cfg) for i in range(cfg.n_layers)})
    shapes["final"] = outer  # norm_f, and head unless tied
    return shapes


def fp8_group_name(i: int) -> str:
    return f"fp8_layer_{i:03d}"


def fp8_to_group(w: FP8FFN) -> dict[str, Any]:
    """FP8 arrays stored as their bytes (uint8): orbax/tensorstore need not know float8."""
    if w.granularity != "group":
        raise CheckpointError(f"only per-group FP8 FFN weights are stored, got {w.granularity!r}")
    as_bytes = lambda a: jax.lax.bitcast_convert_type(jnp.asarray(a), jnp.uint8)
    return {"gate_up": as_bytes(w.gate_up), "gate_up_scale": w.gate_up_scale,
            "down": as_bytes(w.down), "down_scale": w.down_scale}


def group_to_fp8(g: Mapping[str, Any]) -> FP8FFN:
    as_fp8 = lambda a: jax.lax.bitcast_convert_type(a, FP8)
    return FP8FFN(as_fp8(g["gate_up"]), g["gate_up_scale"], as_fp8(g["down"]), g["down_scale"])


def params_to_groups(params: Params) -> dict[str, dict[str, Any]]:
    """The stored arrays by group; fields marked `derived` (the FP8 copies) are left out here
    and written by `save` as groups of their own."""
    if grouped := sorted({layer.tp for layer in params.layers} - {1}):
        raise ValueError(f"params are in the tensor-parallel column layout (Layer.tp="
                         f"{grouped[0]}): store the checkpoint layout, sharding.tp_layout("
                         "params, config, 1)")
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
def atomic_dir(dst: str | os.PathLike, force: bool = False,
               marker: str = META_FILE) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes `dst` only if the block succeeds.

    On any failure (an exception, Ctrl-C) the temporary directory is removed and `dst` is
    untouched. With `force`, an existing `dst` is replaced only after the new one is complete,
    and only if it is what this writes (a directory holding `marker`: `lacache.json` for a
    checkpoint) or an empty directory: anything else is refused, never deleted.
    A Ctrl-C during the final renames is delivered after them, with `dst` complete. A `dst`
    that is a symbolic link (dangling or not) is written where it points; the link stays.
    """
    dst = Path(os.path.realpath(dst))
    if dst.exists() and not force:
        raise FileExistsError(f"{dst} already exists (force / --force replaces it)")
    if dst.exists() and not (dst.is_dir() and ((dst / marker).is_file()
                                               or not any(dst.iterdir()))):
        raise FileExistsError(f"{dst} exists and holds no {marker}: force / --force replaces "
                              "only what this writes (or an empty directory); move it away")
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"parent directory {dst.parent} does not exist")
    tag = uuid.uuid4().hex[:8]
    tmp = dst.parent / f".{dst.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        with interrupts_deferred():  # between the renames, dst would be missing
            if dst.exists():
                old = dst.parent / f".{dst.name}.old-{tag}"
                dst.rename(old)
                tmp.rename(dst)
                shutil.rmtree(old) if old.is_dir() else old.unlink()
            else:
                tmp.rename(dst)
    except BaseException:
        remove_settled(tmp)
        raise


# How long a removed directory must stay gone before `remove_settled` trusts it gone, and how
# long it keeps trying.
SETTLE_S, SETTLE_LIMIT_S = 0.5, 10.0


def remove_settled(path: Path, settle_s: float = SETTLE_S,
                   limit_s: float = SETTLE_LIMIT_S) -> None:
    """Remove the tree at `path`, again whenever it reappears, until it has stayed gone for
    `settle_s` (at most `limit_s` in all).

    When tensorstore fails one write of an orbax item (a full disk, a file-size limit), orbax
    raises at once while the item's other writes run on in tensorstore's own threads, and
    those create their directories again (mkdir -p) after a plain rmtree: under load about one
    failed conversion in ten left `.DST.tmp-*/params/layer_000.orbax-checkpoint-tmp/...`
    behind. Nothing in orbax's API waits for them, so this waits for the tree to stay gone.
    """
    start = gone_since = time.monotonic()
    shutil.rmtree(path, ignore_errors=True)
    while (now := time.monotonic()) - gone_since < settle_s and now - start < limit_s:
        time.sleep(0.02)
        if os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
            gone_since = time.monotonic()


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT (Ctrl-C) until the block ends, then hand it to the handler it would have met.

    orbax writes through background threads: a KeyboardInterrupt raised in the middle of a save
    leaves a partial item and threads failing on a shut-down executor. Nested uses pass the
    interrupt outwards; a caller's own handler (the converter's, which only records it) gets it
    unchanged. Python delivers signals to the main thread only: elsewhere this does nothing.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # None: a handler not installed from Python, which could not be restored
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, caught[0])  # default_int_handler raises here
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt


def write_meta(ckpt_dir: Path, cfg: ModelConfig, dtype: Any, fp8_layers=()) -> None:
    meta = {"format": FORMAT, "dtype": jnp.dtype(dtype).name, "config": cfg.to_dict(),
            "fp8_ffn_layers": sorted(fp8_layers)}
    (ckpt_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def write_group(ckpt_dir: Path, name: str, arrays: Mapping[str, Any]) -> None:
    """Write one weight group synchronously (host numpy arrays or device arrays)."""
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    try:
        with interrupts_deferred():
            checkpointer.save(Path(ckpt_dir) / PARAMS_DIR / name,
                              args=ocp.args.StandardSave(dict(arrays)))
    except ValueError as e:  # tensorstore's I/O failures (a full disk: RESOURCE_EXHAUSTED)
        code = re.search(r"os_error_code='?(\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), f"{name}: {os.strerror(int(code[1]))}") from None


def save(path: str | os.PathLike, config: ModelConfig, params: Params, *,
         force: bool = False) -> None:
    """Write `params` as a checkpoint that `load` reads; atomic (see `atomic_dir`). FP8 FFN
    copies (`lj.quantize_ffn`) are stored too, so loading needs no re-quantisation."""
    _check_shapes(params_to_groups(params), config, where="params")
    _check_weight_dtype(params.dtype, "params are {}: checkpoints hold {}")
    fp8 = {i: fp8_to_group(layer.ffn8) for i, layer in enumerate(params.layers)
           if layer.ffn8 is not None}
    with atomic_dir(path, force) as tmp:
        (tmp / PARAMS_DIR).mkdir()
        groups = {**params_to_groups(params), **{fp8_group_name(i): a for i, a in fp8.items()}}
        for name, arrays in tqdm(groups.items(), desc="saving", unit="group", leave=False,
                                 disable=None):
            write_group(tmp, name, arrays)
        write_meta(tmp, config, params.dtype, fp8)


# --- reading ------------------------------------------------------------------------------

def read_meta(path: str | os.PathLike) -> tuple[ModelConfig, str, list[int]]:
    """(config, stored dtype name, layers with stored FP8 FFN copies)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    meta_file = path / META_FILE
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError:
        if (path / "config.json").is_file():
            raise CheckpointError(
                f"{meta_file}: missing; {path} looks like a Hugging Face model directory: "
                f"convert it first (python -m convert {path} DST)") from None
        raise CheckpointError(f"{meta_file}: missing (not a checkpoint written by "
                              "`python -m convert`?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_file}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_file}: unknown checkpoint format "
                              f"{meta.get('format') if isinstance(meta, dict) else meta!r}")
    try:
        cfg = ModelConfig.from_dict(meta["config"])
        fp8_layers = [int(i) for i in meta.get("fp8_ffn_layers", [])]
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_file}: bad config ({e})") from None
    if any(not 0 <= i < cfg.n_layers for i in fp8_layers):
        raise CheckpointError(f"{meta_file}: fp8_ffn_layers {fp8_layers} outside the model")
    try:
        floating = jnp.issubdtype(jnp.dtype(meta.get("dtype")), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise CheckpointError(f"{meta_file}: weight dtype {meta.get('dtype')!r} is not a "
                              "floating type")
    return cfg, meta["dtype"], fp8_layers


def load(path: str | os.PathLike, dtype: Any = None, mesh: jax.sharding.Mesh | None = None,
         progress: bool | None = None) -> tuple[ModelConfig, Params]:
    """Read a checkpoint onto the default device: `(config, params)`.

    `dtype` (e.g. jnp.float32) converts the weights while reading; default: as stored. Stored
    FP8 FFN copies (`python -m convert --fp8-ffn`, or `save` of quantised params) are attached
    to their layers as they are. With `mesh` (`lj.make_mesh`), every array is restored
    straight into its tensor-parallel sharding (sharding.py) instead of one device.
    `progress`: a bar per weight group on stderr (None: only when stderr is a terminal).
    """
    config, stored_dtype, fp8_layers = read_meta(path)
    dtype = jnp.dtype(stored_dtype if dtype is None else dtype)
    # also a stored float16 (lj.save once took it)
    _check_weight_dtype(dtype, "dtype {}: weights load as {} (pass dtype=)")
    if mesh is not None:
        sharding_lib.check_mesh(mesh, config)
        specs = sharding_lib.group_specs(config, mesh.shape[sharding_lib.MODEL])
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def sharding(name, array):
        if mesh is None:
            return single
        spec = specs[name][array] if name in specs else jax.sharding.PartitionSpec()
        return jax.sharding.NamedSharding(mesh, spec)

    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    groups = {}
    shapes = expected_shapes(config)
    shapes.update({fp8_group_name(i): ffn8_shapes(config.d_model, config.d_ff)
                   for i in fp8_layers})
    # FP8 groups keep their stored types: codes as bytes, scales fp32; `dtype` is for the rest.
    fp8_dtypes = {"gate_up": jnp.uint8, "down": jnp.uint8}
    dtype_of = lambda name, k: (fp8_dtypes.get(k, jnp.float32) if name.startswith("fp8_")
                                else dtype)
    # Weight groups the metadata does not know: a config that says fewer layers (loading
    # would silently drop layers) or FP8 copies it does not list. Other entries are not ours.
    on_disk = {p.name for p in (Path(path) / PARAMS_DIR).iterdir()
               if re.fullmatch(r"(fp8_)?layer_\d{3}", p.name)}
    if extra := sorted(on_disk - set(shapes)):
        known = (f"its config has {config.n_layers} layers" if extra[0].startswith("layer_")
                 else f"{META_FILE} lists FP8 FFN copies for layers {fp8_layers}")
        raise CheckpointError(f"{Path(path) / PARAMS_DIR}: holds {', '.join(extra[:3])}"
                              f"{' ...' if len(extra) > 3 else ''}, but {known}")
    for name in tqdm(shapes, desc="loading", unit="group", leave=False,
                     disable=None if progress is None else not progress):
        item = Path(path).absolute() / PARAMS_DIR / name
        if not item.is_dir():
            raise CheckpointError(f"{item}: weight group missing (incomplete checkpoint)")
        target = {k: jax.ShapeDtypeStruct(shape, dtype_of(name, k), sharding=sharding(name, k))
                  for k, shape in shapes[name].items()}
        try:
            with _absl_quiet():  # a damaged item also logs a WARNING line of its own
                meta = checkpointer.metadata(item).item_metadata
        except Exception as e:  # orbax raises several types for a damaged item
            raise CheckpointError(f"{item}: unreadable ({_first_line(e)})") from None
        if meta is None:  # orbax could not read it (and said so in a warning)
            raise CheckpointError(f"{item}: unreadable (its metadata is damaged or missing)")
        stored = meta.tree
        _check_group(str(item), {k: m.shape for k, m in stored.items()}, shapes[name])
        try:
            groups[name] = checkpointer.restore(item, args=ocp.args.StandardRestore(target))
        except Exception as e:
            raise CheckpointError(f"{item}: unreadable ({_first_line(e)})") from None
    params = groups_to_params(groups, config)
    for i in fp8_layers:
        params.layers[i] = dataclasses.replace(params.layers[i],
                                               ffn8=group_to_fp8(groups[fp8_group_name(i)]))
    return config, params


@contextlib.contextmanager
def _absl_quiet() -> Iterator[None]:
    """While the block runs, drop orbax's absl warning that it cannot read an item's
    metadata (load reports that itself). A filter of its own per call: overlapping loads in
    other threads neither undo it nor lose other warnings."""
    logger = logging.getLogger("absl")

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to get item metadata")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def drop_late_tensorstore_errors() -> None:
    """Process-wide, for the command lines: after an orbax read or write fails, tensorstore's
    other callbacks complete into the closed asyncio loop, and Python prints each
    `RuntimeError: Event loop is closed` as an unraisable exception, a traceback of a dozen
    lines after the command's own one-line error (up to 133 lines seen). Those are dropped;
    every other unraisable exception goes to the hook that was there."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        e = unraisable.exc_value
        if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
            previous(unraisable)
    sys.unraisablehook = hook


def _check_weight_dtype(dtype: Any, message: str) -> None:
    """`message.format(dtype name, the allowed ones)` unless `dtype` is bfloat16 or float32."""
    if jnp.dtype(dtype).name not in WEIGHT_DTYPES:
        raise CheckpointError(message.format(jnp.dtype(dtype).name, " or ".join(WEIGHT_DTYPES)))


def _first_line(e: Exception) -> str:
    """An exception in one short line: tensorstore's carry their whole spec as JSON."""
    text = (str(e).strip().splitlines() or [""])[0]
    text = text.split(" [source locations=")[0].split(" See full TensorStore")[0]
    return f"{type(e).__name__}: {text[:300]}"


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
