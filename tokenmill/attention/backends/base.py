"""AttentionBackend: how a layer's new K/V are stored in its paged cache and attended.

One instance serves every layer; it is chosen once, at load (models/loader.py), and handed to
each Attention layer (``CausalLM.bind_kernels``). Step metadata comes in ``AttentionMetadata``
(attention/metadata.py), built once a step by the model runner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tokenmill.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Base class of attention backends."""

    name: str = ""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # [num_blocks, bs, nkv] f32
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] float
    ) -> torch.Tensor:
        """Write k and v at ``meta.slot_mapping``, then attend every query of the step (decodes
        first, then each prefill chunk; see metadata.py) causally, within ``window`` if given.
        A quantized cache (int8 / fp8) comes with its scales. ``softcap``: the scores are
        soft-capped before the softmax (Gemma 2); ``sinks``: a logit per head that joins each
        softmax (gpt-oss). Returns [num_tokens, num_heads, head_dim] in
        q's dtype."""
