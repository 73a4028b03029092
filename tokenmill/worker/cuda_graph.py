"""CUDA graphs of decode steps: a step of single-token decodes (or verification rows, which are
decode rows too) replays a graph captured at start-up for its padded batch size.

A decode step of a small model is mostly kernel launches; a captured graph launches them all
at once. A graph replays fixed addresses, so every step writes its inputs into persistent
buffers sized for the largest batch, and reads its logits from a persistent buffer::

    ids, positions, seq_lens                 [max_batch]
    slot_mapping                             [num_groups, max_batch]
    block_table                              [num_groups, max_batch, max_blocks_per_seq]
    logits                                   [max_batch, vocab] float32

(one slot mapping and block table per group of layers, kv_layout.py).

A step of n rows runs the graph of the smallest captured size b >= n (``graph_batch_sizes``:
1, 2, 4, 8, 16, 24, ... max_batch). Rows n..b-1 are padding: token 0 at position 0 with a
sequence length of 1 over block 0, which the block pool never hands out (core/block_pool.py),
so a padded row writes its K/V into block 0's first slot (``PAD_SLOT``) and attends only to
itself; its logits are never read. Padded block-table entries point at block 0 too, as the
eager path's do, and are masked by the sequence lengths.

The padding, the copy into the buffers, the bucketing and the slicing of the output are the
same on every device; only the capture is CUDA's. Where there is no CUDA graph (on CPU, which
is how CI tests this path, or a size whose capture failed), ``replay`` runs the same forward
eagerly over the same buffers.
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from tokenmill.attention import decode_forward_batch
from tokenmill.kv_layout import KVLayout
from tokenmill.models.base import CausalLM
from tokenmill.worker.input_batch import PendingIds

logger = logging.getLogger(__name__)

# Decode steps of up to this many rows (and max_num_seqs times the rows a request may have)
# replay a CUDA graph; larger ones run eagerly.
CUDA_GRAPH_MAX_BATCH = 256

# Where a padded row's K/V goes: the first slot of block 0, never part of a request.
PAD_SLOT = 0


def cuda_graphs_supported(device: torch.device) -> bool:
    """Whether decode steps are captured as CUDA graphs here (tests patch this to run the same
    path eagerly on CPU)."""
    return device.type == "cuda"


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes up to ``max_batch``: 1, 2, 4, then every multiple of 8, and
    ``max_batch`` itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += [b for b in range(8, max_batch, 8)]
    return [*sizes, max_batch]


class CudaDecodeGraphs:
    """Decode steps over persistent buffers, one CUDA graph per padded batch size.

    ``capture`` (CUDA only) records every size, largest first, into one shared memory pool:
    one step runs at a time, so the graphs' intermediates may share memory; the logits are
    written into one buffer all graphs share (read them before the next step).
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, ...]],
        layout: KVLayout,
        block_size: int,
        max_blocks_per_seq: int,
        max_batch: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.layout = layout
        self.block_size = block_size
        self.max_batch = max_batch
        self.device = device
        self.sizes = graph_batch_sizes(max_batch)
        m, w, g = max_batch, max_blocks_per_seq, layout.num_groups
        # | ids | positions | seq_lens | slots (g x m) | block tables (g x m x w) |: the inputs
        # of every size, in one tensor on the device and its host staging twin (pinned on CUDA).
        size = 3 * m + g * m + g * m * w
        self._device_inputs = torch.zeros(size, dtype=torch.long, device=device)
        if device.type == "cpu":
            self._host_inputs = self._device_inputs
        else:
            self._host_inputs = torch.zeros_like(self._device_inputs, device="cpu").pin_memory()
        views = _views(self._device_inputs, m, w, g)
        self.ids, self.positions, self.seq_lens, self.slots, self.block_table = views
        self._host_views = _views(self._host_inputs, m, w, g)
        self._table_cols = w  # block-table columns past which every entry is zero
        self._pad(0, m)
        self._copy_in(m)
        self.logits: torch.Tensor | None = None  # [max_batch, vocab], made by the first run
        # When the last step's inputs have left the host staging buffer (CUDA).
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def captured_sizes(self) -> list[int]:
        """Padded batch sizes that replay a CUDA graph."""
        return sorted(self._graphs)

    def runs(self, num_rows: int) -> bool:
        """Whether a decode step of this many rows goes through here."""
        return 0 < num_rows <= self.max_batch

    def padded_size(self, num_rows: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_rows)]

    def step(
        self,
        ids: list[int],
        positions: np.ndarray,
        slots: np.ndarray,
        block_tables: np.ndarray,
        pending: PendingIds | None = None,
    ) -> torch.Tensor:
        """Logits [rows, vocab] of one decode step, a view of the shared output buffer: read it
        (queue the reads) before the next step. Each row's position, its slot in each group
        [groups, rows] and its block tables [groups, rows, cols] (cols: as far as the furthest
        row reaches); ``pending``: ids that are the launched step's picks."""
        n = len(ids)
        b = self.padded_size(n)
        cols = block_tables.shape[2]
        host_ids, host_positions, host_seq_lens, host_slots, host_table = (
            v.numpy() for v in self._host_views
        )
        # The previous step's copy out of the staging buffer may still be queued behind the
        # step before it (async scheduling launches a step before the last one is collected).
        if self._copied is not None:
            self._copied.synchronize()
        host_ids[:n] = ids
        host_positions[:n] = positions
        host_seq_lens[:n] = positions + 1
        host_slots[:, :n] = slots
        # Entries past every row's are zero (block 0): only those a step wrote can be other.
        if self._table_cols > cols:
            host_table[:, :, cols : self._table_cols] = 0
        self._table_cols = cols
        host_table[:, :n, :cols] = block_tables
        self._pad(n, b)
        self._copy_in(b)
        if pending is not None:
            pending.apply(self.ids)
        self.replay(b)
        assert self.logits is not None
        return self.logits[:n]

    def replay(self, b: int) -> None:
        """Run the step of padded size ``b`` over the buffers: its graph, else eagerly."""
        graph = self._graphs.get(b)
        if graph is not None:
            graph.replay()
        else:
            self._forward(b)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record a CUDA graph of every padded size, largest first (CUDA only). A size whose
        capture fails (an op that waits for the host, a data-dependent shape) runs eagerly."""
        assert self.device.type == "cuda"
        pool = None
        stream = torch.cuda.Stream(self.device)
        for b in reversed(self.sizes):
            self._forward(b)  # warm-up outside the capture: lazy initialization, the logits
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                # NOTE: the outer stream context restores the current stream when a capture
                # fails; torch.cuda.graph's own exit raises before it does, which would leave
                # every later step on the capture stream.
                with torch.cuda.stream(stream), torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._forward(b)
            except RuntimeError as e:
                logger.warning("decode steps of padded batch size %d run eagerly: %s", b, e)
                continue
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "CUDA graphs of decode steps captured for batch sizes %s", self.captured_sizes()
        )

    def _forward(self, b: int) -> None:
        """The decode step of the first ``b`` rows of the buffers, its logits into the shared
        buffer (the callable a graph records)."""
        fwd = decode_forward_batch(
            self.kv_caches, self.layout.layer_groups, self.block_size, self.slots,
            self.block_table, self.seq_lens, b,
        )  # fmt: skip
        hidden = self.model(self.ids[:b], self.positions[:b], fwd)
        buf = self.logits
        # The buffer is float32 whatever the model's dtype: the sampler works in float32, so a
        # bf16 model's logits are converted once, by the copy in the graph (at batch 256 a bf16
        # copy and a second pass over the [256, 262k] logits cost ~0.25 ms of device time a
        # step on an H200). float32 logits go straight in.
        direct = buf is not None and hidden.dtype == torch.float32
        logits = self.model.compute_logits(hidden, buf[:b] if direct else None)
        if buf is None:  # the first run is never captured: a warm-up or an eager step
            vocab = self.model.config.vocab_size
            buf = torch.empty(self.max_batch, vocab, dtype=torch.float32, device=self.device)
            self.logits = buf
        if not direct:
            buf[:b].copy_(logits)

    def _pad(self, start: int, end: int) -> None:
        """Rows start..end-1 of the host buffers become padding rows."""
        ids, positions, seq_lens, slots, table = (v.numpy() for v in self._host_views)
        ids[start:end] = 0
        positions[start:end] = 0
        seq_lens[start:end] = 1
        slots[:, start:end] = PAD_SLOT
        table[:, start:end, : self._table_cols] = 0

    def _copy_in(self, b: int) -> None:
        """The first ``b`` rows of every host buffer onto the device (a no-op on CPU)."""
        if self._host_inputs is self._device_inputs:
            return
        for dst, src in zip((self.ids, self.positions, self.seq_lens), self._host_views):
            dst[:b].copy_(src[:b], non_blocking=True)
        for dst, src in zip((self.slots, self.block_table), self._host_views[3:]):
            dst[:, :b].copy_(src[:, :b], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()


def _views(flat: torch.Tensor, m: int, w: int, g: int) -> tuple[torch.Tensor, ...]:
    """ids, positions, seq_lens [m], slots [g, m] and block tables [g, m, w] of one flat
    buffer."""
    head, slots, tables = flat.split([3 * m, g * m, g * m * w])
    return (*head.view(3, m).unbind(0), slots.view(g, m), tables.view(g, m, w))
