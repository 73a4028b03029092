"""Worker: everything on the model side of one engine, behind the executor.

It picks the device and dtype, loads the model (quantizing or calibrating it as asked), sizes
the KV cache from the memory budget (``info``), and once the engine has settled the KV plan
(``initialize``) runs steps through its ModelRunner. A tensor-parallel worker per rank, or a
second worker for a draft model, is another instance of this class with its own arguments.
``resolve_worker_config`` settles what the arguments leave open on this machine (device,
dtype, weight format, kernels, the model's config as held); ``Worker`` builds from that.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.attention.recurrent import state_bytes_per_slot
from tokenmill.config import (
    CacheConfig,
    EngineArgs,
    ModelConfig,
    TensorParallel,
    WorkerInfo,
    parse_memory,
)
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.kernels import default_kernel_backend
from tokenmill.kv_layout import plan_kv_layout
from tokenmill.memory import available_memory, human_bytes, resident_bytes
from tokenmill.modelfile import read_gguf, resident_weight_bytes, summarize
from tokenmill.models.base import CausalLM
from tokenmill.models.loader import load_model, load_model_config
from tokenmill.quant import create_quant_method
from tokenmill.quant.half import stored_half_kind
from tokenmill.resolve import resolve_model
from tokenmill.spec import Proposer, create_proposer
from tokenmill.tokenizer import load_tokenizer
from tokenmill.worker.calibration import input_importance
from tokenmill.worker.cuda_graph import cuda_graphs_supported
from tokenmill.worker.decode_graph import graphs_supported
from tokenmill.worker.draft_proposer import DraftModelProposer
from tokenmill.worker.malloc import keep_freed_buffers
from tokenmill.worker.memory import (
    MemoryPlan,
    dummy_prefill,
    measure_cuda,
    plan,
    step_buffer_bytes,
)
from tokenmill.worker.model_runner import (
    ModelRunner,
    kv_bytes_per_block,
    max_logits_rows,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def call_worker(worker: Worker, method: str, args: tuple[Any, ...]) -> Any:
    """``worker.method(*args)``: what every executor's rank does with a ``collective_rpc``
    (ValueError for a name that is not one of the Worker's public methods)."""
    fn = None if method.startswith("_") else getattr(worker, method, None)
    if not callable(fn):
        raise ValueError(f"the Worker has no method {method!r}")
    return fn(*args)


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker runs, resolved from EngineArgs where the device is known
    (``resolve_worker_config``): the engine has no torch, so device, dtype, weight format,
    kernels and the model's config are settled here, and reported back in WorkerInfo."""

    args: EngineArgs  # the settings used as given: KV blocks, budgets, speculation, seed
    device: torch.device
    dtype_name: str  # "float32", "bfloat16", "float16"
    model_config: ModelConfig  # the checkpoint's, cut to its first layers or sharded as held
    max_model_len: int  # the context asked for or the model's (the KV cache may lower it)
    quantization: str | None  # how the weights sit in memory (pick_quantization)
    kernel_backend: str  # "torch", "cpu" or "triton"
    decode_graphs: bool  # replayed CPU decode-step graphs
    cuda_graphs: bool
    tp_rank: int = 0
    # False: one block table for every layer whatever their windows (a draft model's cache,
    # whose blocks worker/draft_proposer.py hands out).
    hybrid_kv: bool = True


def resolve_worker_config(
    args: EngineArgs, num_layers: int | None = None, tp_rank: int = 0, hybrid_kv: bool = True
) -> WorkerConfig:
    """``num_layers``: keep only the model's first layers (with its final norm and head), as
    an early-exit draft model does; ``tp_rank``: the tensor-parallel shard held."""
    device = pick_device(args.device)
    # NOTE: tensor-parallel ranks run eagerly: a graph records the C kernels, not the
    # all-reduces between them (nor, on CUDA, are NCCL calls captured yet).
    model_config = _truncated(load_model_config(resolve_model(args.model)), num_layers)
    check_recurrent(args, model_config)
    # NOTE: hybrid models (linear attention) too: no graph records their state slots yet.
    graphed = (
        not args.enforce_eager
        and args.tensor_parallel_size == 1
        and model_config.linear_attention is None
    )
    cuda_graphs = graphed and cuda_graphs_supported(device)
    max_model_len = _max_model_len(args, model_config)
    quantization = pick_quantization(args.quantization, model_config, device)
    if args.tensor_parallel_size > 1:
        check_tensor_parallel(args, model_config, quantization)
        model_config = dataclasses.replace(
            model_config, tp=TensorParallel(tp_rank, args.tensor_parallel_size)
        )
    kernels = args.kernel_backend
    if kernels == "auto":
        kernels = default_kernel_backend(device)
    return WorkerConfig(
        args=args,
        device=device,
        dtype_name=pick_dtype(args.dtype, device),
        model_config=model_config,
        max_model_len=max_model_len,
        quantization=quantization,
        kernel_backend=kernels,
        decode_graphs=graphed and not cuda_graphs and graphs_supported(device),
        cuda_graphs=cuda_graphs,
        tp_rank=tp_rank,
        # NOTE: beside a draft model, one table: the draft's cache holds a twin of each of the
        # target's blocks (a token's), which a block per group of layers would multiply.
        hybrid_kv=hybrid_kv and args.speculative_method != "draft",
    )


class Worker:
    """Builds what its WorkerConfig says: the model, its KV plan, and (``initialize``) the
    runner."""

    def __init__(self, config: WorkerConfig) -> None:
        # The process's resident memory before anything is loaded: the memory plan's runtime.
        self._runtime_bytes = resident_bytes()
        self.config = config
        self.args = args = config.args
        self.device = config.device
        self._cuda_graphs = config.cuda_graphs
        self._decode_graphs = config.decode_graphs
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        if self.device.type == "cpu":
            keep_freed_buffers()  # a long prefill's buffers, reused rather than re-faulted
        dtype_name = config.dtype_name
        self.dtype = _DTYPES[dtype_name]
        model_config, max_model_len = config.model_config, config.max_model_len
        quantization, tp_rank = config.quantization, config.tp_rank
        self.model = self._load(model_config, max_model_len, quantization)
        # Router statistics: each sparse layer counts its experts' tokens (before any decode
        # graph records the counters' address).
        self._expert_counts: dict[int, torch.Tensor] = {}
        if args.moe_router_stats:
            for layer, experts in self.model.expert_layers().items():
                experts.counts = torch.zeros(
                    experts.num_experts, dtype=torch.int64, device=self.device
                )
                self._expert_counts[layer] = experts.counts
        # A draft model proposes beside this one; each KV block the budget pays for has its twin
        # in the draft's cache.
        self.draft: Worker | None = None
        if args.speculative_method == "draft":
            self.draft = load_draft_worker(args, model_config, max_model_len)
        hybrid_kv = config.hybrid_kv
        self.kv_layout = plan_kv_layout(model_config.layer_windows, max_model_len, hybrid_kv)
        per_block = kv_bytes_per_block(
            model_config, args.block_size, self.dtype, args.kv_cache_dtype, self.kv_layout
        )
        if self.draft is not None:
            per_block += self.draft.info.kv_bytes_per_block
        self.memory_plan = self._plan_memory(per_block, max_model_len)
        fits = self.kv_layout.max_request_tokens(
            self.memory_plan.num_kv_blocks - 1, args.block_size, args.max_num_batched_tokens
        )
        if args.max_model_len is None and 0 < fits < max_model_len:
            # A default must not fail after the load: a context the KV cache holds, said once.
            # (A max_model_len asked for is the engine's error: engine_core.engine_config.)
            if tp_rank == 0:
                logger.warning(
                    "the KV cache holds %d tokens, fewer than the model's context (%d): "
                    "max_model_len lowered to %d (set max_model_len or kv_cache_memory to choose)",
                    fits,
                    max_model_len,
                    fits,
                )
            max_model_len = fits
            self.kv_layout = plan_kv_layout(model_config.layer_windows, max_model_len, hybrid_kv)
        if tp_rank == 0:
            logger.info("%s", self.memory_plan.describe())
        self.info = WorkerInfo(
            model_config=model_config,
            max_model_len=max_model_len,
            device=str(self.device),
            dtype=dtype_name,
            quantization=quantization,
            weight_nbytes=self.model.weight_nbytes(),
            num_parameters=self.model.num_parameters(),
            kv_bytes_per_block=per_block,
            num_kv_blocks=self.memory_plan.num_kv_blocks,
            kv_layout=self.kv_layout,
            async_scheduling=_async_scheduling(args, self.device),
        )
        self.runner: ModelRunner | None = None

    def initialize(self, cache: CacheConfig) -> None:
        """Allocate the KV cache of ``cache.num_blocks`` blocks and the runner that uses it."""
        self.runner = ModelRunner(
            self.model,
            cache,
            self.device,
            self.dtype,
            max_model_len=self.info.max_model_len,
            seed=self.args.seed,
            decode_graphs=self._decode_graphs,
            max_num_seqs=self.args.max_num_seqs,
            max_num_batched_tokens=self.args.max_num_batched_tokens,
            cuda_graphs=self._cuda_graphs,
            proposer=self._proposer(cache),
            speculative_max_batch=self.args.speculative_max_batch,
        )

    def _proposer(self, cache: CacheConfig) -> Proposer | None:
        args = self.args
        if args.speculative_method is None:
            return None
        if self.draft is not None:
            # Twin blocks, plus one a request for drafts that spill past its last block.
            num_blocks = cache.num_blocks + args.max_num_seqs
            draft_cache = dataclasses.replace(
                cache, num_blocks=num_blocks, kv_layout=self.draft.kv_layout
            )
            self.draft.initialize(draft_cache)
            assert self.draft.runner is not None
            return DraftModelProposer(
                self.draft.runner, args.num_speculative_tokens, num_blocks, self.info.max_model_len
            )
        return create_proposer(
            args.speculative_method,
            args.num_speculative_tokens,
            args.prompt_lookup_min,
            args.prompt_lookup_max,
        )

    def router_stats(self) -> dict[int, tuple[int, ...]] | None:
        """Mixtures of experts with EngineArgs.moe_router_stats: layer -> tokens each expert
        has run so far; None otherwise (the engine asks through ``collective_rpc``)."""
        if not self._expert_counts:
            return None
        return {layer: tuple(c.tolist()) for layer, c in self._expert_counts.items()}

    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        return self._runner.execute(sched_out)

    def launch(self, sched_out: SchedulerOutput) -> None:
        self._runner.launch(sched_out)

    def collect(self) -> RunnerOutput:
        return self._runner.collect()

    @property
    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("Worker.initialize must run before the first step")
        return self.runner

    def _load(self, config: ModelConfig, max_model_len: int, quantization: str | None) -> CausalLM:
        args = self.args
        if self.device.type == "cpu" and config.source is not None:
            _check_memory(config.source.path, quantization, self.dtype)
        quant_method = None
        if quantization:
            quant_method = create_quant_method(
                quantization,
                args.packed_activations,
                args.int4_group_size,
                stored_half_kind(config) or "bf16",
            )
        importance = None
        if args.int4_calibration:
            importance = input_importance(args, args.int4_calibration)
        return load_model(
            config,
            self.dtype,
            self.device,
            max_model_len,
            quant_method,
            importance,
            self.config.kernel_backend,
        )

    def _plan_memory(self, per_block: int, max_model_len: int) -> MemoryPlan:
        """How many KV blocks to allocate (worker/memory.py): from ``kv_cache_memory`` when it is
        set; otherwise a share of free memory on CPU, and on CUDA what gpu_memory_utilization
        leaves after the weights and a profiling step's activations."""
        args = self.args
        budget = parse_memory(args.kv_cache_memory)
        # The weights and the model's buffers (RoPE tables): what the model holds.
        weights = self.model.weight_nbytes() + sum(b.nbytes for b in self.model.buffers())
        # A hybrid model's recurrent state: a slot per request that may run (ModelRunner's).
        state = state_bytes_per_slot(self.model.config, self.dtype) * args.max_num_seqs
        if state and self.config.tp_rank == 0:
            logger.info("recurrent state of the linear-attention layers: %d slots (max_num_seqs) "
                        "take %s", args.max_num_seqs, human_bytes(state))  # fmt: skip
        weights += state
        if self.device.type != "cuda":
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            num_drafts = args.num_speculative_tokens if args.speculative_method else 0
            rows = max_logits_rows(args.max_num_seqs, num_drafts, args.max_num_batched_tokens)
            buffers = step_buffer_bytes(self.model.config.vocab_size, rows)
            return plan(
                per_block,
                weights,
                budget,
                free_bytes=free,
                runtime_bytes=self._runtime_bytes,
                buffer_bytes=buffers,
            )
        profile = None
        if budget is None:  # the profiling step, at the largest batch a step may run
            cache = CacheConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype)
            profile = functools.partial(
                dummy_prefill,
                self.model,
                cache,
                self.dtype,
                self.device,
                args.max_num_batched_tokens,
                max_model_len,
                args.max_num_seqs,
            )
        free, total, peak = measure_cuda(self.device, profile)
        return plan(
            per_block,
            weights,
            budget,
            free_bytes=free,
            total_bytes=total,
            utilization=args.gpu_memory_utilization,
            in_use_bytes=total - free,
            activation_peak_bytes=peak,
        )


def check_tensor_parallel_args(args: EngineArgs) -> None:
    """The checks of ``check_tensor_parallel`` from the model's config alone: the
    multiprocess executor runs them before it starts a rank process."""
    config = load_model_config(resolve_model(args.model))
    device = pick_device(args.device)
    check_tensor_parallel(args, config, pick_quantization(args.quantization, config, device))


def check_tensor_parallel(args: EngineArgs, config: ModelConfig, quantization: str | None) -> None:
    """ValueError unless the model and these arguments split into tensor-parallel ranks."""
    size = args.tensor_parallel_size
    config.check_tensor_parallel(size)
    # A GGUF's packed blocks split, and halves pack each rank's float shard; int8/int4 not yet.
    if quantization not in (None, "gguf", "half"):
        raise ValueError(
            f"tensor_parallel_size {size} with quantization {quantization!r}: quantized "
            "weights are not split across ranks yet; use float or GGUF weights"
        )
    if args.speculative_method == "draft":
        raise ValueError(
            f"tensor_parallel_size {size}: a draft model is not split across ranks yet; "
            "use speculative_method ngram or suffix"
        )


def check_recurrent(args: EngineArgs, config: ModelConfig) -> None:
    """ValueError for what a hybrid model's recurrent state does not allow yet: drafts that a
    verify step rejects would already be folded into the state, and the state is not split
    across tensor-parallel ranks."""
    if config.linear_attention is None:
        return
    if args.speculative_method is not None:
        raise ValueError(
            f"speculative_method {args.speculative_method!r}: {config.architecture} has "
            "linear-attention layers, whose state cannot take back rejected drafts; leave "
            "speculative decoding off for this model"
        )
    if args.tensor_parallel_size > 1:
        raise ValueError(
            f"tensor_parallel_size {args.tensor_parallel_size}: {config.architecture}'s "
            "linear-attention layers are not split across ranks yet; use tensor_parallel_size 1"
        )


def load_draft_worker(args: EngineArgs, target: ModelConfig, max_model_len: int) -> Worker:
    """The worker of the draft model (speculative_method "draft"), on the target's device and
    dtype, refused when its vocabulary is not the target's (its tokens would mean other text)."""
    draft_args = dataclasses.replace(
        args,
        model=args.draft_model or args.model,
        speculative_method=None,
        draft_model=None,
        draft_num_layers=None,
        max_model_len=max_model_len,
        max_num_seqs=args.speculative_max_batch,
        # A .gguf draft of an HF target (or the reverse) picks its own weight format.
        quantization=None if args.quantization == "gguf" else args.quantization,
        int4_calibration=None,
    )
    draft = Worker(resolve_worker_config(draft_args, args.draft_num_layers, hybrid_kv=False))
    check_same_vocabulary(target, draft.info.model_config)
    return draft


def check_same_vocabulary(target: ModelConfig, draft: ModelConfig) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the target's "
            f"({target.vocab_size}); pick a draft model with the target's tokenizer"
        )
    assert target.source is not None and draft.source is not None
    if target.source.path == draft.source.path:
        return
    target_vocab = load_tokenizer(target.source.path, target.architecture).backend.get_vocab()
    draft_vocab = load_tokenizer(draft.source.path, draft.architecture).backend.get_vocab()
    if target_vocab != draft_vocab:
        raise ValueError(
            "the draft model's tokenizer differs from the target's (same size, other tokens); "
            "pick a draft model with the target's tokenizer"
        )


# Resident bytes a weight takes, by EngineArgs.quantization of a float checkpoint (int8: a
# byte and a float32 scale per 32; int4: half a byte, a float32 scale and offset per 32), or of
# an fp8 one kept as stored (a byte; its scales are a row's or a block's).
_QUANTIZED_BYTES = {"int8": 1 + 4 / 32, "int4": 0.5 + 8 / 32, "fp8": 1.0}


def _check_memory(path: Path, quantization: str | None, dtype: torch.dtype) -> None:
    """ValueError, with the numbers, when the weights alone would not fit the memory the
    system has available (estimated from the file's headers: tokenmill/modelfile.py)."""
    free = available_memory()
    if free is None:
        return
    if path.is_dir():
        num_parameters, as_stored = summarize(path).num_parameters, None
    else:  # the tensor infos only: the metadata's 262k-token vocabulary is not read again
        tensors = read_gguf(path, prefixes=("general.",)).tensors
        num_parameters = sum(t.num_elements for t in tensors)
        as_stored = resident_weight_bytes(tensors)
    if quantization in _QUANTIZED_BYTES:
        need = num_parameters * _QUANTIZED_BYTES[quantization]
    elif quantization == "none" or as_stored is None:
        need = num_parameters * torch.finfo(dtype).bits // 8
    else:
        need = as_stored
    if need > free:
        raise ValueError(
            f"{path.name} needs about {human_bytes(need)} for its weights "
            f"({quantization or 'as stored'}), but this machine has {human_bytes(free)} of "
            "memory available: pick a smaller model or quantization (--quantization int4), "
            "or free memory"
        )


def _truncated(config: ModelConfig, num_layers: int | None) -> ModelConfig:
    if num_layers is None:
        return config
    if num_layers > config.num_hidden_layers:
        raise ValueError(
            f"draft_num_layers ({num_layers}) exceeds the draft model's "
            f"{config.num_hidden_layers} layers"
        )
    # Per-layer lists cut too: the KV cache counts the layers layer_types gives (kv_layers).
    return dataclasses.replace(
        config, num_hidden_layers=num_layers, layer_types=config.layer_types[:num_layers]
    )


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N]; got {name!r}")
    return torch.device(name)


def pick_dtype(requested: str, device: torch.device) -> str:
    """The model dtype's name: as asked, or for "auto" float32 on CPU and bfloat16 on CUDA."""
    if requested != "auto":
        return requested
    return "bfloat16" if device.type == "cuda" else "float32"


def pick_quantization(
    requested: str | None, config: ModelConfig, device: torch.device
) -> str | None:
    """The weight scheme to load with (None: float weights in the model dtype)."""
    assert config.source is not None
    source_format = config.source.format
    if requested is None:
        # Weights stay as stored on CPUs (the packed kernel is a CPU kernel): a GGUF's quantized
        # tensors packed, a bf16 / fp16 checkpoint's as its halves.
        requested = "none"
        if config.weight_format == "fp8":  # a byte a weight, on any device
            requested = "fp8"
        elif device.type == "cpu" and source_format == "gguf":
            requested = "gguf"
        elif device.type == "cpu" and stored_half_kind(config) is not None:
            requested = "half"
    if requested == "gguf" and source_format != "gguf":
        raise ValueError("quantization 'gguf' needs a .gguf model; use int8, int4 or none")
    if requested == "fp8" and config.weight_format != "fp8":
        raise ValueError("quantization 'fp8' keeps an fp8 checkpoint's weights; this model is "
                         "not one (use int8, int4 or none)")  # fmt: skip
    if requested == "half" and (source_format != "hf" or device.type != "cpu"):
        raise ValueError(
            "quantization 'half' keeps a float Hugging Face checkpoint's weights as 16-bit halves "
            "for the CPU kernels (a GGUF's F16 tensors stay halves unset; on CUDA weights are "
            "bfloat16 already); use none"
        )
    return None if requested == "none" else requested


def _max_model_len(args: EngineArgs, config: ModelConfig) -> int:
    max_model_len = args.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds the model's context length "
            f"({config.max_position_embeddings})"
        )
    return max_model_len


def _async_scheduling(args: EngineArgs, device: torch.device) -> bool:
    """EngineArgs.async_scheduling resolved (its checks refuse the combinations it cannot run
    with when it is set): unset, on with CUDA, without drafts."""
    if args.async_scheduling is not None:
        return args.async_scheduling
    return device.type == "cuda" and args.speculative_method is None
