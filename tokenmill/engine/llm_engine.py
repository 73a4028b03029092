"""LLMEngine: the synchronous engine. A step is schedule -> execute -> update -> outputs.

add_request -> Scheduler.add_request                          (validated, tokenized here)
step():  Scheduler.schedule() -> ModelRunner.execute() -> Scheduler.update_from_output()
         -> OutputProcessor (detokenize, stop strings) -> list[RequestOutput]
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from tokenmill.config import (
    CacheConfig,
    EngineArgs,
    EngineConfig,
    SchedulerConfig,
    parse_memory,
    resolve_model,
)
from tokenmill.core import RunnerOutput, Scheduler
from tokenmill.engine.calibration import input_importance
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.kernels import default_kernel_backend
from tokenmill.models.loader import load_model, load_model_config
from tokenmill.outputs import RequestOutput
from tokenmill.quant import create_quant_method
from tokenmill.request import FinishReason, Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer, load_tokenizer
from tokenmill.worker.decode_graph import graphs_supported, warm_up_capture
from tokenmill.worker.model_runner import ModelRunner, kv_bytes_per_block

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated, tokenized request, ready to enter the scheduler."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        started = time.monotonic()
        device = _pick_device(args.device)
        # Decode-step graphs (CPU) need an import that takes ~2 s: done while the model loads.
        decode_graphs = not args.enforce_eager and graphs_supported(device)
        capture_warm_up = warm_up_capture() if decode_graphs else None
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        dtype_name = args.dtype if args.dtype != "auto" else "float32"
        if device.type == "cuda" and args.dtype == "auto":
            dtype_name = "bfloat16"
        dtype = _DTYPES[dtype_name]
        source = resolve_model(args.model)
        model_config = load_model_config(source)
        self.tokenizer: Tokenizer = load_tokenizer(source.path, model_config.architecture)
        max_model_len = args.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's context length "
                f"({model_config.max_position_embeddings})"
            )
        quantization = _pick_quantization(args.quantization, source.format, device)
        quant_method = (
            create_quant_method(quantization, args.packed_activations, args.int4_group_size)
            if quantization
            else None
        )
        importance = (
            input_importance(args, args.int4_calibration) if args.int4_calibration else None
        )
        kernels = default_kernel_backend(device)
        model = load_model(
            model_config, dtype, device, max_model_len, quant_method, importance, kernels
        )
        num_blocks = _num_kv_blocks(args, model_config, dtype, device)
        tokens_that_fit = (num_blocks - 1) * args.block_size
        if tokens_that_fit < max_model_len:
            raise ValueError(
                f"the KV cache holds {tokens_that_fit} tokens, fewer than max_model_len "
                f"({max_model_len}); raise kv_cache_memory or lower max_model_len"
            )
        self.config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=args.block_size,
                kv_cache_memory=parse_memory(args.kv_cache_memory),
                enable_prefix_caching=args.enable_prefix_caching,
                num_blocks=num_blocks,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            device=str(device),
            dtype=dtype_name,
            seed=args.seed,
            quantization=quantization,
        )
        self.eos_token_ids = tuple(
            dict.fromkeys(model_config.eos_token_ids + self.tokenizer.stop_token_ids)
        )
        self.runner = ModelRunner(
            model,
            num_blocks,
            args.block_size,
            device,
            dtype,
            self.eos_token_ids,
            args.seed,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=max_model_len,
            decode_graphs=decode_graphs,
            max_num_seqs=self.config.scheduler_config.max_num_seqs,
            capture_warm_up=capture_warm_up,
        )
        self.scheduler = Scheduler(self.config.scheduler_config, self.config.cache_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        kv_bytes = num_blocks * kv_bytes_per_block(
            model_config, args.block_size, dtype, args.kv_cache_dtype
        )
        logger.info(
            "loaded %s (%s, %s%s on %s) in %.1fs; KV cache (%s): %d blocks of %d = %d tokens "
            "(%.2f GiB)",
            args.model,
            model_config.architecture,
            dtype_name,
            f", {quantization} weights" if quantization else "",
            device,
            time.monotonic() - started,
            _kv_cache_dtype_name(args.kv_cache_dtype, dtype_name),
            num_blocks - 1,
            args.block_size,
            tokens_that_fit,
            kv_bytes / 2**30,
        )

    @classmethod
    def from_args(cls, **kwargs: object) -> LLMEngine:
        known = {k: v for k, v in kwargs.items() if k in EngineArgs.field_names()}
        extra = {k: v for k, v in kwargs.items() if k not in known}
        return cls(EngineArgs(**known, extra=extra))  # type: ignore[arg-type]

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler_config.max_model_len

    # ---- requests ---------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise ValueError("prompt must not be empty")
        vocab = self.config.model_config.vocab_size
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
        return PreparedRequest(prompt if isinstance(prompt, str) else None, prompt_ids, params)

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
                wait_for_req_id=request_id if i > 0 else None,
            )
            for i in range(params.n)
        ]
        # Checked before any state changes: "a#1" is also the second sequence of request "a".
        taken = [req.req_id for req in seqs if req.req_id in self.scheduler.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        self.output_processor.add_request(request_id, prepared.prompt, seqs, params)
        for req in seqs:
            self.scheduler.add_request(req, cache_salt)
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
        for seq_id in self.output_processor.seq_ids(request_id):
            self.scheduler.finish_request(seq_id, FinishReason.ABORT)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and not (sched_out.finished_req_ids or sched_out.preempted_req_ids):
            runner_out = RunnerOutput(sampled_token_ids={})
        else:
            runner_out = self.runner.execute(sched_out)
        updates = self.scheduler.update_from_output(sched_out, runner_out)
        for seq_id in self.output_processor.process(updates):
            self.scheduler.finish_request(seq_id, FinishReason.STOP)
        return self.output_processor.collect()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.scheduler.kv.pool.num_usable_blocks


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Siblings of an n > 1 request sample independently; seeded ones get distinct seeds."""
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed)


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N]; got {name!r}")
    return torch.device(name)


def _kv_cache_dtype_name(kv_cache_dtype: str, dtype_name: str) -> str:
    """The KV cache dtype as the startup log names it ("int8 + fp32 scales", "auto: float32")."""
    if kv_cache_dtype == "auto":
        return f"auto: {dtype_name}"
    return f"{kv_cache_dtype} + fp32 scales"


def _num_kv_blocks(args: EngineArgs, config, dtype: torch.dtype, device: torch.device) -> int:
    budget = parse_memory(args.kv_cache_memory)
    if isinstance(budget, float):
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = int(free * budget)
    per_block = kv_bytes_per_block(config, args.block_size, dtype, args.kv_cache_dtype)
    num_blocks = budget // per_block
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory ({budget} bytes) holds fewer than 2 KV blocks of {per_block} bytes"
        )
    return int(num_blocks)


def _pick_quantization(
    requested: str | None, source_format: str, device: torch.device
) -> str | None:
    """The weight scheme to load with (None: float weights in the model dtype)."""
    if requested is None:
        # A GGUF's quantized tensors stay packed on CPUs (the packed kernel is a CPU kernel).
        requested = "gguf" if source_format == "gguf" and device.type == "cpu" else "none"
    if requested == "gguf" and source_format != "gguf":
        raise ValueError("quantization 'gguf' needs a .gguf model; use int8, int4 or none")
    return None if requested == "none" else requested
