"""A GGUF file's header and tensors, read without the `gguf` package's reader.

That reader keeps a numpy view of the memory map for every value of every metadata array: for
Gemma 3's 262,144 tokenizer tokens (each with its score and type) it holds ~650 MiB, four times
the file's weights at the peak of a load. Here the header is parsed once from a memory map that
is closed afterwards; arrays of strings (the tokenizer's, which transformers reads on its own)
are skipped, numeric arrays become lists. A tensor's bytes are read with `readinto` into memory
of our own, one tensor at a time: pages of a memory map would count in the process's memory for
as long as the map lives. Values are returned as the `gguf` package's reader returns them (its
quantization type enum, numpy arrays shaped as its `data`), so its dequantizers take them.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_ELEMENTS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}  # other types are blocks: uint8 rows


class SkippedValue:
    """An array of strings the header parse skipped (the tokenizer's vocabulary, merges)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: shape[0] is a row's length
    n_bytes: int
    data_offset: int  # in the file


class GGUFReader:
    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            header = _Header(view)
            if header.take("<4s") != b"GGUF":
                raise ValueError("not a GGUF file (bad magic)")
            version, tensor_count, field_count = header.take("<I"), header.take("<Q"), header.take("<Q")
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
            self.fields = {}
            for _ in range(field_count):
                key = header.string()
                self.fields[key] = header.value(header.take("<I"))
            infos = [header.tensor_info() for _ in range(tensor_count)]
            alignment = self.fields.get("general.alignment", 32)
            start = -(-header.at // alignment) * alignment
        self.tensors = [TensorInfo(name, kind, shape, _n_bytes(kind, shape), start + offset)
                        for name, kind, shape, offset in infos]

    def read(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's data, shaped as the `gguf` reader's: elements [..., shape[0]] for plain types,
        uint8 rows of blocks [..., row bytes] for block formats."""
        data = np.empty(tensor.n_bytes, np.uint8)
        with open(self.path, "rb") as f:
            f.seek(tensor.data_offset)
            if f.readinto(memoryview(data)) != tensor.n_bytes:
                raise ValueError(f"GGUF file {self.path!r} ends inside tensor {tensor.name!r}")
        rows = tuple(reversed(tensor.shape))
        element = _ELEMENTS.get(tensor.tensor_type)
        return data.view(element).reshape(rows) if element else data.reshape(*rows[:-1], -1)


def _n_bytes(kind: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block_size, type_size = GGML_QUANT_SIZES[kind]
    return int(np.prod(shape)) * type_size // block_size


class _Header:
    """A cursor over the header's bytes."""

    def __init__(self, view: mmap.mmap):
        self.view, self.at = view, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.view, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        self.at += length
        return bytes(self.view[self.at - length:self.at]).decode("utf-8")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"GGUF metadata value type {kind} is not defined")
        item, count = self.take("<I"), self.take("<Q")
        if item == _STRING:
            for _ in range(count):
                length = self.take("<Q")  # read before adding: take() moves the cursor itself
                self.at += length
            return SkippedValue()
        if item in _SCALARS:
            size = struct.calcsize(_SCALARS[item])
            values = np.frombuffer(self.view, _SCALARS[item], count, self.at).tolist()
            self.at += size * count
            return values
        return [self.value(item) for _ in range(count)]  # arrays of arrays

    def tensor_info(self) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
        name = self.string()
        shape = tuple(self.take("<Q") for _ in range(self.take("<I")))
        return name, GGMLQuantizationType(self.take("<I")), shape, self.take("<Q")
