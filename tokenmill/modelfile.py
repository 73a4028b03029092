"""What a model file says before anything is loaded: a GGUF's header (metadata and tensor
infos) and a Hugging Face directory's config and safetensors headers, summed up for
``tokenmill models`` / ``tokenmill show`` and for the memory check before a load.

No torch and no numpy: the header is read through one mmap with ``struct`` (the ``gguf``
package's reader builds an object per array element, ~20 s on a 262k-token vocabulary; this
reads the same header in ~0.2 s). Tensor data is not touched; models/gguf_file.py maps it.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts; llama.cpp dropped it in 2023
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dim first), e.g. [rows, cols]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    num_bytes: int

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


def read_gguf(path: str | Path, prefixes: Iterable[str] | None = None) -> GGUFHeader:
    """A GGUF file's metadata (only keys starting with one of ``prefixes``, if given) and
    tensor infos. ValueError for a file that is not GGUF or is damaged: every length, count,
    type id and tensor extent is checked against the file before it is used, so a hostile file
    cannot make the reader allocate, loop or map past what the file holds."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ValueError(f"{path} is not a GGUF file (it is empty)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _HeaderParser(buf, str(path)).parse(
                    None if prefixes is None else tuple(prefixes)
                )
    except (struct.error, UnicodeDecodeError, KeyError, IndexError, OverflowError) as e:
        raise ValueError(f"{path} is a damaged GGUF file: {e}") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None


_MAX_DIMS = 4  # GGML_MAX_DIMS


class _HeaderParser:
    """A cursor over a GGUF header."""

    def __init__(self, buf: mmap.mmap, name: str) -> None:
        self._buf = buf
        self._name = name
        self._offset = 0
        self._endian = "<"

    def parse(self, prefixes: tuple[str, ...] | None) -> GGUFHeader:
        if self._buf[:4] != _GGUF_MAGIC:
            raise ValueError(f"{self._name} is not a GGUF file (no GGUF magic at its start)")
        self._offset = 4
        version = self._scalar("I")
        if version & 0xFFFF == 0:  # a big-endian file read as little-endian: 3 -> 0x03000000
            self._endian = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"{self._name}: unsupported GGUF version {version} (need 2 or 3)")
        num_tensors = self._scalar("Q")
        num_kvs = self._scalar("Q")
        # Each key takes at least 12 bytes, each tensor info at least 24: larger counts than the
        # file can hold are damage (and would otherwise loop until the reads run out).
        self._check_fits(num_kvs, 12, "metadata key count")
        metadata: dict[str, Any] = {}
        for _ in range(num_kvs):
            key = self._string()
            value_type = self._value_type(f"key {key!r}")
            if prefixes is None or key.startswith(prefixes):
                metadata[key] = self._value(value_type, key)
            else:
                self._skip(value_type, key)
        self._check_fits(num_tensors, 24, "tensor count")
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            num_dims = self._scalar("I")
            if num_dims > _MAX_DIMS:
                raise ValueError(
                    f"{self._name} is a damaged GGUF file: tensor {name!r} has {num_dims} "
                    f"dimensions (at most {_MAX_DIMS})"
                )
            dims = struct.unpack_from(f"{self._endian}{num_dims}Q", self._buf, self._offset)
            self._offset += 8 * num_dims
            ggml_type, offset = self._scalar("I"), self._scalar("Q")
            infos.append((name, dims, ggml_type, offset))
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(
                f"{self._name} is a damaged GGUF file: general.alignment {alignment!r} is not a "
                "power of two"
            )
        data_start = -(-self._offset // alignment) * alignment
        file_size = len(self._buf)
        tensors = []
        for name, dims, ggml_type, offset in infos:
            tensors.append(self._tensor(name, dims, ggml_type, offset, data_start, alignment))
            end = tensors[-1].offset + tensors[-1].num_bytes
            if end > file_size:
                raise ValueError(
                    f"{self._name} is a damaged GGUF file: tensor {name!r} (bytes "
                    f"{tensors[-1].offset}..{end}) lies past the end of the file ({file_size} "
                    "bytes): truncated, or a wrong offset or shape"
                )
        return GGUFHeader(metadata, tensors)

    def _tensor(
        self,
        name: str,
        dims: tuple[int, ...],
        ggml_type: int,
        offset: int,
        data_start: int,
        alignment: int,
    ) -> TensorInfo:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(
                f"{self._name}: tensor {name!r} has an unknown tensor type id {ggml_type}"
            ) from None
        if offset % alignment:
            raise ValueError(
                f"{self._name} is a damaged GGUF file: tensor {name!r}'s offset {offset} is not "
                f"aligned to {alignment} bytes"
            )
        elements = 1
        for d in dims:
            elements *= d
        if elements % block:
            raise ValueError(
                f"{self._name} is a damaged GGUF file: tensor {name!r} has {elements} elements, "
                f"not a multiple of its type's block of {block}"
            )
        return TensorInfo(
            name=name,
            shape=tuple(int(d) for d in reversed(dims)),
            ggml_type=ggml_type,
            offset=data_start + offset,
            num_bytes=elements // block * type_size,
        )

    def _check_fits(self, count: int, min_item_bytes: int, what: str) -> None:
        left = len(self._buf) - self._offset
        if count * min_item_bytes > left:
            raise ValueError(
                f"{self._name} is a damaged GGUF file: {what} {count} at byte {self._offset} "
                f"runs past the end of the file ({left} bytes left)"
            )

    def _value_type(self, where: str) -> GGUFValueType:
        raw = self._scalar("I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(
                f"{self._name} is a damaged GGUF file: unknown metadata value type {raw} at {where}"
            ) from None

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self._endian + fmt, self._buf, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("Q")
        self._check_fits(length, 1, "string length")
        start = self._offset
        self._offset += length
        return self._buf[start : self._offset].decode("utf-8", errors="replace")

    def _array_header(self, key: str) -> tuple[GGUFValueType, int]:
        item_type = self._value_type(f"key {key!r} (array items)")
        count = self._scalar("Q")
        size = struct.calcsize(_SCALAR_FORMATS[item_type]) if item_type in _SCALAR_FORMATS else 8
        self._check_fits(count, size, f"key {key!r}: array count")
        return item_type, count

    def _value(self, value_type: GGUFValueType, key: str) -> Any:
        if value_type == GGUFValueType.STRING:
            return self._string()
        if value_type != GGUFValueType.ARRAY:
            return self._scalar(_SCALAR_FORMATS[value_type])
        item_type, count = self._array_header(key)
        if item_type in _SCALAR_FORMATS:
            fmt = f"{self._endian}{count}{_SCALAR_FORMATS[item_type]}"
            values = list(struct.unpack_from(fmt, self._buf, self._offset))
            self._offset += struct.calcsize(fmt)
            return values
        if item_type == GGUFValueType.STRING:
            return self._strings(count, keep=True)
        return [self._value(item_type, key) for _ in range(count)]

    def _strings(self, count: int, keep: bool) -> list[str]:
        """``count`` strings in a row (a vocabulary: 262k for Gemma), in one tight loop: 3-4x
        faster than a ``_string`` call each. ``keep=False`` skips them, returning []."""
        buf, offset, end = self._buf, self._offset, len(self._buf)
        unpack = struct.Struct(self._endian + "Q").unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (length,) = unpack(buf, offset)
            offset += 8
            if length > end - offset:
                self._offset = offset
                self._check_fits(length, 1, "string length")
            if keep:
                append(buf[offset : offset + length].decode("utf-8", errors="replace"))
            offset += length
        self._offset = offset
        return out

    def _skip(self, value_type: GGUFValueType, key: str) -> None:
        if value_type in _SCALAR_FORMATS:
            self._offset += struct.calcsize(_SCALAR_FORMATS[value_type])
        elif value_type == GGUFValueType.STRING:
            length = self._scalar("Q")
            self._check_fits(length, 1, "string length")
            self._offset += length
        else:
            item_type, count = self._array_header(key)
            if item_type in _SCALAR_FORMATS:
                self._offset += count * struct.calcsize(_SCALAR_FORMATS[item_type])
            elif item_type == GGUFValueType.STRING:
                self._strings(count, keep=False)
            else:
                for _ in range(count):
                    self._skip(item_type, key)


# ---- summaries ------------------------------------------------------------------------------

# llama.cpp's llama_ftype (general.file_type) -> its name.
GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
}  # fmt: skip

# Resident bytes a weight of each GGUF type takes once loaded (the packed layouts of
# quant/packed.py: codes, then a float16 or float32 scale, and a float32 offset, per group);
# types tokenmill does not keep packed are dequantized to float32.
RESIDENT_BYTES_PER_WEIGHT = {
    "F16": 2,  # kept as halves (csrc/half.c)
    "BF16": 2,
    "Q8_0": 1 + 2 / 32,  # int8 codes, float16 scale / 32
    "Q5_0": 0.625 + 2 / 32,  # 5-bit codes ("q5": 4 bits and a bit plane), float16 scale / 32
    "Q4_0": 0.5 + 2 / 32,  # 4-bit codes + 8 (a zero point), float16 scale / 32
    "Q4_1": 0.5 + (2 + 4) / 32,  # 4-bit codes, float16 scale and float32 offset / 32
    "Q5_1": 0.625 + (2 + 4) / 32,  # 5-bit codes, float16 scale and float32 offset / 32
    "Q4_K": 144 / 256,  # the file's super-blocks, re-laid (csrc/qgemm.c's q4k kind)
    "Q5_K": 176 / 256,  # the file's super-blocks, re-laid (q5k)
    "Q6_K": 210 / 256,  # the file's super-blocks, re-laid (q6k)
    "Q2_K": 84 / 256,  # the file's super-blocks, codes in planes (q2)
    "Q3_K": 110 / 256,  # the same (q3)
    "IQ4_NL": 0.5 + 2 / 32,  # 4-bit table indices, float16 scale / 32
    "IQ4_XS": 136 / 256,  # the file's super-blocks, re-laid (n4k)
    # gpt-oss's experts, on a CPU: its 4-bit indices and a float16 scale / 32 ("m4",
    # quant/mxfp4.py); its own bytes (17 / 32) elsewhere
    "MXFP4": 0.5 + 2 / 32,
}
FLOAT32_BYTES = 4.0
# Tensors kept float whatever their type (norms, biases: 1-D) count as float32.


@dataclass(slots=True)
class ModelSummary:
    """A model file's vital figures, read from its headers."""

    path: Path
    format: str  # "gguf" | "hf"
    architecture: str  # as the file names it (GGUF general.architecture, HF model_type)
    num_parameters: int
    context_length: int
    file_bytes: int
    file_type: str | None  # a GGUF's llama.cpp file type ("Q4_K_M"), or the HF dtype
    parameters_by_type: dict[str, int]  # tensor type -> parameters stored in it
    weight_bytes_estimate: int  # resident once loaded as stored (see RESIDENT_BYTES_PER_WEIGHT)
    kv_bytes_per_token: int  # float32 K and V over all layers (the CPU default)
    chat_template: str | None
    tokenizer: str  # "gguf:llama", "gguf:gpt2 (llama-bpe)", "tokenizer.json", ...
    num_experts: int  # a mixture of experts' experts per layer (0: dense)
    experts_used: int  # and how many each token runs
    metadata: dict[str, Any] = field(default_factory=dict)  # scalars and short lists only
    # Hybrid models: a request's linear-attention state over all such layers, float32 (0: none).
    state_bytes_per_request: int = 0


def summarize(path: str | Path) -> ModelSummary:
    """The summary of a GGUF file or a Hugging Face directory; ValueError naming what is wrong
    (missing, not a model, damaged)."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _summarize_hf(path)
    if not path.exists():
        raise ValueError(f"no such model file or directory: {path}")
    return _summarize_gguf(path)


def resident_weight_bytes(tensors: list[TensorInfo]) -> int:
    """Bytes a GGUF's tensors take once loaded as stored (RESIDENT_BYTES_PER_WEIGHT)."""
    total = 0.0
    for t in tensors:
        per = RESIDENT_BYTES_PER_WEIGHT.get(t.type_name) if len(t.shape) > 1 else None
        total += t.num_elements * (per or FLOAT32_BYTES)
    return int(total)


def _summarize_gguf(path: Path) -> ModelSummary:
    header = read_gguf(path)
    md = header.metadata
    arch = md.get("general.architecture", "?")
    by_type: dict[str, int] = {}
    for t in header.tensors:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.num_elements
    layers = int(md.get(f"{arch}.block_count", 0))
    heads = int(md.get(f"{arch}.attention.head_count", 1) or 1)
    kv_heads = md.get(f"{arch}.attention.head_count_kv", heads)
    kv_heads = kv_heads if isinstance(kv_heads, int) else max(kv_heads)
    hidden = int(md.get(f"{arch}.embedding_length", 0))
    head_dim = int(md.get(f"{arch}.attention.key_length") or (hidden // heads if heads else 0))
    pre = md.get("tokenizer.ggml.pre")
    model = md.get("tokenizer.ggml.model", "?")
    return ModelSummary(
        path=path,
        format="gguf",
        architecture=arch,
        num_parameters=sum(by_type.values()),
        context_length=int(md.get(f"{arch}.context_length", 0)),
        file_bytes=path.stat().st_size,
        file_type=GGUF_FILE_TYPES.get(md.get("general.file_type", -1)),
        parameters_by_type=by_type,
        weight_bytes_estimate=resident_weight_bytes(header.tensors),
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * 4,
        chat_template=md.get("tokenizer.chat_template"),
        tokenizer=f"gguf:{model}" + (f" ({pre})" if pre else ""),
        num_experts=int(md.get(f"{arch}.expert_count", 0) or 0),
        experts_used=int(md.get(f"{arch}.expert_used_count", 0) or 0),
        metadata={k: v for k, v in md.items() if not isinstance(v, list) or len(v) <= 16},
    )


def _summarize_hf(path: Path) -> ModelSummary:
    config_path = path / "config.json"
    if not config_path.exists():
        raise ValueError(f"model directory {path} has no config.json")
    try:
        cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    text = cfg.get("text_config") or cfg
    by_type: dict[str, int] = {}
    matrix_types: dict[str, int] = {}
    for _, n, shape, dtype in safetensors_tensors(path):
        by_type[dtype] = by_type.get(dtype, 0) + n
        if len(shape) == 2:
            matrix_types[dtype] = matrix_types.get(dtype, 0) + n
    heads = int(text.get("num_attention_heads", 1) or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or text.get("hidden_size", 0) // heads)
    layers = int(text.get("num_hidden_layers", 0))
    kv_layers, state_bytes = _hf_hybrid_layers(text, layers)
    template = None
    tokenizer_config = path / "tokenizer_config.json"
    if tokenizer_config.exists():
        template = json.loads(tokenizer_config.read_text()).get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    params = sum(by_type.values())
    return ModelSummary(
        path=path,
        format="hf",
        architecture=str(text.get("model_type", "?")),
        num_parameters=params,
        context_length=int(text.get("max_position_embeddings", 0)),
        file_bytes=sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        file_type=str(cfg.get("torch_dtype") or cfg.get("dtype") or "") or None,
        parameters_by_type=by_type,
        weight_bytes_estimate=_hf_resident_bytes(params, matrix_types),
        kv_bytes_per_token=2 * kv_layers * kv_heads * head_dim * 4,
        chat_template=template,
        tokenizer="tokenizer.json" if (path / "tokenizer.json").exists() else "?",
        num_experts=int(text.get("num_local_experts") or text.get("num_experts") or 0),
        experts_used=int(text.get("num_experts_per_tok") or 0),
        metadata={k: v for k, v in text.items() if not isinstance(v, (dict, list))},
        state_bytes_per_request=state_bytes,
    )


def _hf_hybrid_layers(text: dict[str, Any], layers: int) -> tuple[int, int]:
    """(layers that keep K/V, a request's recurrent-state bytes): a hybrid model's
    linear-attention layers (Qwen3-Next, Qwen3.5) keep a fixed state instead of K/V."""
    if "linear_num_value_heads" not in text:
        return layers, 0
    types = text.get("layer_types") or []
    if types:
        linear = sum(t == "linear_attention" for t in types)
    else:
        linear = layers - layers // int(text.get("full_attention_interval", 4))
    nk, nv = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    dk, dv = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
    taps = int(text.get("linear_conv_kernel_dim", 4))
    conv = (2 * nk * dk + nv * dv) * (taps - 1)
    return layers - linear, linear * (conv + nv * dk * dv) * 4


def _hf_resident_bytes(params: int, matrix_types: dict[str, int]) -> int:
    """Float weights on a CPU: float32, but matrices all stored in one 16-bit float dtype stay
    its halves (quant/half.py), and fp8 matrices a byte a weight (quant/fp8.py)."""
    fp8 = matrix_types.get("F8_E4M3", 0)
    if fp8:
        return int(fp8 * 1 + (params - fp8) * FLOAT32_BYTES)
    if len(matrix_types) == 1 and next(iter(matrix_types)) in ("BF16", "F16"):
        halves = next(iter(matrix_types.values()))
        return int(halves * 2 + (params - halves) * FLOAT32_BYTES)
    return int(params * FLOAT32_BYTES)


def safetensors_tensors(model_dir: Path) -> list[tuple[str, int, tuple[int, ...], str]]:
    """(name, elements, shape, dtype) of every tensor in a directory's safetensors files."""
    out = []
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, entry in _safetensors_header(file).items():
            if not isinstance(entry, dict) or "dtype" not in entry:
                continue  # __metadata__
            n = 1
            for d in entry["shape"]:
                n *= d
            out.append((name, n, tuple(entry["shape"]), entry["dtype"]))
    return out


def _safetensors_header(file: Path) -> dict[str, Any]:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets}."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(length))
    except (OSError, struct.error, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from None


__all__ = [
    "GGUF_FILE_TYPES",
    "GGUFHeader",
    "ModelSummary",
    "TensorInfo",
    "read_gguf",
    "resident_weight_bytes",
    "summarize",
]
