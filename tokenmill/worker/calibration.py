"""Calibration for int4: the mean square of each linear layer's inputs over a text.

This is llama.cpp's importance matrix (imatrix) kept to its diagonal. An error e_j in weight
w_j reaches the layer's output as e_j · x_j, so a layer's expected output error is
Σ_j E[x_j²] e_j², and int4's rounding weights each input's squared error by E[x_j²]
(quant/packed.py: quantize_int4).

The text runs once through the float model, before the quantized model loads: a throwaway
worker (``quantization="none"``) prefills it in windows, one request a step, and forward
pre-hooks on its Linear layers add up the squares of their inputs. Layers are named as in the
checkpoint (``CausalLM.checkpoint_layers``: q_proj, k_proj, v_proj rather than their fused
qkv_proj), the names by which the model loaded next is quantized.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenmill.config import CacheConfig
from tokenmill.core.sched_output import NewRequestData, SchedulerOutput
from tokenmill.layers.linear import Linear
from tokenmill.resolve import resolve_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs
    from tokenmill.worker.worker import Worker

logger = logging.getLogger(__name__)

# Tokens per calibration request (BOS included) and in all: llama.cpp's imatrix runs chunks of
# 512 tokens; a few thousand tokens already settle the means (4,096 measured on gemma-3-270m).
CALIBRATION_WINDOW = 1024
CALIBRATION_MAX_TOKENS = 4096


def input_importance(args: EngineArgs, path: str) -> dict[str, torch.Tensor]:
    """Layer name -> mean square of each of its inputs [in_features] over the text at ``path``,
    computed by the float model that ``args`` describe."""
    from tokenmill.worker.worker import (  # which imports this module
        Worker,
        resolve_worker_config,
    )

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"int4_calibration: cannot read {path} as UTF-8 text ({e})") from e
    started = time.monotonic()
    float_args = dataclasses.replace(
        args, quantization="none", int4_calibration=None, enforce_eager=True
    )
    worker = Worker(resolve_worker_config(float_args))
    config = worker.info.model_config
    tokenizer = load_tokenizer(resolve_model(args.model).path, config.architecture)
    prompts = _windows(tokenizer, text, worker.info.max_model_len)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        sums[name] = x.square().sum(0) + sums.get(name, 0.0)
        counts[name] = counts.get(name, 0) + x.shape[0]

    # By checkpoint names, a fused layer's parts each on its own: the names the quantizer looks
    # up. NOTE: the float model computes every part by its own Linear (only packed parts share
    # a matmul, layers/linear.py), so each part's hook sees its input.
    hooks = [
        module.register_forward_pre_hook(lambda _m, inputs, name=name: add(name, inputs[0]))
        for name, module in worker.model.checkpoint_layers()
        if isinstance(module, Linear)
    ]
    try:
        _prefill(worker, prompts, args)
    finally:
        for hook in hooks:
            hook.remove()
    del worker
    gc.collect()
    logger.info(
        "int4 calibration: %d tokens of %s through the float model in %.1fs",
        sum(len(p) for p in prompts),
        path,
        time.monotonic() - started,
    )
    return {name: (s / counts[name]).cpu() for name, s in sums.items()}


def _prefill(worker: Worker, prompts: list[list[int]], args: EngineArgs) -> None:
    """Run each prompt through the worker's model, one request a step, on a KV cache just
    large enough for the longest."""
    num_blocks = -(-max(len(p) for p in prompts) // args.block_size)
    worker.initialize(
        CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=False,
            num_blocks=num_blocks + 1,  # block 0 is the null block
            kv_cache_dtype=args.kv_cache_dtype,
        )
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i, prompt in enumerate(prompts):
        blocks = [list(range(1, num_blocks + 1))]  # one block table: the default layout
        req = NewRequestData(str(i), prompt, len(prompt), params, blocks, 0)
        worker.execute(
            SchedulerOutput(
                new_reqs=[req],
                cached_reqs=[],
                num_scheduled_tokens={req.req_id: len(prompt)},
                finished_req_ids={str(i - 1)} if i else set(),
            )
        )


def _windows(tokenizer: Tokenizer, text: str, max_model_len: int) -> list[list[int]]:
    """The text's first CALIBRATION_MAX_TOKENS tokens in requests of CALIBRATION_WINDOW (each
    starting with BOS where the model has one)."""
    token_ids = tokenizer.encode(text, add_special_tokens=False)[:CALIBRATION_MAX_TOKENS]
    if not token_ids:
        raise ValueError("int4_calibration: the text holds no tokens; give a few thousand words")
    prefix = [tokenizer.bos_token_id] if tokenizer.add_bos else []
    # One position stays free: a request must have room for the token it is asked for.
    span = min(CALIBRATION_WINDOW, max_model_len - 1) - len(prefix)
    return [prefix + token_ids[i : i + span] for i in range(0, len(token_ids), span)]
