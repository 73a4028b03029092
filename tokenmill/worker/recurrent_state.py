"""The linear-attention layers' state slots of the running requests (attention/recurrent.py):
the hybrid models' counterpart of KV blocks, beside them.

A request takes a slot when the runner first sees it (a new request, or a preempted one that
resumes: it recomputes from its first token) and gives it back when it finishes or is
preempted. A slot is zeroed when taken: a request's state starts empty. The scheduler runs at
most ``max_num_seqs`` requests at once, the pool's size, so a slot is always free.
"""

from __future__ import annotations

import torch

from tokenmill.attention.recurrent import LayerState, RecurrentBatch, allocate_states
from tokenmill.config import ModelConfig
from tokenmill.worker.input_batch import ScheduledRequest


class RecurrentStatePool:
    def __init__(
        self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.states: list[LayerState] = allocate_states(config, num_slots, dtype, device)
        self.device = device
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._slots: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def assign(self, req_id: str) -> None:
        """A zeroed slot for a request that starts (or restarts) from its first token."""
        if not self._free:
            raise RuntimeError("no free recurrent-state slot: more requests than max_num_seqs")
        slot = self._free.pop()
        for conv, ssm in self.states:
            conv[slot].zero_()
            ssm[slot].zero_()
        self._slots[req_id] = slot

    def release(self, req_id: str) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def batch(self, reqs: list[ScheduledRequest]) -> RecurrentBatch:
        """The step's slots in its batch order (decodes first, as build_step_inputs lays
        them out)."""
        slots = [self._slots[r.req_id] for r in reqs]
        num_decodes = 0
        while num_decodes < len(reqs) and reqs[num_decodes].query_len == 1:
            num_decodes += 1
        decode_slots = torch.tensor(slots[:num_decodes], dtype=torch.long, device=self.device)
        return RecurrentBatch(slots, [r.query_len for r in reqs], num_decodes, decode_slots)
