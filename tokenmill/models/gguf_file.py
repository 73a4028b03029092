"""A small, fast GGUF reader: metadata as plain Python values, tensors as memory-mapped bytes.

The ``gguf`` package's reader builds an object per array element, which takes ~18 s on a
262k-token vocabulary; this one parses the same header in well under a second. Tensor types and
block sizes still come from ``gguf.constants``; unpacking is in ``tokenmill.quant.gguf_blocks``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?"}
_NUMPY |= {10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dim first), e.g. [rows, cols]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    num_bytes: int

    @property
    def type_name(self) -> str:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name


class GGUFFile:
    """Parses a GGUF file's header once; ``tensor_bytes`` views tensor data through one mmap."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic at its start)")
            try:
                self.metadata, self.tensors = _parse_header(f)
            except (struct.error, UnicodeDecodeError, KeyError) as e:
                raise ValueError(f"{self.path} is a damaged GGUF file: {e}") from e
        self._mmap: np.memmap | None = None

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}

    def tensor_bytes(self, tensor: GGUFTensor) -> np.ndarray:
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap[tensor.offset : tensor.offset + tensor.num_bytes]


def _parse_header(f: BinaryIO) -> tuple[dict[str, Any], list[GGUFTensor]]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    version, num_tensors, num_kv = struct.unpack("<IQQ", f.read(20))
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old (need 2 or newer)")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = _read_string(f)
        (value_type,) = struct.unpack("<I", f.read(4))
        metadata[key] = _read_value(f, value_type)
    infos = []
    for _ in range(num_tensors):
        name = _read_string(f)
        (num_dims,) = struct.unpack("<I", f.read(4))
        dims = struct.unpack(f"<{num_dims}Q", f.read(8 * num_dims))
        ggml_type, offset = struct.unpack("<IQ", f.read(12))
        infos.append((name, dims, ggml_type, offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-f.tell() // alignment) * alignment
    tensors = []
    for name, dims, ggml_type, offset in infos:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        num_elements = int(np.prod(dims)) if dims else 1
        tensors.append(
            GGUFTensor(
                name=name,
                shape=tuple(int(d) for d in reversed(dims)),
                ggml_type=ggml_type,
                offset=data_start + offset,
                num_bytes=num_elements // block * type_size,
            )
        )
    return metadata, tensors


def _read_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, value_type: int) -> Any:
    if value_type == _STRING:
        return _read_string(f)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type == _STRING:
            out = []
            read = f.read
            for _ in range(count):
                (n,) = struct.unpack("<Q", read(8))
                out.append(read(n).decode("utf-8", errors="replace"))
            return out
        if item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[item_type])
            return np.frombuffer(f.read(dtype.itemsize * count), dtype=dtype).tolist()
        return [_read_value(f, item_type) for _ in range(count)]
    fmt, size = _SCALARS[value_type]
    return struct.unpack(fmt, f.read(size))[0]


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Unpack one tensor to float32 ``shape``.

    Float types are reinterpreted; Q4_0/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K are unpacked in torch
    (tokenmill.quant.gguf_blocks, several times faster than numpy); any other type goes through
    the ``gguf`` package's numpy reference.
    """
    from gguf.constants import GGMLQuantizationType as T

    from tokenmill.quant.gguf_blocks import BLOCK_FORMATS

    if ggml_type == T.F32:
        return torch.from_numpy(data.view(np.float32).copy()).view(shape)
    if ggml_type in (T.F16, T.BF16):
        raw = torch.from_numpy(data.view(np.int16).copy())
        dtype = torch.float16 if ggml_type == T.F16 else torch.bfloat16
        return raw.view(dtype).float().view(shape)
    if ggml_type in BLOCK_FORMATS:
        _, block_bytes, unpack = BLOCK_FORMATS[ggml_type]
        blocks = torch.from_numpy(np.array(data)).view(-1, block_bytes)
        return unpack(blocks).view(shape)
    from gguf.quants import dequantize as np_dequantize

    array = np_dequantize(np.asarray(data), T(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).view(shape)
