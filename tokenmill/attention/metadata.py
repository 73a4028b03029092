"""Per-step attention metadata, built once by the model runner and read by every layer.

Token order in a step's flat batch::

    | decode tokens (one per request) | prefill chunk of req A | prefill chunk of req B | ...

Decodes are attended in one batched call; each prefill chunk (a query of more than one token,
possibly on top of computed context) is attended on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.attention.recurrent import LayerState, RecurrentBatch


@dataclass(slots=True)
class PrefillSeq:
    token_start: int  # first index of this request's tokens in the flat batch
    query_len: int
    num_computed: int  # context already in the cache before this chunk
    block_ids: torch.Tensor  # [num_blocks] long: blocks holding the whole context after this step

    @property
    def seq_len(self) -> int:
        return self.num_computed + self.query_len


@dataclass(slots=True)
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] long: where each new token's K/V is written
    num_decodes: int
    decode_block_table: torch.Tensor  # [num_decodes, max_blocks] long, padded with block 0
    decode_seq_lens: torch.Tensor  # [num_decodes] long, including the new token
    prefills: list[PrefillSeq]
    # Reused buffers the decode path gathers K and V blocks into ([>= num_decodes * max_blocks,
    # block elems]); layers run one after another, so one pair serves all. None: allocate.
    gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    # Masks depend only on the step and the window, so layers share them; filled lazily.
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_ctx] bool: True where a key is attended."""
        mask = self._decode_masks.get(window)
        if mask is None:
            max_ctx = self.decode_block_table.shape[1] * self.block_size
            key_pos = torch.arange(max_ctx, device=self.decode_seq_lens.device)
            seq_lens = self.decode_seq_lens[:, None]
            mask = key_pos[None, :] < seq_lens
            if window is not None:
                # The query sits at position seq_len - 1; keys further back than window - 1 drop.
                mask &= key_pos[None, :] >= seq_lens - window
            mask = mask[:, None, None, :]
            self._decode_masks[window] = mask
        return mask


@dataclass(slots=True)
class ForwardBatch:
    """What a model's forward needs besides input ids and positions; passed explicitly."""

    # Per layer: K, V [num_blocks, block_size, num_kv_heads, head_dim]; a quantized cache
    # (int8 / fp8) adds K and V scales [num_blocks, block_size, num_kv_heads] float32. Layers of
    # different groups share tensors (kv_layout.py).
    kv_caches: list[tuple[torch.Tensor, ...]]
    # Per group of layers: its block tables and slots (one group: every layer's).
    attn: list[AttentionMetadata]
    # Per layer: its group; empty when there is one group.
    layer_groups: tuple[int, ...] = ()
    # Hybrid models: per linear-attention layer its state tensors, and which slot each of the
    # step's requests reads (attention/recurrent.py); None for models without such layers.
    states: list[LayerState] = field(default_factory=list)
    recurrent: RecurrentBatch | None = None

    def layer_attn(self, layer_idx: int) -> AttentionMetadata:
        """The metadata layer ``layer_idx`` attends with."""
        return self.attn[self.layer_groups[layer_idx] if self.layer_groups else 0]


def decode_forward_batch(
    kv_caches: list[tuple[torch.Tensor, ...]],
    layer_groups: tuple[int, ...],
    block_size: int,
    slots: torch.Tensor,  # [num_groups, >= num_decodes] long
    block_tables: torch.Tensor,  # [num_groups, >= num_decodes, max_blocks] long
    seq_lens: torch.Tensor,  # [>= num_decodes] long
    num_decodes: int,
) -> ForwardBatch:
    """A step of ``num_decodes`` single-token decodes over the first rows of persistent buffers
    (the decode graphs'), with each group's slots and block tables."""
    attn = [
        AttentionMetadata(
            block_size=block_size,
            slot_mapping=slots[g, :num_decodes],
            num_decodes=num_decodes,
            decode_block_table=block_tables[g, :num_decodes],
            decode_seq_lens=seq_lens[:num_decodes],
            prefills=[],
        )
        for g in range(slots.shape[0])
    ]
    return ForwardBatch(kv_caches, attn, layer_groups)
