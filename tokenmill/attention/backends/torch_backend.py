"""Paged attention in plain torch (no C call), built on scaled_dot_product_attention: the
backend of any device and the oracle of the others.

Decodes gather their blocks with ``index_select`` (much faster than advanced indexing on CPU)
into one padded batch and attend in a single call under a length/window mask. A prefill chunk
with no computed context attends to its own fresh K/V; one on top of cached context gathers
its blocks first.

A quantized cache (scale tensors given) is dequantized as it is read, and every prefill chunk
reads its own K/V back from the cache too, so prompt tokens carry the same quantization error
in a one-shot prefill, a chunked one, or a prefix hit, as they do for decodes.

``store_kv`` and ``attend_decodes`` are the steps a faster backend may override
(attention/backends/cpu_backend.py); the prefill path is shared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.backends.base import AttentionBackend
from tokenmill.attention.kv_cache import dequantize_kv, write_kv
from tokenmill.attention.metadata import AttentionMetadata, PrefillSeq


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.store_kv(k, v, meta.slot_mapping, k_cache, v_cache, kv_scales)
        dtype = q.dtype
        if q.device.type == "cpu" and q.dtype != torch.float32:
            q, k, v = q.float(), k.float(), v.float()
        if softcap is not None or sinks is not None:
            out = self.attend_explicit(q, k, v, k_cache, v_cache, meta, scale, window,
                                       kv_scales, softcap, sinks)  # fmt: skip
            return out.to(dtype)
        nd = meta.num_decodes
        if nd == q.shape[0]:  # decodes only: their output is the whole output
            out = self.attend_decodes(q, k_cache, v_cache, meta, scale, window, kv_scales)
            return out.to(dtype)
        out = torch.empty_like(q, dtype=dtype)
        if nd:
            out[:nd] = self.attend_decodes(q[:nd], k_cache, v_cache, meta, scale, window, kv_scales)
        for run in _prefill_runs(meta.prefills, window, kv_scales is not None):
            s, e = run[0].token_start, run[-1].token_start + run[-1].query_len
            if len(run) > 1:  # fresh prompts of one length, side by side
                out[s:e] = self.attend_prompts(q[s:e], k[s:e], v[s:e], len(run), scale)
                continue
            out[s:e] = self._prefill(
                q[s:e], k[s:e], v[s:e], k_cache, v_cache, run[0], scale, window, kv_scales
            )
        return out

    def store_kv(
        self,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] long
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Store each token's K and V at its slot (quantized, with its scales, when the cache
        is int8 / fp8)."""
        if kv_scales is not None:
            write_kv(k_cache, kv_scales[0], slot_mapping, k)
            write_kv(v_cache, kv_scales[1], slot_mapping, v)
            return
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def attend_decodes(
        self,
        q: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """One query per decoding sequence against its paged K/V."""
        keys, values = _decode_context(k_cache, v_cache, meta, kv_scales, q.dtype)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [nd, num_heads, 1, head_dim]
            keys.transpose(1, 2).to(q.dtype),  # [nd, num_kv_heads, max_ctx, head_dim]
            values.transpose(1, 2).to(q.dtype),
            attn_mask=meta.decode_mask(window),
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    def attend_explicit(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every query of the step with its scores soft-capped before the softmax (Gemma 2:
        ``softcap · tanh(scores / softcap)``) and/or a sink logit per head in the softmax
        (gpt-oss), which SDPA cannot do: explicit matmuls, the oracle's way, for decodes and
        prefill chunks alike (the C kernels never run it)."""
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            keys, values = _decode_context(k_cache, v_cache, meta, kv_scales, q.dtype)
            out[:nd] = _explicit_attention(
                q[:nd].unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                meta.decode_mask(window), scale, softcap, sinks,
            ).squeeze(2)  # fmt: skip
        for seq in meta.prefills:
            s, e = seq.token_start, seq.token_start + seq.query_len
            keys, values, base = self._prefill_context(
                q[s:e], k[s:e], v[s:e], k_cache, v_cache, seq, window, kv_scales
            )
            mask = _position_mask(seq.num_computed, e - s, base, keys.shape[0], window, q.device)
            out[s:e] = _explicit_attention(
                _heads_first(q[s:e]), _heads_first(keys), _heads_first(values), mask, scale,
                softcap, sinks,
            ).squeeze(0).transpose(0, 1)  # fmt: skip
        return out

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: PrefillSeq,
        scale: float,
        window: int | None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        keys, values, base = self._prefill_context(
            q, k, v, k_cache, v_cache, seq, window, kv_scales
        )
        return self.attend_run(q, keys, values, seq.num_computed, base, scale, window)

    def _prefill_context(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: PrefillSeq,
        window: int | None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The keys and values a prefill chunk attends to (in q's dtype), and the position of
        the first."""
        _, bs, nkv, hd = k_cache.shape
        # Keys before the chunk's first query's window are never read, and a window group's
        # table holds only the null block there (kv_layout.py): the context is gathered from
        # the block the window starts in, `base` its first position.
        base = 0 if window is None else max(0, seq.num_computed - window + 1) // bs * bs
        blocks, n = seq.block_ids[base // bs :], seq.seq_len - base
        if kv_scales is not None:
            # The context, this chunk included, as the cache holds it.
            k_scale, v_scale = (_gather_blocks(s, blocks).view(-1, nkv)[:n] for s in kv_scales)
            keys = _gather_blocks(k_cache, blocks).view(-1, nkv, hd)[:n]
            values = _gather_blocks(v_cache, blocks).view(-1, nkv, hd)[:n]
            keys = dequantize_kv(keys, k_scale, q.dtype)
            values = dequantize_kv(values, v_scale, q.dtype)
        elif seq.num_computed == 0:
            keys, values = k, v
        else:
            keys = _gather_blocks(k_cache, blocks).view(-1, nkv, hd)[:n]
            values = _gather_blocks(v_cache, blocks).view(-1, nkv, hd)[:n]
        return keys.to(q.dtype), values.to(q.dtype), base

    def attend_prompts(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float
    ) -> torch.Tensor:
        """Causal attention of n whole prompts of one length, side by side in q, k, v (a
        window, if any, covers each): one batched SDPA call."""
        length = q.shape[0] // n
        q4, k4, v4 = (t.view(n, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(
            q4, k4.to(q.dtype), v4.to(q.dtype), is_causal=True, scale=scale, enable_gqa=True
        )
        return attn.transpose(1, 2).reshape(q.shape)

    def attend_run(
        self,
        q: torch.Tensor,  # [queries, num_heads, head_dim] at positions q0, q0 + 1, ...
        keys: torch.Tensor,  # [keys, num_kv_heads, head_dim] at positions k0, ..., the last query's
        values: torch.Tensor,
        q0: int,
        k0: int,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """Causal (and windowed) attention of a prefill chunk's queries to its context: the
        step a faster backend may override (cpu_backend.py)."""
        if window is None or window >= q0 + q.shape[0]:
            return _attend(q, keys, values, q0, k0, scale, window)
        # A sliding window: queries in blocks of an eighth of a window, each against the keys
        # its window reaches (at most 1.125 windows), not the whole context. On AMD EPYC (Zen 5,
        # 2 threads) an 8,192-token prompt's window-512 layer took 0.156 s in blocks of 64,
        # 0.173 s in blocks of 256 and 0.232 s in blocks of 512.
        out = torch.empty_like(q)
        step = max(1, window // 8)
        for a in range(0, q.shape[0], step):
            b = min(a + step, q.shape[0])
            lo = max(0, q0 + a - window + 1)
            out[a:b] = _attend(
                q[a:b], keys[lo - k0 : q0 + b - k0], values[lo - k0 : q0 + b - k0], q0 + a, lo,
                scale, window,
            )  # fmt: skip
        return out


def _decode_context(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decodes' keys and values [num_decodes, max_ctx, num_kv_heads, head_dim], gathered
    from their blocks (dequantized from an int8 / fp8 cache); past a sequence's length, the
    mask's to hide."""
    nd, max_blocks = meta.decode_block_table.shape
    _, bs, nkv, hd = k_cache.shape
    flat_table = meta.decode_block_table.reshape(-1)
    k_buf = v_buf = None
    if meta.gather_buffers is not None:  # rows as wide as the widest layer's blocks
        n = flat_table.numel() * k_cache[0].numel()
        k_buf, v_buf = (b.view(-1)[:n].view(flat_table.numel(), -1) for b in meta.gather_buffers)
    keys = _gather_blocks(k_cache, flat_table, k_buf).view(nd, max_blocks * bs, nkv, hd)
    values = _gather_blocks(v_cache, flat_table, v_buf).view(nd, max_blocks * bs, nkv, hd)
    if kv_scales is not None:
        k_scale, v_scale = (
            _gather_blocks(s, flat_table).view(nd, max_blocks * bs, nkv) for s in kv_scales
        )
        keys = dequantize_kv(keys, k_scale, dtype)
        values = dequantize_kv(values, v_scale, dtype)
    return keys, values


def _explicit_attention(
    q: torch.Tensor,  # [batch, heads, queries, head_dim]
    keys: torch.Tensor,  # [batch, kv_heads, keys, head_dim]
    values: torch.Tensor,
    mask: torch.Tensor,  # bool, broadcast to [batch, heads, queries, keys]: True attends
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [heads]
) -> torch.Tensor:
    """softmax(softcap · tanh(q·kᵀ · scale / softcap), masked) · v, as transformers' Gemma 2;
    with ``sinks``, each head's sink logit joins the softmax's denominator (and gives no
    value), as transformers' gpt-oss."""
    # Each KV head's group of query heads against it, by broadcasting (no copy of K/V per
    # query head): q as [batch, kv_heads, group, queries, head_dim].
    b, h, nq, d = q.shape
    kv_heads = keys.shape[1]
    q5 = q.reshape(b, kv_heads, h // kv_heads, nq, d)
    keys, values = keys.to(q.dtype).unsqueeze(2), values.to(q.dtype).unsqueeze(2)
    scores = torch.matmul(q5, keys.transpose(-1, -2)).reshape(b, h, nq, -1) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    weights = weights.to(q.dtype).reshape(b, kv_heads, h // kv_heads, nq, -1)
    return torch.matmul(weights, values).reshape(b, h, nq, d)


def _prefill_runs(
    prefills: list[PrefillSeq], window: int | None, quantized: bool
) -> list[list[PrefillSeq]]:
    """Prefills grouped for attention: adjacent whole prompts (nothing cached, a float cache,
    within the window) of the same length form one run, attended in one batched call (for 16
    prompts of 128 tokens, 14 ms a layer instead of 19); every other prefill is a run alone."""

    def whole(seq: PrefillSeq) -> bool:
        in_window = window is None or window >= seq.query_len
        return seq.num_computed == 0 and not quantized and in_window

    runs: list[list[PrefillSeq]] = []
    for seq in prefills:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and whole(seq)
            and whole(last)
            and last.query_len == seq.query_len
            and last.token_start + last.query_len == seq.token_start
        ):
            runs[-1].append(seq)
        else:
            runs.append([seq])
    return runs


def _attend(
    q: torch.Tensor,  # [queries, num_heads, head_dim] at positions q0, q0 + 1, ...
    keys: torch.Tensor,  # [keys, num_kv_heads, head_dim] at positions k0, k0 + 1, ...
    values: torch.Tensor,
    q0: int,
    k0: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Causal (and windowed) attention of a run of queries to a run of keys that ends at the
    last query's position."""
    in_window = window is None or window >= keys.shape[0]
    if q.device.type == "cpu" and q0 > k0 and in_window:
        return _attend_in_parts(q, keys, values, scale)
    return _attend_masked(q, keys, values, q0, k0, scale, window)


def _attend_masked(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q0: int,
    k0: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """``_attend`` in one SDPA call under a position mask (the plain form; the oracle of
    ``_attend_in_parts``)."""
    nq, nk = q.shape[0], keys.shape[0]
    square = q0 == k0 and nq == nk  # SDPA's is_causal aligns the first query with the first key
    needs_mask = not square or (window is not None and window < nk)
    mask = None
    if needs_mask:
        mask = _position_mask(q0, nq, k0, nk, window, q.device)
    out = F.scaled_dot_product_attention(
        _heads_first(q),
        _heads_first(keys),
        _heads_first(values),
        attn_mask=mask,
        is_causal=not needs_mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def _attend_in_parts(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Full causal attention of queries on top of earlier keys as two attentions merged by
    their log-sum-exps (flash-decoding's merge): over the earlier keys, which every query sees
    (no mask), and over the queries' own keys (SDPA's ``is_causal`` square).

    One masked call over all the keys costs more: on AMD EPYC (Zen 5, 2 threads) a 2,048-token
    chunk on 6,144 cached tokens took 0.45 s masked, 0.39 s in parts. (A window's band would
    need a mask of its own: measured there, three parts lost to one masked call.) CPU only: the
    parts come from torch's CPU flash-attention op, which returns the log-sum-exps.
    """
    own = keys.shape[0] - q.shape[0]
    before, lse_before = _flash_part(q, keys[:own], values[:own], scale, causal=False)
    mine, lse_mine = _flash_part(q, keys[own:], values[own:], scale, causal=True)
    # softmax over both key sets: each output weighted by its share of the total exp-sum.
    share_before = torch.sigmoid(lse_before - lse_mine).unsqueeze(-1)
    out = mine.add_(share_before * (before - mine))
    return out.squeeze(0).transpose(0, 1)


def _flash_part(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [1, heads, queries, head_dim], log-sum-exp [1, heads, queries]) of q over these
    keys alone. The op broadcasts KV heads over query heads (GQA) itself."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _heads_first(q), _heads_first(keys), _heads_first(values), 0.0, causal, scale=scale
    )


def _position_mask(
    q0: int, nq: int, k0: int, nk: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[queries, keys] True where a query at q0 + i may see the key at k0 + j: not after it,
    and within its window."""
    q_pos = torch.arange(q0, q0 + nq, device=device)[:, None]
    k_pos = torch.arange(k0, k0 + nk, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_dim] -> [1, heads, tokens, head_dim], SDPA's layout (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy whole blocks out of the cache. NOTE: on a 2-D view; index_select on the 4-D cache
    was measured ~500x slower on CPU (a slow TensorIterator path). Writing into a reused
    buffer halves the cost again (a fresh multi-MB tensor page-faults on every layer)."""
    flat = cache.view(cache.shape[0], -1)
    if out is None:
        return flat.index_select(0, block_ids)
    return torch.index_select(flat, 0, block_ids, out=out)
