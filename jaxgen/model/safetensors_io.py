"""Reading Hugging Face checkpoints: ``config.json`` plus single or sharded safetensors.

The safetensors format is an 8-byte little-endian header length, a JSON header mapping tensor
names to dtype/shape/byte range, then raw bytes. We parse it ourselves (memory-mapped) so that
every defect -- truncation, bad header, out-of-range offsets -- is reported with the file name.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from jaxgen.model.errors import ModelLoadError

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


class SafetensorsFile:
    """Lazily reads tensors from one ``.safetensors`` file."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ModelLoadError(f"{path}: truncated safetensors file ({size} bytes)")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > size - 8:
                    raise ModelLoadError(
                        f"{path}: corrupt or truncated safetensors file: header claims "
                        f"{header_len} bytes but the file has {size}"
                    )
                header = json.loads(f.read(header_len))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: cannot read safetensors header: {e}") from e
        if not isinstance(header, dict):
            raise ModelLoadError(f"{path}: safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries = header
        data_size = size - self._data_start
        for name, entry in header.items():
            try:
                dtype = _DTYPES[entry["dtype"]]
                start, end = entry["data_offsets"]
                nbytes = int(np.prod(entry["shape"])) * np.dtype(dtype).itemsize
            except (KeyError, TypeError, ValueError) as e:
                raise ModelLoadError(f"{path}: bad header entry for tensor {name!r}: {e}") from e
            if end > data_size or end - start != nbytes:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} needs bytes [{start}, {end}) of the data section "
                    f"but it has {data_size} bytes (file truncated or corrupt)"
                )
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r") if header else None

    def keys(self):
        return self._entries.keys()

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        start, end = entry["data_offsets"]
        raw = self._mmap[self._data_start + start : self._data_start + end]
        return raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])


class HFCheckpoint:
    """An HF model directory: ``config.json`` and ``*.safetensors`` (optionally sharded)."""

    def __init__(self, directory: str):
        self.directory = directory
        config_path = os.path.join(directory, "config.json")
        if not os.path.isfile(config_path):
            raise ModelLoadError(
                f"{directory}: no config.json (not a Hugging Face model directory)"
            )
        try:
            with open(config_path) as f:
                self.config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{config_path}: cannot parse: {e}") from e
        index_path = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise ModelLoadError(f"{index_path}: cannot parse: {e}") from e
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
            weight_map = None
        if not files:
            raise ModelLoadError(
                f"{directory}: no *.safetensors weights found (only safetensors are supported; "
                "convert .bin checkpoints with transformers' save_pretrained first)"
            )
        self._files = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise ModelLoadError(f"{path}: listed in the index but missing")
            self._files[name] = SafetensorsFile(path)
        self._where = weight_map or {
            key: name for name, sf in self._files.items() for key in sf.keys()
        }

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._where)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise ModelLoadError(
                f"{self.directory}: tensor {name!r} is missing from the checkpoint"
            )
        return self._files[self._where[name]].get(name)

    def file_of(self, name: str) -> str:
        return os.path.join(self.directory, self._where.get(name, "?"))
