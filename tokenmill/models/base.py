"""What every model file shares: the forward signature and weight loading by HF names."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.attention import Attention, ForwardBatch
from tokenmill.attention.backends import AttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.kernels import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.layers.linear import FusedLinear, Linear, default_weight_loader
from tokenmill.layers.parallel import Shard, all_gather_last, shard_size
from tokenmill.moe import FusedMoE
from tokenmill.quant.gguf import PackedQuantMethod, PackedState
from tokenmill.quant.packed import PackedWeight

logger = logging.getLogger(__name__)


class CausalLM(nn.Module):
    """A decoder-only LM: ``forward`` gives hidden states, ``compute_logits`` the next-token logits.

    Parameter names follow the Hugging Face checkpoints (``model.layers.0.self_attn.q_proj``), so
    safetensors load by name and the GGUF loader maps its names onto these.
    """

    config: ModelConfig
    # Checkpoint layers computed by a fused layer: (fused layer, checkpoint layer, its part),
    # the last components of their module names, as vLLM's stacked_params_mapping.
    stacked_params: tuple[tuple[str, str, str], ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.kernels: KernelBackend = TorchKernelBackend()  # bound at load; the sampler's too

    def bind_kernels(self, kernels: KernelBackend, attention: AttentionBackend) -> None:
        """Hand the backends chosen at load to every module that computes with them: each
        Attention layer gets ``attention``, every module with a ``kernels`` attribute (norms,
        RoPE, gated activations, linears and embeddings for their packed matmuls, residual
        adds, this model) gets ``kernels``."""
        relaid: dict[str, int] = {}  # packed weights the backend re-laid, by their new kind
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = attention
            elif hasattr(module, "kernels"):
                module.kernels = kernels
            # Linear layers' packed weights in the layout the backend's kernels want.
            states = []
            if isinstance(module, Linear):
                states = [module.quant_state]
            elif isinstance(module, FusedLinear):
                states = [group.state for group in module.groups]
            for state in states:
                if isinstance(state, PackedState):
                    prepared = kernels.prepare_packed(state.weight)
                    if prepared is not state.weight:
                        relaid[prepared.kind] = relaid.get(prepared.kind, 0) + 1
                    state.weight = prepared
        if relaid:  # which kernels a load's packed layers run on, in its log
            kinds = ", ".join(f"{n} as {kind!r}" for kind, n in relaid.items())
            logger.info("%s kernels re-laid packed layers at load: %s", kernels.name, kinds)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch
    ) -> torch.Tensor:
        raise NotImplementedError  # each architecture defines its forward

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, vocab] of hidden states [rows, hidden]; written into ``out`` when given
        (the runner reuses one float32 buffer: at 32 rows a fresh 33 MB tensor cost ~10 ms of
        page faults a step). Gemma 2/3/4 soft-cap them (``final_logit_softcapping``)."""
        logits = self._head(hidden, out)
        cap = self.config.final_logit_softcapping
        if cap:  # in place: ``out`` (a CUDA graph's logits buffer) must hold the capped values
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    def _head(self, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if self.config.tp.size > 1:  # this rank's vocabulary slice, gathered from all ranks
            if self.config.tie_word_embeddings:
                local = self.model.embed_tokens.as_head(hidden)
            else:
                local = self.lm_head(hidden)
            logits = all_gather_last(local)[:, : self.config.vocab_size]  # [rows, vocab]
            return logits if out is None else out.copy_(logits)
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_head(hidden, out)
        return self.lm_head(hidden, out)

    def output_head(self) -> nn.Module:
        """The module whose weight compute_logits multiplies: lm_head, or the tied embedding."""
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    def weight_nbytes(self) -> int:
        """Resident bytes of the weights: float parameters plus packed quantized states."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        for module in self.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                total += method.nbytes(module.quant_state)
            if hasattr(module, "packed_nbytes"):  # fused layers, experts (gpt-oss's too)
                total += module.packed_nbytes()
        return total

    def num_parameters(self) -> int:
        """Elements of every weight: float parameters, and packed weights by their shapes."""
        total = sum(p.numel() for p in self.parameters())
        for module in self.modules():
            state = getattr(module, "quant_state", None)
            if state is not None:
                total += _numel(state.weight.shape)
            if isinstance(module, FusedLinear):
                total += sum(_numel(g.state.weight.shape) for g in module.groups if g.state)
            elif isinstance(module, FusedMoE):
                total += sum(_numel(w.shape) for w in module.packed.values())
            elif hasattr(module, "packed_numel"):  # gpt-oss's experts: re-laid MXFP4
                total += module.packed_numel()
        return total

    def expert_layers(self) -> dict[int, FusedMoE]:
        """Decoder layer index -> its experts, for the layers whose MLP is a mixture."""
        return {
            _layer_index(name): module
            for name, module in self.named_modules()
            if isinstance(module, FusedMoE)
        }

    def checkpoint_layers(self) -> Iterator[tuple[str, nn.Module]]:
        """Each layer that holds a checkpoint tensor's parameters, by its checkpoint name
        (``model.layers.0.self_attn.k_proj``): the parts of fused layers, each on its own. The
        names quantization methods (``method_for``) and calibration go by."""
        for name, layer, _, _ in self._checkpoint_layers():
            yield name, layer

    def fused_weights(self) -> list[tuple[str, ...]]:
        """The checkpoint weight names of each fused layer's parts, in the order their rows are
        joined (``model.layers.0.mlp.gate_proj.weight``, ``...up_proj.weight``): what a loader
        may place side by side so that the join copies nothing."""
        parts: dict[int, list[str]] = {}
        for name, _, fused, _ in self._checkpoint_layers():
            if fused is not None:
                parts.setdefault(id(fused), []).append(f"{name}.weight")
        return [tuple(names) for names in parts.values()]

    def _checkpoint_layers(self) -> Iterator[tuple[str, nn.Module, FusedLinear | None, str]]:
        """(checkpoint name, layer, the fused layer it is a part of or None, the part)."""
        checkpoint_name = {(fused, part): name for fused, name, part in self.stacked_params}
        fused_prefixes: list[str] = []
        for module_name, module in self.named_modules():
            if any(module_name.startswith(prefix) for prefix in fused_prefixes):
                continue  # a fused layer's part, named below
            if isinstance(module, FusedLinear):
                fused_prefixes.append(module_name + ".")
                parent, _, fused = module_name.rpartition(".")
                for part in module.part_names:
                    name = f"{parent}.{checkpoint_name[fused, part]}"
                    yield name, module.part(part), module, part
            elif module_name and next(module.parameters(recurse=False), None) is not None:
                yield module_name, module, None, ""

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | PackedWeight]],
        on_loaded: Callable[[str], None] | None = None,
        packed_method: PackedQuantMethod | None = None,
    ) -> None:
        """Hand checkpoint tensors one at a time to the loaders of their layers, and check all
        arrived.

        A tensor of a fused layer's part (``stacked_params``) goes to that layer's
        ``weight_loader`` with its part; one of another layer to its own ``weight_loader``, or
        is copied into a plain parameter (norms). ``on_loaded(name)`` runs after each tensor is
        loaded (the loader packs quantized layers there, so the float weights never all sit in
        memory at once). A PackedWeight (a GGUF tensor kept in its block format) is computed by
        ``packed_method``.
        """
        # Popped as they are filled: no reference outlives a parameter a quantizer drops.
        loaders = self._weight_loaders()
        experts = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        for name, tensor in self.checkpoint_tensors(weights):
            if name.startswith("model.language_model."):  # multimodal Gemma 3 checkpoints
                name = "model." + name.removeprefix("model.language_model.")
            elif name.startswith(("embed_tokens.", "layers.", "norm.")):
                # A base model's checkpoint (saved from Qwen3Model, not Qwen3ForCausalLM): an
                # embedding model such as Qwen3-Embedding, with no head of its own.
                name = "model." + name
            name = self.checkpoint_name(name)
            load = loaders.pop(name, None)
            if load is None:
                if "rotary_emb" in name or name.startswith(
                    ("vision_", "multi_modal", "model.vision")
                ):
                    continue
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                if _layer_index(name) >= self.config.num_hidden_layers:
                    continue  # an early-exit draft model keeps only the first layers
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            try:
                load(tensor, packed_method)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} {e}") from e
            del load, tensor
            if on_loaded is not None:
                on_loaded(name)
        # Experts come per expert or stacked: each FusedMoE says which of its tensors are absent.
        missing = [n for n in loaders if n.rpartition(".experts.")[0] + ".experts" not in experts]
        for prefix, module in experts.items():
            missing += module.missing_tensors(prefix)
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {', '.join(sorted(missing)[:8])}")

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's tensors as this model's modules take them: a family whose
        checkpoints fuse or split tensors otherwise (Phi-3's qkv, gpt-oss's experts) lays
        them out here; others pass them on as they come."""
        return weights

    def after_load(self, device: torch.device, quant_method: object | None) -> None:
        """Lay weights out for computing once they are all in (the loader calls it after
        joining fused parts); a family whose weights need it overrides it (gpt-oss's MXFP4
        experts). ``quant_method``: the load's, or None."""

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as this model's modules carry it (a family whose
        checkpoints name a module otherwise renames it here)."""
        return name

    def _weight_loaders(self) -> dict[str, Callable[[torch.Tensor | PackedWeight, Any], None]]:
        """Checkpoint tensor name -> the call that loads it (tensor, packed_method)."""
        loaders: dict[str, Callable[[torch.Tensor | PackedWeight, Any], None]] = {}
        for layer_name, layer, fused, part in self._checkpoint_layers():
            if isinstance(layer, FusedMoE):  # per-expert and stacked tensors
                loaders |= layer.checkpoint_loaders(layer_name)
                continue
            for param_name, param in layer.named_parameters(recurse=False):
                if fused is not None:
                    load = functools.partial(_load_part, fused, param_name, part)
                elif hasattr(layer, "weight_loader"):
                    load = functools.partial(_load_whole, layer, param_name)
                else:
                    load = functools.partial(_load_plain, param)
                loaders[f"{layer_name}.{param_name}"] = load
        return loaders


def head_linear(config: ModelConfig) -> Linear:
    """An untied output head: the whole vocabulary, or with tensor parallelism this rank's
    slice of it (rows padded to equal slices; compute_logits gathers and cuts them)."""
    tp = config.tp
    if tp.size == 1:
        return Linear(config.hidden_size, config.vocab_size)
    rows = shard_size(config.vocab_size, tp.size)
    return Linear(config.hidden_size, rows, shard=Shard(0, tp.rank, tp.size))


def _load_part(
    fused: FusedLinear, param_name: str, part: str, tensor: Any, packed_method: Any
) -> None:
    fused.weight_loader(param_name, tensor, part, packed_method)


def _load_whole(layer: nn.Module, param_name: str, tensor: Any, packed_method: Any) -> None:
    layer.weight_loader(param_name, tensor, packed_method)


def _load_plain(param: nn.Parameter, tensor: Any, packed_method: Any) -> None:
    default_weight_loader(param, tensor)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _layer_index(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to ("model.layers.3.mlp..." -> 3), or -1."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return -1
