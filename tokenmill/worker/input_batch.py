"""A step's flat batch: which tokens run, where their K/V go, and which rows give logits.

Every request scheduled in a step contributes ``query_len`` consecutive rows::

    | req A: 1 row | req B: 1 + K rows (verify) | req C: prefill chunk ...  | req D: chunk ... |
      decode rows, first: each row one query       query_len > 1: one attention call each, on
      over its own context (row j of B sees        top of the cache
      positions <= its own, as K+1 decodes would)

A request's rows run positions ``num_computed .. num_computed + query_len - 1``: first its known
tokens (prompt and outputs), then the draft tokens scheduled for it, if any. When the rows reach
its last known token, that row and every draft row predict a next token: ``1 + K`` logits rows
(``logits_indices``), each sampled; a prefill chunk that stops mid-prompt predicts nothing.

    positions:  | computed (in the cache) | known, run now | drafts |
                                             last known ^   ^ ^ ^  <- rows with logits
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention import AttentionMetadata, PrefillSeq
from tokenmill.reasoning import BudgetState
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import GrammarMatcher
from tokenmill.worker.sampler import SamplingRow
from tokenmill.worker.transfer import to_device


class BlockTables:
    """A request's block tables, one per group of layers (kv_layout.py): row g of one int64
    array, grown by doubling, zero (the null block) past each table's end.

    One array rather than a list per group: a decode step copies a request's tables into its
    row in one numpy call (RowTables), not a Python loop over groups (1,536 of them at 256
    requests of gemma-3's six groups).
    """

    __slots__ = ("_array", "_lengths", "version")

    def __init__(self, tables: Sequence[Sequence[int]]) -> None:
        width = max([16, *(len(t) for t in tables)])
        self._array = np.zeros((len(tables), width), dtype=np.int64)
        self._lengths = [len(t) for t in tables]
        self.version = 0  # counts the extends: a copy of the tables with another is stale
        for g, table in enumerate(tables):
            self._array[g, : len(table)] = table

    @property
    def num_groups(self) -> int:
        return len(self._lengths)

    def group(self, g: int) -> np.ndarray:
        """Group g's table (a view: valid until the next ``extend``)."""
        return self._array[g, : self._lengths[g]]

    def extend(self, g: int, block_ids: Sequence[int]) -> None:
        """Append blocks to group g's table."""
        start = self._lengths[g]
        end = start + len(block_ids)
        if end > self._array.shape[1]:
            self._grow(end)
        self._array[g, start:end] = block_ids
        self._lengths[g] = end
        self.version += 1

    @property
    def array(self) -> np.ndarray:
        """Every group's table [num_groups, width], zeros past each one's end (a view: valid
        until the next ``extend``)."""
        return self._array

    def _grow(self, width: int) -> None:
        array = np.zeros((self._array.shape[0], max(width, 2 * self._array.shape[1])), np.int64)
        array[:, : self._array.shape[1]] = self._array
        self._array = array


class RowTables:
    """The block tables of a decode step's rows [groups, rows, cols], kept from step to step.

    A row is written only when it holds another request's tables than in the step before, or
    that request's tables grew: a few rows a step of hundreds, where stacking every row's
    tables anew cost ~0.7 us a row (0.18 ms at 256 requests).
    """

    def __init__(self, num_groups: int) -> None:
        self._array = np.zeros((num_groups, 0, 0), dtype=np.int64)
        self._owners: list[BlockTables | None] = []  # whose tables each row holds
        self._versions: list[int] = []  # at which version
        self._widths: list[int] = []  # each row's columns that may be non-zero

    def take(self, row_tables: list[BlockTables], cols: int) -> np.ndarray:
        """Row i of the result: ``row_tables[i]``'s first ``cols`` entries of each group, zeros
        past a table's end (a view: valid until the next call)."""
        n = len(row_tables)
        if n > self._array.shape[1] or cols > self._array.shape[2]:
            self._grow(n, cols)
        array, owners, versions, widths = self._array, self._owners, self._versions, self._widths
        for i, tables in enumerate(row_tables):
            if owners[i] is tables and versions[i] == tables.version:
                continue
            src = tables.array
            width = min(src.shape[1], array.shape[2])
            array[:, i, :width] = src[:, :width]
            if widths[i] > width:  # the previous owner's longer tables
                array[:, i, width : widths[i]] = 0
            owners[i], versions[i], widths[i] = tables, tables.version, width
        return array[:, :n, :cols]

    def _grow(self, rows: int, cols: int) -> None:
        """Room for ``rows`` x ``cols`` (doubling); every row is written again."""
        groups, old_rows, old_cols = self._array.shape
        rows, cols = max(rows, 2 * old_rows), max(cols, 2 * old_cols, 16)
        self._array = np.zeros((groups, rows, cols), dtype=np.int64)
        self._owners = [None] * rows
        self._versions = [0] * rows
        self._widths = [0] * rows


@dataclass(slots=True)
class RequestState:
    """What the worker keeps of a request between steps."""

    # Prompt + outputs known to the worker. The last may be a placeholder (``pending_token``)
    # for a token a launched step picked whose id is still on the device (async scheduling).
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: BlockTables  # per group of layers (kv_layout.py), its block table
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...]
    # The next prompt position whose log-prob is owed (with SamplingParams.prompt_logprobs).
    next_prompt_logprob_idx: int = 1
    grammar: GrammarMatcher | None = None  # its structured-output format, at its last token
    thinking: BudgetState | None = None  # its thinking budget, at its last token
    # An embedding request's pooled hidden states so far (mean: their sum; cls: the first's).
    pooled: torch.Tensor | None = None
    # Its sampling row when it reads no tokens (no penalties, no min_tokens, no drafts): the
    # same every step, so made once (model_runner._sampling_rows).
    plain_row: SamplingRow | None = None


def pending_token(row: int) -> int:
    """The placeholder of a token that is pick ``row`` of the launched step (negative: never a
    real id)."""
    return -1 - row


def pending_rows(first_row: int, tokens: list[int]) -> list[tuple[int, int]]:
    """(row, pick) of each placeholder among ``tokens``, a step's input ids from its row
    ``first_row`` on: only a request's last token can be one."""
    if tokens and tokens[-1] < 0:
        return [(first_row + len(tokens) - 1, -1 - tokens[-1])]
    return []


@dataclass(frozen=True, slots=True)
class PendingIds:
    """A step's input ids that are picks of the step launched before it, still on the device
    (async scheduling): row ``rows[i]`` of the step takes pick ``picks[i]``."""

    rows: list[int]
    picks: list[int]
    sampled: torch.Tensor  # [the launched step's picks] long, on the device

    def apply(self, input_ids: torch.Tensor) -> None:
        """Write the picks into a step's input ids on the device (no wait for the host)."""
        dst = to_device(self.rows, input_ids, torch.long)
        src = to_device(self.picks, input_ids, torch.long)
        input_ids.index_copy_(0, dst, self.sampled.index_select(0, src))


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's rows in the step."""

    req_id: str
    token_start: int  # its first row in the flat batch
    num_computed: int  # the position of that row: tokens already in the cache
    query_len: int  # rows this step, drafts included
    draft_token_ids: list[int]  # the last len(draft_token_ids) rows run these
    logits_start: int  # its first entry in StepInputs.logits_indices
    num_logits: int  # 1 + len(draft_token_ids) if the rows reach the last known token, else 0

    @property
    def is_decode(self) -> bool:
        return is_decode(self.query_len, len(self.draft_token_ids))


def is_decode(query_len: int, num_drafts: int) -> bool:
    """One row, or a request's next token plus its drafts: every row is attended as a decode
    query (a prompt chunk of several known tokens is not)."""
    return query_len == 1 or query_len == 1 + num_drafts > 1


@dataclass(frozen=True, slots=True)
class PromptLogprobRows:
    """Rows of the flat batch whose logits give one request's prompt log-probs: row
    ``row_idx + i`` runs position ``first_pos - 1 + i`` and so predicts prompt token
    ``first_pos + i``."""

    req_id: str
    row_idx: int
    first_pos: int
    num_rows: int


@dataclass(frozen=True, slots=True)
class PoolingRows:
    """An embedding request's rows in a step: flat rows ``row_idx ..`` are its prompt positions
    ``first_pos ..``; ``ends_prompt``: the last of them is its last prompt token."""

    req_id: str
    row_idx: int
    first_pos: int
    num_rows: int
    ends_prompt: bool


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    attn: list[AttentionMetadata]  # per group of layers
    reqs: list[ScheduledRequest]  # in batch order
    logits_indices: torch.Tensor  # [num_logits] long: rows whose hidden states give logits
    prompt_logprob_rows: list[PromptLogprobRows]
    pooling_rows: list[PoolingRows]
    # (row, pick) of input ids that are placeholders for the launched step's picks.
    pending: list[tuple[int, int]]

    @property
    def sampling_reqs(self) -> list[ScheduledRequest]:
        """The requests that get new tokens this step, in the order of their logits rows."""
        return [r for r in self.reqs if r.num_logits]


def build_step_inputs(
    requests: dict[str, RequestState],
    num_scheduled_tokens: dict[str, int],
    num_computed: dict[str, int],
    draft_token_ids: dict[str, list[int]],
    block_size: int,
    device: torch.device,
    gather_workspace: Callable[[int], tuple[torch.Tensor, torch.Tensor] | None],
    group_windows: tuple[int | None, ...] = (None,),
) -> StepInputs:
    """Lay the scheduled tokens out flat: decodes (with their drafts) first, then the others,
    with attention metadata for each group of layers (kv_layout.py), whose layers attend within
    ``group_windows[group]`` tokens (None: all).
    ``gather_workspace(num_blocks)``: reused buffers for the decode attention's block gather."""
    decodes = {
        rid
        for rid, n in num_scheduled_tokens.items()
        if is_decode(n, len(draft_token_ids.get(rid, ())))
    }
    order = [rid for rid in num_scheduled_tokens if rid in decodes]
    order += [rid for rid in num_scheduled_tokens if rid not in decodes]
    ids: list[int] = []
    positions: list[int] = []
    reqs: list[ScheduledRequest] = []
    logits_indices: list[int] = []
    prompt_rows: list[PromptLogprobRows] = []
    pooling_rows: list[PoolingRows] = []
    pending: list[tuple[int, int]] = []
    for rid in order:
        state, start, n = requests[rid], num_computed[rid], num_scheduled_tokens[rid]
        drafts = draft_token_ids.get(rid, [])
        row = len(ids)
        known = state.token_ids[start : start + n - len(drafts)]
        pending += pending_rows(row, known)
        ids.extend(known)
        ids.extend(drafts)
        positions.extend(range(start, start + n))
        last_known = len(state.token_ids) - 1  # its row predicts the first new token
        num_logits = 1 + len(drafts) if start + n > last_known else 0
        if state.sampling_params.pooling is not None:  # pooled, never sampled
            pooling_rows.append(PoolingRows(rid, row, start, n, start + n > last_known))
            num_logits = 0
        first_logit_row = row + last_known - start
        reqs.append(ScheduledRequest(rid, row, start, n, drafts, len(logits_indices), num_logits))
        logits_indices.extend(range(first_logit_row, first_logit_row + num_logits))
        rows = prompt_logprob_rows(state, rid, row, start, n)
        if rows is not None:
            prompt_rows.append(rows)
    dev = device
    gather_buffers = None
    attn = []
    for group in range(len(group_windows)):
        meta = _attention_metadata(
            requests, reqs, group, group_windows[group], block_size, device, gather_buffers
        )
        if gather_buffers is None and meta.num_decodes:  # the same size in every group
            meta.gather_buffers = gather_buffers = gather_workspace(meta.decode_block_table.numel())
        attn.append(meta)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
        positions=torch.tensor(positions, dtype=torch.long, device=dev),
        attn=attn,
        reqs=reqs,
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
        prompt_logprob_rows=prompt_rows,
        pooling_rows=pooling_rows,
        pending=pending,
    )


def _attention_metadata(
    requests: dict[str, RequestState],
    reqs: list[ScheduledRequest],
    group: int,
    window: int | None,
    block_size: int,
    device: torch.device,
    gather_buffers: tuple[torch.Tensor, torch.Tensor] | None,
) -> AttentionMetadata:
    """One group's metadata (its layers attend within ``window``, None: all): decode rows as one
    batched decode (a padded block table, a row per query); each longer query as a chunk on top
    of its computed context."""
    slots: list[int] = []
    for r in reqs:
        blocks = requests[r.req_id].block_ids.group(group)
        slots.extend(_slots(blocks, r.num_computed, r.query_len, block_size))
    decodes = [r for r in reqs if r.is_decode]
    # (request, position) of every decode row: a verify request's rows at consecutive positions.
    rows = [(r.req_id, r.num_computed + j) for r in decodes for j in range(r.query_len)]
    max_blocks = max((p // block_size + 1 for _, p in rows), default=1)
    table = np.zeros((len(rows), max_blocks), dtype=np.int64)
    for i, (rid, p) in enumerate(rows):
        # Entries before the row's window stay the null block 0: no kernel reads them.
        first = 0 if window is None else max(0, p - window + 1) // block_size
        end = p // block_size + 1
        table[i, first:end] = requests[rid].block_ids.group(group)[first:end]
    seq_lens = torch.tensor([p + 1 for _, p in rows], dtype=torch.long)
    chunks = []
    for r in reqs[len(decodes) :]:
        seq_len = r.num_computed + r.query_len
        blocks = requests[r.req_id].block_ids.group(group)[: -(-seq_len // block_size)]
        block_ids = torch.tensor(blocks, dtype=torch.long, device=device)
        chunks.append(PrefillSeq(r.token_start, r.query_len, r.num_computed, block_ids))
    return AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decodes=len(rows),
        decode_block_table=torch.from_numpy(table).to(device),
        decode_seq_lens=seq_lens.to(device),
        prefills=chunks,
        gather_buffers=gather_buffers,
    )


def _slots(block_ids: np.ndarray, start: int, num_tokens: int, block_size: int) -> list[int]:
    """Cache slots of positions ``start .. start + num_tokens - 1`` of one block table."""
    if num_tokens <= 8:  # decode rows: plain Python beats numpy's per-call cost
        return [int(block_ids[p // block_size]) * block_size + p % block_size
                for p in range(start, start + num_tokens)]  # fmt: skip
    first = start // block_size
    blocks = block_ids[first : (start + num_tokens - 1) // block_size + 1]
    positions = np.arange(start, start + num_tokens)
    return (blocks[positions // block_size - first] * block_size + positions % block_size).tolist()


def prompt_logprob_rows(
    state: RequestState, req_id: str, row_idx: int, start: int, num_tokens: int
) -> PromptLogprobRows | None:
    """The rows of a request's chunk (positions ``start ..``, flat rows ``row_idx ..``) whose
    next token is a prompt token still owed a log-prob; None if there are none.

    chunk positions:  | sent before a preemption | lo .. hi - 1: ours | P - 1 |
    Position P - 1 (the last prompt token) predicts the first output token: the sampler's row.
    """
    if state.sampling_params.prompt_logprobs is None:
        return None
    lo = max(start, state.next_prompt_logprob_idx - 1)
    hi = min(start + num_tokens, state.num_prompt_tokens - 1)
    if hi <= lo:
        return None
    return PromptLogprobRows(req_id, row_idx + lo - start, lo + 1, hi - lo)
