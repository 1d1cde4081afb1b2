"""Minimal safetensors reader/writer over numpy memmaps (bf16 and fp8 e4m3 via ml_dtypes).

The reader validates the header against the file size, so a truncated shard is an error naming the file and
the tensor, and it slices tensors lazily: a device reads only the bytes of its own shard of a weight.
Format: u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the data.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

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


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor or file, expected vs found."""


class SafetensorsFile:
    """Lazy view of one .safetensors file: `header[name]` -> (dtype, shape), `tensor(name)` -> memmap view."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated (no header length)")
            (n,) = struct.unpack("<Q", raw)
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated header (needs {8 + n} bytes, file has {size})")
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + n
        self.header = {}
        for name, h in header.items():
            if h["dtype"] not in DTYPES:
                raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {h['dtype']}")
            begin, end = h["data_offsets"]
            dt = DTYPES[h["dtype"]]
            want = dt.itemsize * int(np.prod(h["shape"], dtype=np.int64))
            if end - begin != want:
                raise CheckpointError(f"{path}: tensor {name} spans {end - begin} bytes, shape {h['shape']} needs {want}")
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


def open_checkpoint(model_dir: str) -> dict[str, SafetensorsFile]:
    """Tensor name -> the file holding it, from model.safetensors.index.json or a single model.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files: dict[str, SafetensorsFile] = {}
        where = {}
        for name, fname in weight_map.items():
            path = os.path.join(model_dir, fname)
            if fname not in files:
                if not os.path.exists(path):
                    raise CheckpointError(f"shard {path} named in {index} (for {name}) does not exist")
                files[fname] = SafetensorsFile(path)
            if name not in files[fname].header:
                raise CheckpointError(f"{index} maps {name} to {fname}, which does not hold it")
            where[name] = files[fname]
        for fname, sf in files.items():
            for name in sf.header:
                if name not in weight_map:
                    raise CheckpointError(f"{fname} holds {name}, which the index does not list")
        return where
    if os.path.exists(single):
        sf = SafetensorsFile(single)
        return {name: sf for name in sf.header}
    raise CheckpointError(f"{model_dir}: neither model.safetensors.index.json nor model.safetensors")
