"""LLMEngine: the synchronous engine. Requests in as text or ids, RequestOutputs out.

add_request:  validated, tokenized here -> EngineCore.add_requests (its sequences)
step():       EngineCore.step() (schedule -> execute -> update: RequestUpdates)
              -> OutputProcessor (detokenize, stop strings) -> list[RequestOutput]
              (a stop string's sequences -> EngineCore.finish_requests)

The engine holds no tensors and imports no torch: the model side (device, weights, KV cache,
decode graphs) sits behind the core's executor (tokenmill/executor), which it reaches only
through SchedulerOutput / RunnerOutput, plain data. With async scheduling the core returns a
launched step's updates a call later (engine_core.py); with ``core_process`` the core runs in
a process of its own, and a step returns what it sent meanwhile (core_process.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

from tokenmill.config import EngineArgs, EngineConfig, WorkerInfo
from tokenmill.core import Scheduler
from tokenmill.engine.core_process import CoreProcess
from tokenmill.engine.engine_core import EngineCore, window_capacity
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.executor import Executor
from tokenmill.memory import human_bytes, resident_bytes
from tokenmill.outputs import EngineInfo, EngineStats, RequestOutput
from tokenmill.pooling import Pooling, serving_pooling
from tokenmill.reasoning import (
    REASONING_TAGS,
    THINK_END,
    THINK_START,
    ThinkingBudget,
    prompt_opens_thinking,
    reasoning_format,
)
from tokenmill.request import FinishReason, Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.compiler import CompiledGrammar, GrammarCompiler
from tokenmill.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated, tokenized request, ready to enter the scheduler."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: CompiledGrammar | None = None  # params.structured_outputs, compiled
    thinking: ThinkingBudget | None = None  # params.max_thinking_tokens, for this prompt


class LLMEngine:
    """``core``: the engine core to front, started from ``args`` (EngineCore here, or with
    ``args.core_process`` in a process of its own) when not given."""

    def __init__(self, args: EngineArgs, core: EngineCore | CoreProcess | None = None) -> None:
        started = time.monotonic()
        if core is None:
            core = CoreProcess(args) if args.core_process else EngineCore(args)
        self.core = core
        worker = self.core.worker
        model_config = worker.model_config
        assert model_config.source is not None
        before_tokenizer = resident_bytes()
        self.tokenizer: Tokenizer = load_tokenizer(
            model_config.source.path, model_config.architecture
        )
        if args.chat_template is not None:
            self.tokenizer.chat_template = template_text(args.chat_template)
        elif (warning := self.tokenizer.chat_template_warning()) is not None:
            logger.warning(warning)
        # The memory plan's line (the worker's) leaves the tokenizer out: it is the engine's.
        after_tokenizer = resident_bytes()
        tokenizer_bytes = (
            after_tokenizer - before_tokenizer
            if after_tokenizer is not None and before_tokenizer is not None
            else None
        )
        self.config = self.core.config
        self.eos_token_ids = tuple(
            dict.fromkeys(model_config.eos_token_ids + self.tokenizer.stop_token_ids)
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer, model_config.vocab_size, self.eos_token_ids, args.json_number_digits
        )
        # The model's reasoning format (reasoning.py): "think", "harmony", or None.
        self.reasoning = reasoning_format(self.tokenizer.chat_template, args.reasoning_parser)
        self._think_ids = None
        if self.reasoning is not None:
            start, end = REASONING_TAGS[self.reasoning]
            self._think_ids = (self._tag_ids(start), self._tag_ids(end))
        self._ids = itertools.count()
        # How it pools embeddings when it serves them (pooling.py), or None: it generates.
        pooling = serving_pooling(args.task, model_config.source.path)
        self.info = _engine_info(args, worker, self.config, self.reasoning, pooling)
        resident = resident_bytes()
        logger.info(
            "loaded %s (%s, %s%s on %s) in %.1fs; KV cache (%s): %d blocks of %d tokens, up to %d "
            "tokens a request (%.2f GiB); tokenizer %s, resident now %s",
            args.model,
            model_config.architecture,
            worker.dtype,
            f", {worker.quantization} weights" if worker.quantization else "",
            worker.device,
            time.monotonic() - started,
            _kv_cache_dtype_name(args.kv_cache_dtype, worker.dtype),
            self.info.num_kv_blocks,
            args.block_size,
            self.info.num_kv_tokens,
            self.info.kv_cache_nbytes / 2**30,
            "?" if tokenizer_bytes is None else human_bytes(max(tokenizer_bytes, 0)),
            "?" if resident is None else human_bytes(resident),
        )
        if any(w is not None for w in self.config.cache_config.group_windows):
            logger.info("%s", window_capacity(self.config))

    @classmethod
    def from_args(cls, **kwargs: object) -> LLMEngine:
        unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise ValueError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(EngineArgs(**kwargs))  # type: ignore[arg-type]

    @property
    def scheduler(self) -> Scheduler:
        """The in-process core's scheduler (tests and benchmarks look into it)."""
        return self._local_core().scheduler

    @property
    def executor(self) -> Executor:
        """The in-process core's executor."""
        return self._local_core().executor

    def _local_core(self) -> EngineCore:
        if not isinstance(self.core, EngineCore):
            raise AttributeError("the engine core runs in a process of its own (core_process)")
        return self.core

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler_config.max_model_len

    # ---- requests ---------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        vocab = self.config.model_config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt)
            # NOTE: the embedding kernels index rows unchecked: a tokenizer that disagrees with
            # the model (a GGUF's BOS id past its vocabulary) must not reach them.
            if ids and not 0 <= min(ids) <= max(ids) < vocab:
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise ValueError(
                    f"the tokenizer produced token id {bad}, outside the model's vocabulary "
                    f"of {vocab}: the model's tokenizer does not match its weights"
                )
            return ids
        if not prompt:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return list(prompt)

    def prepare_request(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> PreparedRequest:
        """Validate and tokenize without touching engine state (safe from any thread).

        Raises ValueError naming the field at fault.
        """
        params = params or SamplingParams()
        prompt_ids = self.tokenize_prompt(prompt)
        params = self._resolve_max_tokens(params, len(prompt_ids))
        grammar = None
        if params.structured_outputs is not None:  # here, off the step loop (and cached)
            grammar = self.grammar_compiler.compile(params.structured_outputs)
        text = prompt if isinstance(prompt, str) else None
        thinking = self._thinking_budget(params, prompt_ids)
        return PreparedRequest(text, prompt_ids, params, grammar, thinking)

    def _thinking_budget(
        self, params: SamplingParams, prompt_ids: list[int]
    ) -> ThinkingBudget | None:
        if params.max_thinking_tokens is None:
            return None
        if self._think_ids is None:
            raise ValueError(
                "max_thinking_tokens needs a reasoning model (one whose chat template thinks in "
                f"{THINK_START}...{THINK_END}, or --reasoning-parser naming its format); "
                f"{self.info.model} is not one"
            )
        if params.structured_outputs is not None:
            raise ValueError(
                "max_thinking_tokens does not combine with structured outputs yet (their format "
                "would hold the thinking too); drop one of them"
            )
        start_ids, end_ids = self._think_ids
        opened = self.reasoning == "think" and prompt_opens_thinking(self.tokenizer, prompt_ids)
        return ThinkingBudget(params.max_thinking_tokens, start_ids, end_ids, opened)

    def _tag_ids(self, tag: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(tag, add_special_tokens=False))

    def add_request(
        self,
        prompt: str | list[int] | PreparedRequest,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError on bad input."""
        prepared = (
            prompt if isinstance(prompt, PreparedRequest) else self.prepare_request(prompt, params)
        )
        params = prepared.params
        request_id = request_id or str(next(self._ids))
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = [
            Request(
                req_id=request_id if i == 0 else f"{request_id}#{i}",
                prompt_token_ids=prepared.prompt_token_ids,
                sampling_params=_child_params(params, i),
                eos_token_ids=self.eos_token_ids,
                grammar=prepared.grammar,
                thinking=prepared.thinking,
                wait_for_req_id=request_id if i > 0 else None,
            )
            for i in range(params.n)
        ]
        # The core first, as it checks its ids: "a#1" is also the second sequence of request "a".
        self.core.add_requests(seqs, cache_salt)
        try:
            self.output_processor.add_request(request_id, prepared.prompt, seqs, params)
        except BaseException:
            self.core.finish_requests([req.req_id for req in seqs], FinishReason.ABORT)
            raise
        return request_id

    def _resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Check params against the model (vocabulary, context) and fill max_tokens in."""
        vocab = self.config.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            # NOTE: the sampler indexes logits with these (min_tokens bans them).
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}); got {bad[:5]}")
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}); got {bad[:5]}")
        if params.pooling is not None:  # the prompt alone runs: it may fill the context
            if prompt_len > self.max_model_len:
                raise ValueError(
                    f"prompt has {prompt_len} tokens, the model's context is "
                    f"{self.max_model_len}: shorten it"
                )
            return dataclasses.replace(params, max_tokens=1)
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(
                f"prompt has {prompt_len} tokens, the model's context is {self.max_model_len}: "
                "no room for output; shorten the prompt"
            )
        if params.max_tokens is None:
            return dataclasses.replace(params, max_tokens=room)
        if prompt_len + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length ({self.max_model_len}); lower max_tokens to at most {room}"
            )
        return params

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is; its blocks are free on return."""
        self.core.finish_requests(self.output_processor.seq_ids(request_id), FinishReason.ABORT)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether a step has anything to do (EngineCore.has_unfinished_requests)."""
        return self.core.has_unfinished_requests()

    # ---- one step ---------------------------------------------------------------------------

    def step(self, unread: Container[str] = ()) -> list[RequestOutput]:
        """One step: the outputs of the core's step (with async scheduling, of the step it
        launched the call before), a request's changes in one output.

        ``unread``: requests whose reader has not yet taken their last output. Their delta
        outputs wait until it has (or they finish): the next one carries every step's
        changes since, as the reader would have joined them, and none is built meanwhile.
        """
        updates = self.core.step()
        # Sequences a stop string ended: the core ends them (a token it ran past the stop in a
        # step it had launched is dropped by the output side, whose sequence has finished).
        stopped = self.output_processor.process(updates)
        if stopped:
            self.core.finish_requests(stopped, FinishReason.STOP)
        outputs = self.output_processor.collect(unread)
        for request_id, error in self.output_processor.pop_failed().items():
            outputs.append(self._fail_request(request_id, error))
        return outputs

    def _fail_request(self, request_id: str, error: str) -> RequestOutput:
        """One request failed outside the model (its output processing): free its blocks and
        end it with the error; the step and every other request go on."""
        self.core.finish_requests(self.output_processor.seq_ids(request_id), FinishReason.ABORT)
        out = self.output_processor.fail(request_id, error)
        assert out is not None
        return out

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    @property
    def num_free_blocks(self) -> int:
        return self.core.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.info.num_kv_blocks

    def stats(self) -> EngineStats:
        """The engine's load now (call from the thread that steps it)."""
        return self.core.stats()

    def shutdown(self) -> None:
        """Release the model and the KV cache; the engine takes no more steps."""
        self.core.shutdown()


def template_text(value: str) -> str:
    """A chat template given as a file's path or as its text."""
    with contextlib.suppress(OSError, ValueError):
        path = Path(value).expanduser()
        if "\n" not in value and path.is_file():
            return path.read_text()
    return value


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Siblings of an n > 1 request sample independently; seeded ones get distinct seeds."""
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed)


def _engine_info(
    args: EngineArgs,
    worker: WorkerInfo,
    config: EngineConfig,
    reasoning: str | None,
    pooling: Pooling | None,
) -> EngineInfo:
    cache = config.cache_config
    return EngineInfo(
        model=args.model,
        model_path=str(worker.model_config.source.path) if worker.model_config.source else "",
        architecture=worker.model_config.architecture,
        vocab_size=worker.model_config.vocab_size,
        max_model_len=worker.max_model_len,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        device=worker.device,
        dtype=worker.dtype,
        quantization=worker.quantization,
        weight_nbytes=worker.weight_nbytes,
        num_parameters=worker.num_parameters,
        weight_format=worker.model_config.source.format if worker.model_config.source else "hf",
        file_type=worker.model_config.file_type,
        kv_cache_dtype=cache.kv_cache_dtype,
        block_size=cache.block_size,
        num_kv_blocks=cache.num_blocks - 1,  # block 0 is the null block
        kv_cache_nbytes=cache.num_blocks * worker.kv_bytes_per_block,
        num_kv_tokens=worker.kv_layout.max_request_tokens(
            cache.num_blocks - 1, cache.block_size, config.scheduler_config.max_num_batched_tokens
        ),
        reasoning=reasoning,
        pooling=pooling,
    )


def _kv_cache_dtype_name(kv_cache_dtype: str, dtype_name: str) -> str:
    """The KV cache dtype as the startup log names it ("int8 + fp32 scales", "auto: float32")."""
    if kv_cache_dtype == "auto":
        return f"auto: {dtype_name}"
    if kv_cache_dtype == "float16":  # not quantized: no scales
        return kv_cache_dtype
    return f"{kv_cache_dtype} + fp32 scales"
