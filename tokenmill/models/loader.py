"""Build a model and stream its weights in, from safetensors or GGUF, one tensor at a time.

GGUF tensors are renamed to the Hugging Face names the model files use, and two llama.cpp
conventions are undone: Gemma 2/3 norm weights are stored as 1 + w (Gemma 4's as they are), and
Llama-family q/k rows are permuted for llama.cpp's interleaved RoPE. A mixture of experts'
stacked 3-D tensors (``ffn_gate_exps`` [E, I, H]) keep their block format as one packed [E·I, H]
weight, named ``mlp.experts.gate_proj.weight`` (moe/experts.py); Gemma 4's fused
``ffn_gate_up_exps`` [E, 2I, H] is split into its gate and up stacks.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from tokenmill.architectures import HYBRID_ARCHITECTURES
from tokenmill.attention.backends import create_attention_backend
from tokenmill.config import ModelConfig, config_from_gguf, config_from_hf
from tokenmill.kernels import cpu_library, create_kernel_backend, default_kernel_backend
from tokenmill.layers import Embedding, FusedLinear, Linear
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.memory import release_freed_memory
from tokenmill.models import gguf_cache
from tokenmill.models.base import CausalLM
from tokenmill.models.gguf_file import GGUFFile, GGUFTensor, dequantize
from tokenmill.models.registry import get_model_class
from tokenmill.moe import FusedMoE
from tokenmill.quant.base import QuantMethod
from tokenmill.quant.fp8 import Fp8QuantMethod, fp8_tensors
from tokenmill.quant.gguf import PackedQuantMethod, PackedState
from tokenmill.quant.gguf_blocks import BLOCK_CODES
from tokenmill.quant.mxfp4 import GGML_MXFP4, Mxfp4Weight
from tokenmill.quant.packed import (
    HALF_GGML_TYPES,
    GGUFBlocks,
    PackedWeight,
    pack_gguf,
    pack_half,
)
from tokenmill.resolve import ModelSource

T = TypeVar("T", torch.Tensor, PackedWeight, GGUFBlocks)

logger = logging.getLogger(__name__)

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    # Mixtures of experts: the router, the stacked experts, Qwen2-MoE's shared expert.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_sinks": "self_attn.sinks",  # gpt-oss
}
# Hybrid models' linear-attention tensors (llama.cpp's ssm_* names; Qwen3-Next's converter
# already splits its fused q/k/v/z into attn_qkv and attn_gate, and keeps [b|a] as ssm_ba).
_HYBRID_NAMES = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Gemma 4's tensors, by their name after ``blk.N.`` (llama.cpp's -> transformers'): the layer
# scalar, the per-layer-embedding input, and beside the MLP the experts' norms, router (its
# scales as ``.scale`` tensors) and experts, gate and up fused (models/gemma4.py).
_GEMMA4_NAMES = {
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
}
_GEMMA4_GLOBALS = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
# The architectures whose q/k rows llama.cpp's converter permutes for its interleaved RoPE.
ROPE_PERMUTED = ("llama", "mistral", "mixtral", "smollm3")
# Tensors kept float whatever their type in the file: the routers (tiny, and they pick experts).
_FLOAT_ONLY = ("ffn_gate_inp", "ffn_gate_inp_shexp")


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.format == "hf":
        return config_from_hf(source.path)
    gguf_file = GGUFFile(source.path)
    factors = {
        t.name.removesuffix(".weight"): tuple(
            dequantize(gguf_file.tensor_bytes(t), t.ggml_type, t.shape).reshape(-1).tolist()
        )
        for t in gguf_file.tensors
        # Phi-3's LongRoPE factors; Gemma 4's proportional RoPE as per-pair factors.
        if t.name in ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")
    }
    types = {t.name: t.ggml_type for t in gguf_file.tensors}
    config = config_from_gguf(
        source.path, gguf_file.metadata, gguf_file.tensor_names(), factors, types
    )
    _check_gguf_shapes(config, gguf_file)
    return config


def _check_gguf_shapes(config: ModelConfig, gguf_file: GGUFFile) -> None:
    """The metadata's dimensions against the tensors that carry them, before a model of those
    dimensions is built: a broken or hostile file (a million heads, a 10**9 key length) would
    otherwise allocate for them, or fail deep inside a layer."""
    shapes = {t.name: t.shape for t in gguf_file.tensors}
    hidden = config.hidden_size
    expected = {
        "token_embd.weight": (config.vocab_size, hidden),
        "blk.0.attn_q.weight": (config.num_attention_heads * config.head_dim, hidden),
        "blk.0.attn_k.weight": (config.num_key_value_heads * config.head_dim, hidden),
        "blk.0.attn_v.weight": (config.num_key_value_heads * config.head_dim, hidden),
        "blk.0.attn_qkv.weight": (
            (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim,
            hidden,
        ),
    }
    if config.hidden_size_per_layer_input:  # Gemma 4's per-layer embeddings
        expected["per_layer_token_embd.weight"] = (
            config.vocab_size_per_layer_input,
            config.num_hidden_layers * config.hidden_size_per_layer_input,
        )
    for name, shape in expected.items():
        if name in shapes and tuple(shapes[name]) != shape:
            raise ValueError(
                f"{gguf_file.path}: tensor {name!r} has shape {tuple(shapes[name])}, but the "
                f"metadata describes {shape} (vocabulary, heads, head and hidden sizes)"
            )


def load_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    quant_method: QuantMethod | None = None,
    importance: dict[str, torch.Tensor] | None = None,
    kernels: str | None = None,
) -> CausalLM:
    """Instantiate the architecture with uninitialized parameters, then stream weights in.

    With a ``quant_method``, every Linear (and a tied output head) is packed after loading;
    ``importance`` (worker/calibration.py) maps layer names to their inputs' mean squares.
    ``kernels`` names the kernel and attention backends the model computes with (kernels/,
    attention/backends/: "torch", "cpu"); None picks ``default_kernel_backend(device)``.
    """
    assert config.source is not None
    backend = kernels or default_kernel_backend(device)
    key = gguf_cache.model_key(
        config, dtype, device, max_position, quant_method, importance, backend
    )
    model = gguf_cache.load(key) if key is not None else None
    if model is not None:  # saved at some context length: the RoPE tables of this one
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.resize_(max_position)
    if model is None:
        model = _build_and_load(config, dtype, device, max_position, quant_method, importance)
        if key is not None:
            gguf_cache.save(key, model)
    model.bind_kernels(create_kernel_backend(backend), create_attention_backend(backend))
    release_freed_memory()
    if _keeps_gguf_packed(config, quant_method) and config.tp.size == 1:
        held, stored = model.weight_nbytes(), gguf_weight_bytes(config)
        logger.info(
            "weights held: %.1f MB, the file's tensors %.1f MB (%.3fx)",
            held / 1e6,
            stored / 1e6,
            held / max(stored, 1),
        )
    return model.eval()


def _keeps_gguf_packed(config: ModelConfig, quant_method: QuantMethod | None) -> bool:
    """Whether this load keeps a GGUF's quantized tensors as they are stored (packed)."""
    is_gguf = config.source is not None and config.source.format == "gguf"
    return is_gguf and isinstance(quant_method, PackedQuantMethod) and quant_method.name == "gguf"


def gguf_weight_bytes(config: ModelConfig) -> int:
    """Bytes of the GGUF tensors this architecture loads (what a model keeping them as stored
    holds: the weights at the file's bytes)."""
    assert config.source is not None
    tensors = GGUFFile(config.source.path).tensors
    return sum(t.num_bytes for t in tensors if _hf_name(t.name, config.architecture) is not None)


def _build_and_load(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    quant_method: QuantMethod | None,
    importance: dict[str, torch.Tensor] | None,
) -> CausalLM:
    """The model with its weights loaded and laid out for computing, kernels not yet bound."""
    assert config.source is not None
    model_cls = get_model_class(config.architecture)
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(config, max_position)
    finally:
        torch.set_default_dtype(prev_dtype)
    if _keeps_gguf_packed(config, quant_method):
        # The file's quantized tensors go straight into their layers, never as floats.
        weights = _iter_gguf(config, True, model.fused_weights(), model.checkpoint_name)
        model.load_weights(weights, packed_method=quant_method)
    else:
        on_loaded = (
            _StreamingQuantizer(model, quant_method, importance or {})
            if quant_method is not None
            else None
        )
        if config.source.format == "hf" and config.weight_format == "fp8":
            # Kept as stored (quantization fp8), or dequantized for another scheme or none.
            keep = isinstance(quant_method, Fp8QuantMethod)
            tensors = fp8_tensors(_iter_safetensors(config.source.path), config.fp8_block, keep)
            if keep:
                model.load_weights(tensors, packed_method=quant_method)
            else:
                model.load_weights(tensors, on_loaded)
        elif config.source.format == "hf":
            model.load_weights(_iter_safetensors(config.source.path), on_loaded)
        else:
            model.load_weights(_iter_gguf(config), on_loaded)
    for module in model.modules():
        if isinstance(module, Linear):
            module.fold_bias_()
    for module in model.modules():
        if isinstance(module, FusedLinear):  # which parts share a matmul, from what they hold
            module.group_parts_()
        elif isinstance(module, FusedMoE):  # packed experts into stacks, gate with up
            module.stack_()
        else:
            continue
        release_freed_memory()  # the parts just joined: holes the next join cannot fill
    model.after_load(device, quant_method)
    head_state = getattr(model.output_head(), "quant_state", None)
    if isinstance(head_state, PackedState):  # the head's int8 matmul: see PackedState
        head_state.q8_unsigned = True
    return model


class _StreamingQuantizer:
    """Packs each Linear (and a tied embedding, which is also the output head) as soon as all
    its parameters are loaded, so at most one layer's float weights are resident beyond the
    packed model."""

    def __init__(
        self, model: CausalLM, method: QuantMethod, importance: dict[str, torch.Tensor]
    ) -> None:
        self.method = method
        self.importance = importance
        self.pending: dict[str, tuple[nn.Module, set[str]]] = {}
        # By checkpoint names: a fused layer's parts are packed one by one, each by the method
        # for its own name (int4 keeps k_proj / v_proj int8).
        for layer_name, layer in model.checkpoint_layers():
            if isinstance(layer, FusedMoE):  # packed once it has every expert
                for name in layer.checkpoint_loaders(layer_name):
                    self.pending[name] = (layer, set())
                continue
            quantizable = isinstance(layer, Linear) or (
                isinstance(layer, Embedding) and model.config.tie_word_embeddings
            )
            if not quantizable:
                continue
            names = {f"{layer_name}.{p}" for p, _ in layer.named_parameters()}
            for name in names:
                self.pending[name] = (layer, names)

    def __call__(self, name: str) -> None:
        entry = self.pending.pop(name, None)
        if entry is None:
            return
        module, names = entry
        if isinstance(module, FusedMoE):
            if module.fully_loaded:
                experts = name.rpartition(".experts.")[0] + ".experts"
                module.quantize_(self.method.method_for(experts, False))
            return
        if not any(n in self.pending for n in names):
            is_head = isinstance(module, Embedding) or name.startswith("lm_head.")
            module_name = name.rpartition(".")[0]
            module.quantize_(
                self.method.method_for(module_name, is_head), self.importance.get(module_name)
            )


def _iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def _iter_gguf(
    config: ModelConfig,
    keep_packed: bool = False,
    joins: list[tuple[str, ...]] = (),
    rename: Callable[[str], str] = str,
) -> Iterator[tuple[str, torch.Tensor | PackedWeight | GGUFBlocks]]:
    """(HF name, tensor) in file order; with ``keep_packed``, 2-D tensors in a block format
    come as PackedWeight (their codes and scales as stored), or for a tensor-parallel rank as
    GGUFBlocks its layer cuts a shard from; everything else as float. ``joins``: weights
    (by the model's names, ``rename`` of an HF name) whose rows a layer joins, which are then
    re-laid side by side in one tensor where the C re-lay takes them all (_joined_places)."""
    assert config.source is not None
    gguf_file = GGUFFile(config.source.path)
    places: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if keep_packed:
        _warn_unpacked_types(gguf_file)
        places = _joined_places(gguf_file, config, joins, rename)
    since_trim = 0  # bytes of tensors loaded since freed memory last went back
    for tensor in gguf_file.tensors:
        name = _hf_name(tensor.name, config.architecture)
        if name is None:
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        data, place = gguf_file.tensor_bytes(tensor), None
        weight: torch.Tensor | PackedWeight | GGUFBlocks
        float_only = any(f".{part}." in tensor.name for part in _FLOAT_ONLY)
        packable = tensor.ggml_type in BLOCK_CODES or tensor.ggml_type in HALF_GGML_TYPES
        if tensor.ggml_type == GGML_MXFP4 and config.architecture == "gpt_oss":
            # gpt-oss's experts as the file keeps them (a copy out of the map).
            raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)).reshape(-1)
            weight = Mxfp4Weight.from_ggml(raw, tuple(tensor.shape))
        elif keep_packed and packable and len(tensor.shape) in (2, 3) and not float_only:
            with warnings.catch_warnings():  # a read-only map: the bytes are only read
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(data).reshape(-1)  # no copy of the file's bytes
            # A stack of experts [E, N, K] is packed as its E·N rows.
            rows = tensor.shape[0] * (tensor.shape[1] if len(tensor.shape) == 3 else 1)
            if config.tp.size > 1 and len(tensor.shape) == 2:
                # Each tensor-parallel rank packs only the blocks of its shard (its layer cuts).
                weight = GGUFBlocks(raw.view(rows, -1), tensor.ggml_type, tuple(tensor.shape))
            elif tensor.ggml_type in HALF_GGML_TYPES:  # F16 / BF16: kept as halves
                weight = pack_half(raw, tensor.ggml_type, (rows, tensor.shape[-1]))
            else:  # in one pass in C where it re-lays the type, else by the torch code
                shape = (rows, tensor.shape[-1])
                place = places.pop(rename(name), None)
                relaid = cpu_library.relay_gguf(raw, tensor.ggml_type, shape, place)
                weight = relaid or pack_gguf(raw, tensor.ggml_type, shape)
        else:
            weight = dequantize(data, tensor.ggml_type, tensor.shape)
            if tensor.name.endswith("ffn_gate_inp_shexp.weight"):
                weight = weight.reshape(1, -1)  # llama.cpp stores the [1, H] gate as [H]
        if config.architecture in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            weight = weight - 1.0
        if name.endswith(".experts.gate_up_proj"):  # Gemma 4's: [E, 2I, H], gate rows first
            gate, up = _split_gate_up(weight, tensor.shape[0])
            yield name.removesuffix("gate_up_proj") + "gate_proj.weight", gate
            weight, name = up, name.removesuffix("gate_up_proj") + "up_proj.weight"
        if config.linear_attention is not None:  # Qwen3-Next / Qwen3.5 (_HYBRID_NAMES)
            if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                weight = weight - 1.0  # their RMSNorms scale by 1 + w: llama.cpp stores 1 + w
            elif name.endswith("A_log"):
                weight = torch.log(-weight)  # llama.cpp stores A = −exp(A_log)
        if config.architecture in ROPE_PERMUTED:
            in_place = place is not None  # its place in a joined weight
            if name.endswith("q_proj.weight"):
                weight = _unpermute_rope(weight, config.num_attention_heads, in_place)
            elif name.endswith("k_proj.weight"):
                weight = _unpermute_rope(weight, config.num_key_value_heads, in_place)
        yield name, weight
        # Loaded: its pages of the file leave this process's memory, and (every TRIM_BYTES of
        # tensors: a trim walks the whole heap, ~2 ms) the temporaries of packing go back to
        # the OS, so a load's peak stays near what the model holds rather than the model, the
        # file and the freed temporaries together.
        gguf_file.release(tensor)
        since_trim += tensor.num_bytes
        if since_trim >= TRIM_BYTES:
            release_freed_memory()
            since_trim = 0


def _joined_places(
    gguf_file: GGUFFile,
    config: ModelConfig,
    joins: list[tuple[str, ...]],
    rename: Callable[[str], str],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Where to re-lay each part of a joined weight (q/k/v, gate/up) so the parts lie one after
    the other, and the join (quant/packed.concat_rows) is a view rather than a copy: an 8B
    load spent 2.6 s copying parts into joined weights. Within each group of ``joins``, each
    run of two or more consecutive parts of one type the C re-lay takes (``relays``, 2-D)
    goes side by side (_side_by_side); only parts of one layout join (q/k Q4_K beside a Q6_K v:
    q/k), and one tensor then holds codes of one dtype (torch.save of the model takes no
    storage viewed as two). Returns name -> the part's (codes, scales), as
    cpu_library.relay_gguf's ``out``."""
    if config.tp.size > 1 or not cpu_library.available():
        return {}
    by_name = {}
    for tensor in gguf_file.tensors:
        name = _hf_name(tensor.name, config.architecture)
        if name is not None and not any(f".{part}." in tensor.name for part in _FLOAT_ONLY):
            by_name[rename(name)] = tensor

    def type_of(name: str) -> int | None:  # None: not re-laid in C
        t = by_name.get(name)
        ok = t is not None and len(t.shape) == 2 and cpu_library.relays(t.ggml_type, t.shape)
        return t.ggml_type if ok else None

    places: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for names in joins:
        start = 0
        for end in range(1, len(names) + 1):
            if end < len(names) and type_of(names[end]) == type_of(names[start]):
                continue
            if end - start > 1 and type_of(names[start]) is not None:
                places |= _side_by_side(names[start:end], [by_name[n] for n in names[start:end]])
            start = end
    return places


def _side_by_side(
    names: tuple[str, ...], tensors: list[GGUFTensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One uint8 tensor for the re-laid codes of ``tensors`` (GGUF tensors of one type) and one
    for their scales, allocated now (pages come as they are written): name -> the part's
    (codes, scales) rows, one part after the other."""
    shapes = [cpu_library.relayed_bytes(t.ggml_type, tuple(t.shape)) for t in tensors]
    codes = torch.empty(sum(c[0] * c[1] for c, _ in shapes), dtype=torch.uint8)
    scales = torch.empty(sum(s[0] * s[1] for _, s in shapes), dtype=torch.uint8)
    places, at_codes, at_scales = {}, 0, 0
    for name, (codes_shape, scales_shape) in zip(names, shapes):
        n_codes, n_scales = codes_shape[0] * codes_shape[1], scales_shape[0] * scales_shape[1]
        places[name] = (
            codes[at_codes : at_codes + n_codes].view(codes_shape),
            scales[at_scales : at_scales + n_scales].view(scales_shape),
        )
        at_codes, at_scales = at_codes + n_codes, at_scales + n_scales
    return places


# Bytes of GGUF tensors between two hand-backs of freed memory while loading: a first load's
# peak over what the model holds stays about this (measured, Llama 1B shape Q4_K_M: 931 MB at
# the peak against 899 MB loaded, handing back after every tensor).
TRIM_BYTES = 32 << 20

# Float types not kept as stored: F32 (already float32) and F64.
_FLOAT_TYPES = ("F32", "F64")


def _warn_unpacked_types(gguf_file: GGUFFile) -> None:
    """Say which of the file's weight types are not kept packed: they are dequantized to
    float32 (the torch paths compute them; several times the file's memory and time)."""
    slow: dict[str, int] = {}
    kept = BLOCK_CODES.keys() | HALF_GGML_TYPES.keys() | {GGML_MXFP4}  # MXFP4: gpt-oss
    for t in gguf_file.tensors:
        if len(t.shape) >= 2 and t.ggml_type not in kept:
            slow[t.type_name] = slow.get(t.type_name, 0) + 1
    for type_name, count in sorted(slow.items()):
        level = logging.INFO if type_name in _FLOAT_TYPES else logging.WARNING
        logger.log(
            level,
            "%d %s weight tensors of %s are not kept packed: dequantized to float32",
            count,
            type_name,
            gguf_file.path.name,
        )


def _split_gate_up(weight: T, num_experts: int) -> tuple[T, T]:
    """Stacked experts' fused [E, 2I, H] gate/up (float, or packed as its E·2I rows) as the
    gate's and the up's stacks."""
    if isinstance(weight, torch.Tensor):
        gate, up = weight.chunk(2, dim=1)
        return gate.contiguous(), up.contiguous()
    rows = torch.arange(weight.shape[0]).view(num_experts, 2, -1)  # [E, gate|up, I]
    return weight.select_rows(rows[:, 0].reshape(-1)), weight.select_rows(rows[:, 1].reshape(-1))


def _hf_name(gguf_name: str, architecture: str) -> str | None:
    if architecture == "gemma4":
        if gguf_name in _GEMMA4_GLOBALS:
            return _GEMMA4_GLOBALS[gguf_name]
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
        if m and m.group(2) in _GEMMA4_NAMES:
            return f"model.layers.{m.group(1)}.{_GEMMA4_NAMES[m.group(2)]}"
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight", gguf_name)
    if m:  # older Mixtral files: a tensor per expert
        layer, part, expert = m.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{part[4:]}_proj.weight"
    hybrid = architecture in HYBRID_ARCHITECTURES
    m = re.fullmatch(r"blk\.(\d+)\.ssm_(a|dt\.bias)", gguf_name)
    if m and hybrid:  # the decay's A (no suffix) and dt's bias
        layer, part = m.groups()
        return f"model.layers.{layer}.linear_attn.{'A_log' if part == 'a' else 'dt_bias'}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not m:
        return None
    layer, part, kind = m.groups()
    if hybrid and part in _HYBRID_NAMES:
        hf = _HYBRID_NAMES[part]
    elif architecture == "phi3" and part in ("attn_qkv", "ffn_up"):
        # Fused as in Phi-3's own checkpoints (models/phi3.py splits them): q/k/v, gate/up.
        hf = "self_attn.qkv_proj" if part == "attn_qkv" else "mlp.gate_up_proj"
    elif part == "ffn_norm":
        # Llama's second norm; Gemma's pre-MLP norm (it also has post-attention/post-MLP norms).
        gemma = architecture in ("gemma2", "gemma3", "gemma4")
        hf = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
    else:
        hf = _GGUF_LAYER_NAMES.get(part)
    if hf is None:
        return None
    return f"model.layers.{layer}.{hf}.{kind}"


def _unpermute_rope(weight: T, num_heads: int, in_place: bool = False) -> T:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> HF's rotate-half halves);
    ``in_place``: in the PackedWeight's own tensors (its place in a joined weight)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    order = torch.arange(rows).view(num_heads, half, 2).transpose(1, 2).reshape(rows)
    if in_place and isinstance(weight, PackedWeight):
        weight.permute_rows_(order)
        return weight
    if isinstance(weight, (PackedWeight, GGUFBlocks)):
        return weight.select_rows(order)
    return weight[order]
