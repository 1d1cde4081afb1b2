"""Minimal safetensors reader/writer over numpy memmaps (bf16 and fp8 e4m3 via ml_dtypes).

The reader validates the header against the file size, so a truncated shard is an error naming the file and
the tensor (a header that is not valid safetensors JSON names the file too), and it slices tensors lazily: a device
reads only the bytes of its own shard of a weight.
Format: u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the data.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from ling_jax.errors import CheckpointError

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F64": np.dtype(np.float64),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one .safetensors file: `header[name]` -> (dtype, shape), `tensor(name)` -> memmap view."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated: expected an 8-byte header length, found {size} bytes")
            (n,) = struct.unpack("<Q", raw)
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated or not safetensors: the header length says {8 + n} "
                                      f"bytes, the file has {size}")
            header = _parse_header(path, f.read(n))
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + n
        self.header = {}
        for name, h in header.items():
            if h["dtype"] not in DTYPES:
                raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {h['dtype']} "
                                      f"(expected one of {sorted(DTYPES)})")
            begin, end = h["data_offsets"]
            dt = DTYPES[h["dtype"]]
            want = dt.itemsize * int(np.prod(h["shape"], dtype=np.int64))
            if end - begin != want:
                raise CheckpointError(f"{path}: tensor {name}: shape {h['shape']} needs {want} bytes, "
                                      f"its data_offsets span {end - begin}")
            if self.data_start + end > size:
                raise CheckpointError(
                    f"{path}: truncated: tensor {name} ends at byte {self.data_start + end}, file has {size}"
                )
            self.header[name] = (dt, tuple(h["shape"]), begin)
        self._mm = None

    def tensor(self, name: str) -> np.ndarray:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        dt, shape, begin = self.header[name]
        nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        start = self.data_start + begin
        return self._mm[start : start + nbytes].view(dt).reshape(shape)


def _parse_header(path: str, raw: bytes) -> dict:
    """The JSON header {name: {dtype, shape, data_offsets}} (+ optional __metadata__), each entry checked."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: expected JSON, found {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: expected a JSON object, "
                              f"found {type(header).__name__}")
    for name, h in header.items():
        if name != "__metadata__" and not _is_entry(h):
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name}: expected "
                                  f"{{dtype, shape, data_offsets}}, found {json.dumps(h)[:200]}")
    return header


def _is_entry(h) -> bool:
    if not isinstance(h, dict) or not isinstance(h.get("dtype"), str):
        return False
    shape, offsets = h.get("shape"), h.get("data_offsets")
    return (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1])


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    header, offset = {}, 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        nbytes = arr.nbytes
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def _read_weight_map(index: str) -> dict[str, str]:
    """model.safetensors.index.json -> its weight_map {tensor name: shard file name}."""
    try:
        with open(index) as f:
            d = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: corrupt index: expected JSON, found {e}") from None
    weight_map = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: corrupt index: expected a weight_map {{tensor name: file name}}")
    return weight_map


def open_checkpoint(model_dir: str) -> dict[str, SafetensorsFile]:
    """Tensor name -> the file holding it, from model.safetensors.index.json or a single model.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index):
        weight_map = _read_weight_map(index)
        files: dict[str, SafetensorsFile] = {}
        where = {}
        for name, fname in weight_map.items():
            path = os.path.join(model_dir, fname)
            if fname not in files:
                if not os.path.exists(path):
                    raise CheckpointError(f"shard {path} named in {index} (for {name}) does not exist")
                files[fname] = SafetensorsFile(path)
            if name not in files[fname].header:
                raise CheckpointError(f"{index} maps {name} to {path}, which does not hold it")
            where[name] = files[fname]
        for fname, sf in files.items():
            for name in sf.header:
                if name not in weight_map:
                    raise CheckpointError(f"{sf.path} holds {name}, which {index} does not list")
        return where
    if os.path.exists(single):
        sf = SafetensorsFile(single)
        return {name: sf for name in sf.header}
    raise CheckpointError(f"{model_dir}: neither model.safetensors.index.json nor model.safetensors")
