"""A GGUF file's tensors as memory-mapped bytes, and their unpacking to float32.

The header (metadata, tensor infos) is read by tokenmill/modelfile.py; unpacking of the block
formats is in ``tokenmill.quant.gguf_blocks``.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch

from tokenmill.modelfile import TensorInfo, read_gguf

# The header's tensor info (name, torch-order shape, ggml type, absolute offset, bytes).
GGUFTensor = TensorInfo


class GGUFFile:
    """A GGUF file's header (tokenmill/modelfile.py), and its tensor data through one mmap."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        header = read_gguf(self.path)
        self.metadata, self.tensors = header.metadata, header.tensors
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

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the tensor's pages of the map from this process's memory (they are read from
        the file again if touched: the map is read-only); the whole pages inside it only."""
        if self._mmap is None:
            return
        page = mmap.PAGESIZE
        start = -(-(self._mmap.offset + tensor.offset) // page) * page - self._mmap.offset
        end = (tensor.offset + tensor.num_bytes) // page * page
        if end > start:
            self._mmap._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Unpack one tensor to float32 ``shape``.

    Float types are reinterpreted; Q4_0/Q5_0/Q8_0/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K are unpacked in torch
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
