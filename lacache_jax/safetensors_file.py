"""The safetensors format read and written with numpy alone (bf16 through ml_dtypes).

A file is an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
{dtype, shape, data_offsets: [begin, end]} (offsets relative to the end of the header), then the
raw little-endian data. The `safetensors` package's numpy API has no bf16, hence this module.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Mapping

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "I16": np.dtype(np.int16), "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20


class FormatError(ValueError):
    """A file is not a well-formed, complete safetensors file."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int   # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Parse and validate the header; checks every tensor's bytes lie inside the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path}: truncated ({size} bytes, no header)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise FormatError(f"{path}: corrupt or truncated header (claims {n} bytes, "
                              f"file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FormatError(f"{path}: corrupt header ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: corrupt header (not a JSON object)")
    base = 8 + n
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{path}: corrupt header entry for {name!r}: {entry!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise FormatError(f"{path}: {name!r} has {end - begin} bytes of data, "
                              f"dtype and shape {list(shape)} need {nbytes}")
        if base + end > size:
            raise FormatError(f"{path}: truncated: {name!r} ends at byte {base + end}, "
                              f"file has {size}")
        infos[name] = TensorInfo(path, dtype, shape, base + begin, nbytes)
    # As the reference reader: the tensors tile the data area, no overlap and no gap.
    end = base
    for name, info in sorted(infos.items(), key=lambda kv: (kv[1].offset, kv[1].nbytes)):
        if info.offset != end:
            raise FormatError(f"{path}: corrupt header: {name!r} starts at byte {info.offset}, "
                              f"the data before it ends at {end} (overlap or gap)")
        end += info.nbytes
    if end != size:
        raise FormatError(f"{path}: {size - end} bytes after the last tensor's data")
    return infos


def read_tensor(info: TensorInfo) -> np.ndarray:
    count = info.nbytes // info.dtype.itemsize
    data = np.fromfile(info.path, dtype=info.dtype, count=count, offset=info.offset)
    if data.size != count:
        raise FormatError(f"{info.path}: truncated while reading")
    return data.reshape(info.shape)


def write_file(path: str | Path, tensors: Mapping[str, np.ndarray],
               metadata: Mapping[str, str] | None = None) -> None:
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    arrays = []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {a.dtype} has no safetensors name")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())  # native order: every supported machine is little-endian
