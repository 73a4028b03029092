"""Decode steps replayed from a recording: CUDA graphs' idea on the CPU.

A batch-1 decode step of gemma-3-270m calls ~250 C kernels. Called one by one from Python, each
pays 10-40 us of interpreter and dispatch cost; together that is about as much time as the
arithmetic of the whole step. So the first decode-only step of each batch size runs eagerly
inside ``recording()`` (kernels/recording.py), on fixed input buffers. If every computation in
it went through a recorded kernel (checked by watching torch's dispatcher: only views and
allocations may run outside one), its calls become a ``Graph`` (kernels/graph.py), which later
steps of that size replay in one C call after writing their inputs into the buffers. A model or
mode whose decode step computes anything with torch (a float checkpoint's F.linear, the torch
kernel backend, ...) is not captured and keeps running eagerly; nothing else changes.

The input buffers are sized for the largest batch: token ids, positions and sequence lengths,
and per group of layers (kv_layout.py) slots and block tables [max_batch, max_blocks_per_seq]; a
graph of batch size B uses their first B rows; every graph writes its logits into the first B rows of one buffer. What a step allocates
while it is recorded (its intermediates) moves into one scratch buffer that all graphs share
(one step runs at a time): a graph holds no memory of its own beyond its list of calls. A replay
is checked once, right after its capture, against the eager step it recorded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenmill.attention import decode_forward_batch
from tokenmill.kernels import cpu_library
from tokenmill.kernels.graph import Graph, Scratch
from tokenmill.kernels.recording import recording
from tokenmill.kv_layout import KVLayout
from tokenmill.models.base import CausalLM
from tokenmill.worker.input_batch import PendingIds

logger = logging.getLogger(__name__)

# Ops that allocate without computing: a recorded step may call these outside its kernels.
_ALLOCATIONS = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided}


def graphs_supported(device: torch.device) -> bool:
    """Whether decode steps can be recorded here: CPU tensors and the C kernels built."""
    return device.type == "cpu" and cpu_library.available()


class _ComputeWatch(TorchDispatchMode):
    """Notes every torch op that computes (anything but a view or an allocation), and the
    storages allocated (the step's intermediates)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # NOTE: by default torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable, whose
        # first call imports torch._dynamo (and with it sympy and triton): ~1.5 s and ~140 MiB
        # resident, for a guard against torch.compile inside the mode, which a recorded step
        # never runs.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.computed: list[str] = []
        self.allocated: set[int] = set()  # storage base addresses

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _ALLOCATIONS:
            self.allocated.add(out.untyped_storage().data_ptr())
        elif not func.is_view:
            self.computed.append(str(func))
        return out


@dataclass(slots=True)
class _Captured:
    graph: Graph
    logits: torch.Tensor  # [batch, vocab]: where each replay leaves its logits


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, ...]],
        layout: KVLayout,
        block_size: int,
        max_blocks_per_seq: int,
        max_batch: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.layout = layout
        self.block_size = block_size
        self.max_batch = max_batch
        long = dict(dtype=torch.long)
        self.ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.seq_lens = torch.zeros(max_batch, **long)
        num_groups = layout.num_groups
        self.slots = torch.zeros(num_groups, max_batch, **long)
        # NOTE: numpy's zeros: a large one is calloc'd, its pages zeroed as first written (a
        # row per batch row used, a table per group: 3 MiB for gemma-3-270m at 8k context).
        table = np.zeros((num_groups, max_batch, max_blocks_per_seq), dtype=np.int64)
        self.block_table = torch.from_numpy(table)
        # Every graph writes its logits into the first rows of this one buffer: one [B, vocab]
        # float32 tensor per batch size would hold ~0.5 GB for sizes up to 32 (262k vocab).
        self.logits = torch.empty(max_batch, model.config.vocab_size, dtype=torch.float32)
        # The intermediates of every graph: one step runs at a time.
        self.scratch = Scratch()
        # Batch size -> its graph, or None once it proved not capturable.
        self._captured: dict[int, _Captured | None] = {}

    def captured_sizes(self) -> list[int]:
        """Batch sizes whose decode steps replay a graph."""
        return sorted(b for b, c in self._captured.items() if c is not None)

    def graph(self, batch_size: int) -> Graph:
        """The graph decode steps of this size replay (one of ``captured_sizes``)."""
        captured = self._captured.get(batch_size)
        if captured is None:
            raise ValueError(f"no decode graph for batch size {batch_size}")
        return captured.graph

    def runs(self, batch_size: int) -> bool:
        """Whether decode steps of this size go through here (captured, or not yet tried)."""
        return batch_size <= self.max_batch and self._captured.get(batch_size, True) is not None

    def step(
        self,
        ids: list[int],
        positions: np.ndarray,
        slots: np.ndarray,
        block_tables: np.ndarray,
        pending: PendingIds | None = None,
    ) -> torch.Tensor:
        """Logits [batch, vocab] of one decode step: replayed, or run eagerly while capturing.
        Each row's position, its slot in each group [groups, rows] and its block tables
        [groups, rows, cols]; ``pending``: ids that are the launched step's picks. The tensor
        is the graph's output buffer: read it before the next step."""
        b = len(ids)
        # NOTE: through numpy views: a torch copy per buffer costs more than the writes.
        self.ids.numpy()[:b] = ids
        if pending is not None:
            pending.apply(self.ids)
        self.positions.numpy()[:b] = positions
        self.seq_lens.numpy()[:b] = positions + 1
        self.slots.numpy()[:, :b] = slots
        # Entries past a row's columns keep older steps' ids: no kernel reads past its length.
        self.block_table.numpy()[:, :b, : block_tables.shape[2]] = block_tables
        captured = self._captured.get(b)
        if captured is not None:
            captured.graph.replay()
            return captured.logits
        return self._capture(b)

    def _capture(self, b: int) -> torch.Tensor:
        fwd = decode_forward_batch(
            self.kv_caches, self.layout.layer_groups, self.block_size, self.slots,
            self.block_table, self.seq_lens, b,
        )  # fmt: skip
        watch = _ComputeWatch()
        with recording() as rec, watch:
            hidden = self.model(self.ids[:b], self.positions[:b], fwd)
            out = self.logits[:b] if hidden.dtype == self.logits.dtype else None
            logits = self.model.compute_logits(hidden, out)
        if watch.computed:
            logger.info(
                "decode steps of batch size %d run eagerly: %s computes outside the C kernels",
                b,
                watch.computed[0],
            )
            self._captured[b] = None
            return logits
        watch.allocated.discard(logits.untyped_storage().data_ptr())  # read after each replay
        graph = Graph(rec, self.scratch, watch.allocated)
        del rec, hidden
        expected = logits.clone()
        graph.replay()  # writes the same K/V into the same slots again: harmless
        if not torch.equal(logits, expected):
            logger.warning("decode graph of batch size %d differs from its eager step", b)
            self._captured[b] = None
            return expected
        self._captured[b] = _Captured(graph, logits)
        logger.info("decode steps of batch size %d replay a graph of %d kernels", b, len(graph))
        return logits
