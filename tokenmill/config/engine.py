"""What a user sets to start an engine (``EngineArgs``: one flat declaration, from which the
CLI makes its flags), and what the engine resolves from it with its worker (``EngineConfig``,
``SchedulerConfig``, ``WorkerInfo``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from tokenmill.config.cache import KV_CACHE_DTYPES, CacheConfig, parse_memory
from tokenmill.config.declare import check_declared, check_number_types, option
from tokenmill.config.model import ModelConfig
from tokenmill.embedded import DEFAULT_MODEL
from tokenmill.kv_layout import KVLayout
from tokenmill.pooling import TASKS
from tokenmill.reasoning import REASONING_PARSERS

# How weights sit in memory (see EngineArgs.quantization) and what packed matmuls do with x.
QUANTIZATION_METHODS = ("gguf", "half", "fp8", "none", "int8", "int4")
PACKED_ACTIVATIONS = ("int8", "float32")
# How draft tokens are proposed (spec/, worker/draft_proposer.py): "ngram" = prompt lookup in
# the request's own tokens, "suffix" = the most frequent continuation in its own tokens and in
# recent requests' outputs, "draft" = a smaller model (or the target's first layers).
SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
# How tensor-parallel ranks are placed: "mp" processes on this machine, "ray" Ray actors,
# "torchrun" processes torchrun started (tokenmill.worker.torchrun).
DISTRIBUTED_EXECUTORS = ("mp", "ray", "torchrun")
# The kernel backends (kernels/: torch, the C kernels, Triton); kernels/__init__.py maps each
# to its class.
KERNEL_BACKENDS = ("torch", "cpu", "triton")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker reports once its model is loaded; the engine sizes the scheduler from it.

    Plain values only: the engine reads them without importing torch.
    """

    model_config: ModelConfig
    max_model_len: int
    device: str
    dtype: str
    quantization: str | None
    weight_nbytes: int
    num_parameters: int  # weights' elements, packed ones counted as the floats they stand for
    kv_bytes_per_block: int  # the layers a block holds: K and V (and their scales)
    num_kv_blocks: int  # blocks that fit the kv_cache_memory budget, the null block included
    kv_layout: KVLayout  # which layers a block holds; each request's block tables
    # EngineArgs.async_scheduling resolved: the executor's launch / collect let the engine
    # schedule a step while the one before it runs.
    async_scheduling: bool = False


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    quantization: str | None = None


@dataclass(slots=True)
class EngineArgs:
    """Everything a user can set when starting an engine; CLI flags are made from these fields."""

    model: str = option(DEFAULT_MODEL, "alias, .gguf or HF dir")
    dtype: str = option(
        "auto",
        "weights and activations dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, "
        "bfloat16, float16",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = option("auto", "auto, cpu or cuda[:N]")
    max_model_len: int | None = option(
        None, "context length (prompt + output); default: the model's", low=1
    )
    block_size: int = option(16, "tokens per KV block", choices=(8, 16, 32, 64, 128))
    # The KV cache's budget, an explicit override: bytes ("2GiB", an int) or a fraction of the
    # memory free after loading. Unset: on CPU DEFAULT_KV_CACHE_FRACTION of free memory; on CUDA
    # what gpu_memory_utilization of the device leaves after the weights and the activations'
    # peak in a profiling step (worker/memory.py).
    kv_cache_memory: str | int | float | None = option(
        None,
        "KV cache budget: bytes ('2GiB', '512MB') or a fraction of the memory free after loading;"
        " unset: 0.15 of free memory on CPU, on CUDA what --gpu-memory-utilization leaves after "
        "the weights and a profiled step's activations",
    )
    gpu_memory_utilization: float = option(
        0.9,
        "CUDA: the share of the device's memory the engine may use (weights, activations and KV "
        "cache; in (0, 1])",
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage: auto (the model dtype), float16, int8 or fp8 (e4m3); the last two with"
        " a float32 scale per token and KV head (about 2x the tokens of bfloat16)",
        choices=KV_CACHE_DTYPES,
    )
    max_num_seqs: int = option(128, "most requests in one step", low=1)
    max_num_batched_tokens: int = option(
        2048, "token budget of one step (decodes + prefill chunks)", low=1
    )
    enable_prefix_caching: bool = option(True, "reuse KV blocks of shared prompt prefixes")
    seed: int = option(0, "seed of the sampler for requests without their own seed")
    num_threads: int | None = option(None, "torch intra-op threads (default: torch's choice)")
    # Weights in memory: None = as stored (a GGUF's quantized tensors stay packed, float
    # checkpoints stay float, a bf16 / fp16 one on a CPU as its halves: "half"); "gguf" says so
    # explicitly; "none" dequantizes everything to dtype;
    # "int8" (per-channel) / "int4" (group-wise) quantize float weights at load.
    quantization: str | None = option(
        None,
        "weights in memory: gguf (a GGUF's quantized tensors stay packed; the default for .gguf),"
        " fp8 (an fp8 checkpoint's e4m3 weights as stored; its default), none (dequantize to "
        "dtype), int8 (per-channel) or int4 (group-wise) quantized at load",
        choices=QUANTIZATION_METHODS,
    )
    packed_activations: str = option(
        "int8",
        "activations of packed-weight matmuls at small batch: int8 per 32 elements (fast, as "
        "llama.cpp) or float32 (exact)",
        choices=PACKED_ACTIVATIONS,
    )
    int4_group_size: int = option(32, "input elements per int4 scale: 32 or 128", choices=(32, 128))
    # A text file whose activations weight int4's rounding (llama.cpp's importance matrix).
    int4_calibration: str | None = option(
        None,
        "a UTF-8 text file: int4 weights each layer's rounding error by its inputs' mean squares "
        "over this text, run through the float model at load (llama.cpp's imatrix; a few thousand"
        " tokens of text like the expected prompts, not the text you score)",
        metavar="FILE",
    )
    enforce_eager: bool = option(
        False, "run every step op by op (no replayed decode-step graphs on CPU)"
    )
    kernel_backend: str = option(
        "auto",
        "which kernels compute: auto (the C kernels on a CPU that runs them, triton on CUDA, else"
        " torch), torch (the pure-torch reference), cpu or triton",
        choices=("auto", *KERNEL_BACKENDS),
        choices_text="auto or one of " + ", ".join(KERNEL_BACKENDS),
    )
    # Speculative decoding: propose up to num_speculative_tokens draft tokens a step and verify
    # them in the next decode step (lossless). "ngram": the tokens that followed the latest
    # earlier occurrence of the request's last n tokens, n from prompt_lookup_max down to min.
    speculative_method: str | None = option(
        None,
        "propose draft tokens and verify them losslessly: ngram (prompt lookup), suffix (frequent"
        " continuations in the request and in recent outputs) or draft (a draft model)",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = option(3, "draft tokens proposed per step (1-16)", low=1, high=16)
    prompt_lookup_min: int = option(2, "ngram: shortest suffix of the request's tokens to look up")
    prompt_lookup_max: int = option(4, "ngram: longest suffix of the request's tokens to look up")
    # Speculate only in steps that sampled at most this many requests: verification rows cost
    # a batched step what they save a lone one. Measured on gemma-3-270m (AMD EPYC Zen 4, 2
    # threads, ngram, K = 3, 96 greedy tokens a request), decode tok/s with / without drafts:
    # repeating a given file 1.93x at 1 request, 1.03x at 2, 0.89x at 4, 0.74x at 16;
    # continuing random prompts 1.71x, 1.26x, 1.05x at 4, 0.93x at 8; 32 requests of 128/128
    # random tokens 0.62x with no limit.
    speculative_max_batch: int = option(
        2, "speculate only in steps of at most this many requests", low=1
    )
    # speculative_method "draft": the model that proposes (alias, .gguf or HF directory; same
    # vocabulary as the target) and, optionally, only its first draft_num_layers layers with
    # its final norm and head (early exit). draft_num_layers without draft_model drafts with
    # the target's own first layers (a self-draft).
    draft_model: str | None = option(
        None,
        "draft: the proposing model (alias, .gguf or HF dir; the target's vocabulary)",
        metavar="MODEL",
    )
    draft_num_layers: int | None = option(
        None,
        "draft: keep only the draft model's first N layers (early exit); without --draft-model, "
        "the target's own first N layers",
        low=1,
    )
    # Mixtures of experts: count the tokens each expert of each layer runs, for /metrics
    # (tokenmill:moe_expert_tokens) and EngineStats.expert_tokens. Off by default: debugging.
    moe_router_stats: bool = option(
        False,
        "mixtures of experts: count the tokens each expert runs, per layer, in /metrics "
        "(tokenmill:moe_expert_tokens)",
    )
    # Tensor parallelism (issue 25): the model split over this many worker processes on this
    # machine (torch.distributed: gloo on CPU, NCCL on CUDA); 1 runs in the engine's process.
    tensor_parallel_size: int = option(
        1,
        "split the model over N processes on this machine (tensor parallelism over "
        "torch.distributed: gloo on CPU, NCCL on CUDA); float or GGUF weights, run eagerly",
    )
    # Where the ranks run: "mp" (a process per rank on this machine; tensor_parallel_size 1
    # stays in the engine's process) or "ray" (a Ray actor per rank, placed by a placement
    # group: one node or several; tokenmill[ray]; executor/ray_executor.py) or "torchrun" (set
    # by `torchrun -m tokenmill.worker.torchrun`: the ranks are torchrun's processes).
    distributed_executor: str = option(
        "mp",
        "where tensor-parallel ranks run: mp (processes on this machine), ray (Ray actors, one "
        "node or several) or torchrun (set by tokenmill.worker.torchrun)",
        choices=DISTRIBUTED_EXECUTORS,
    )
    # Schedule step N+1 while the device runs step N (vLLM's flag): the host's work per step
    # (scheduling, inputs, outputs) overlaps the device's instead of adding to it. None: on
    # with CUDA, where the device runs on its own; a CPU computes in the engine's own threads,
    # so it gains nothing there. Not with speculative decoding (the proposer reads each step's
    # tokens on the host) nor tensor parallelism. Steps whose requests need their tokens on the
    # host to sample the next (penalties, log-probs, structured output) run one at a time.
    # A JSON format's numbers end (structured/json_numbers.py): at most this many significant
    # digits, and an exponent of at most 3; 0 leaves them unbounded.
    json_number_digits: int = option(
        17,
        "structured JSON outputs: a number's most significant digits (17: what a double "
        "carries; its exponent at most 3 digits), so no model writes digits to max_tokens; 0: "
        "unbounded",
        low=0,
    )
    # Reasoning models (reasoning.py): "auto" finds the <think> format in the chat template;
    # a family's name says so for a template that does not show it; "none" leaves the
    # thinking in the content.
    reasoning_parser: str = option(
        "auto",
        "how the server splits a reasoning model's thinking from its answer (reasoning_content):"
        " auto (from the chat template), none, or the <think> format by a family's name: "
        + ", ".join(REASONING_PARSERS),
        choices=("auto", "none", *REASONING_PARSERS),
    )
    # A chat template that replaces the model's: its text or a file holding it (vLLM's
    # --chat-template); a model made from a Modelfile brings its TEMPLATE here (recipes.py).
    chat_template: str | None = option(
        None,
        "a Jinja chat template (a file, or its text) that replaces the model's; rendered in the "
        "same sandbox",
        metavar="TEMPLATE",
    )
    # Embeddings (pooling.py): "auto" serves them when the checkpoint is an embedding model
    # (sentence-transformers files, a GGUF's pooling_type), "embed" always, "generate" never.
    task: str = option(
        "auto",
        "what the model serves: auto (embeddings for an embedding checkpoint, else text), "
        "generate, or embed (/v1/embeddings by the checkpoint's pooling, else last-token)",
        choices=TASKS,
    )
    async_scheduling: bool | None = option(
        None,
        "schedule each step while the device runs the one before it (default: on with CUDA); "
        "--no-async-scheduling runs steps one at a time",
    )
    core_process: bool = option(
        False,
        "run the engine core (scheduler, model) in a process of its own, so that turning "
        "tokens into text and streams never holds up its steps",
    )

    def __post_init__(self) -> None:
        check_number_types(self)
        check_declared(self)
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)  # a bad value fails here, naming the field
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}"
            )
        if self.int4_calibration is not None:
            if self.quantization != "int4":
                raise ValueError(
                    "int4_calibration needs quantization='int4'; "
                    f"got quantization={self.quantization!r}"
                )
            if not Path(self.int4_calibration).is_file():
                raise ValueError(
                    f"int4_calibration must be a text file; {self.int4_calibration!r} is not one"
                )
        if self.speculative_method == "draft" and not (self.draft_model or self.draft_num_layers):
            raise ValueError(
                "speculative_method 'draft' needs draft_model (a smaller model with the same "
                "vocabulary) or draft_num_layers (the target's first layers as the draft)"
            )
        if self.speculative_method != "draft" and (self.draft_model or self.draft_num_layers):
            raise ValueError(
                "draft_model and draft_num_layers are for speculative_method='draft'; got "
                f"speculative_method={self.speculative_method!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max; got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1; got {self.tensor_parallel_size!r}"
            )
        if self.task == "embed" and self.speculative_method is not None:
            raise ValueError(
                "task 'embed' runs prompts only: speculative decoding has nothing to propose; "
                "drop speculative_method"
            )
        if self.async_scheduling and self.speculative_method is not None:
            raise ValueError(
                "async_scheduling does not combine with speculative decoding (the proposer "
                "reads each step's tokens on the host); drop one of them"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
