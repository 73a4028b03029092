"""What every model file shares: the forward signature and weight loading by HF names."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tokenmill.attention import Attention, ForwardBatch
from tokenmill.attention.backends import AttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.kernels import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.quant.gguf import PackedQuantMethod
from tokenmill.quant.packed import PackedWeight


class CausalLM(nn.Module):
    """A decoder-only LM: ``forward`` gives hidden states, ``compute_logits`` the next-token logits.

    Parameter names follow the Hugging Face checkpoints (``model.layers.0.self_attn.q_proj``), so
    safetensors load by name and the GGUF loader maps its names onto these.
    """

    config: ModelConfig

    def __init__(self) -> None:
        super().__init__()
        self.kernels: KernelBackend = TorchKernelBackend()  # bound at load; the sampler's too

    def bind_kernels(self, kernels: KernelBackend, attention: AttentionBackend) -> None:
        """Hand the backends chosen at load to every module that computes with them: each
        Attention layer gets ``attention``, every module with a ``kernels`` attribute (norms,
        RoPE, gated activations, linears and embeddings for their packed matmuls, residual
        adds, this model) gets ``kernels``."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = attention
            elif hasattr(module, "kernels"):
                module.kernels = kernels

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch
    ) -> torch.Tensor:
        raise NotImplementedError  # each architecture defines its forward

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, vocab] of hidden states [rows, hidden]; written into ``out`` when given
        (the runner reuses one float32 buffer: at 32 rows a fresh 33 MB tensor cost ~10 ms of
        page faults a step)."""
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
        return total

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | PackedWeight]],
        on_loaded: Callable[[str], None] | None = None,
        packed_method: PackedQuantMethod | None = None,
    ) -> None:
        """Copy checkpoint tensors into the parameters, one at a time, and check all arrived.

        ``on_loaded(name)`` runs after each parameter is filled (the loader packs quantized
        layers there, so the float weights never all sit in memory at once). A PackedWeight
        (a GGUF tensor kept in its block format) is handed to its layer with ``packed_method``.
        """
        # Popped as they are filled: no reference outlives a parameter a quantizer drops.
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name.startswith("model.language_model."):  # multimodal Gemma 3 checkpoints
                name = "model." + name.removeprefix("model.language_model.")
            if name not in params:
                if "rotary_emb" in name or name.startswith(
                    ("vision_", "multi_modal", "model.vision")
                ):
                    continue
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params.pop(name)
            if isinstance(tensor, PackedWeight):
                if packed_method is None:
                    raise ValueError(f"{name!r} arrived packed but no packed method was given")
                module = self.get_submodule(name.rsplit(".", 1)[0])
                if tuple(param.shape) != tensor.shape or not hasattr(module, "load_packed_"):
                    raise ValueError(
                        f"checkpoint tensor {name!r} (packed, shape {tensor.shape}) does not fit "
                        f"the model's {tuple(param.shape)}"
                    )
                device = param.device
                del param
                module.load_packed_(packed_method, tensor.to(device))
                continue
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            del param, tensor
            if on_loaded is not None:
                on_loaded(name)
        if params:
            raise ValueError(f"checkpoint lacks tensors: {', '.join(sorted(params)[:8])}")
