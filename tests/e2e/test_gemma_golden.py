"""Golden test on the embedded gemma-3-270m: tokenmill's greedy tokens equal transformers'.

Both read the same GGUF; transformers dequantizes it to float32. tokenmill runs it packed (float32
activations) and dequantized. (Its tokenizer against transformers' on this file:
tests/tokenizer/test_tokenizer_gguf.py::test_gemma_matches_transformers.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_all_blocks_free

from tokenmill import LLM, SamplingParams
from tokenmill.resolve import resolve_model

pytestmark = pytest.mark.slow

PLAIN = ["The capital of France is", "def fibonacci(n):\n    "]
CHAT = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]
NUM_TOKENS = 32


# The default keeps the GGUF packed; with float32 activations it computes the same weights as
# the dequantized model, so both must match transformers token for token.
MODES = {
    "packed": {"packed_activations": "float32"},
    "dequantized": {"quantization": "none"},
}


@pytest.fixture(scope="module", params=list(MODES))
def llm(request) -> LLM:
    return LLM(
        "gemma-3-270m",
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory="512MiB",
        **MODES[request.param],
    )


@pytest.fixture(scope="module")
def hf_greedy() -> Callable[[list[int], list[int]], list[int]]:
    """transformers' greedy tokens of a prompt, given its stop ids: the model loaded (~45 s:
    its GGUF dequantized in Python) and each prompt run once for both modes."""
    from transformers import AutoModelForCausalLM

    path = resolve_model("gemma-3-270m").path
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    done: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}

    def greedy(prompt_ids: list[int], stop_ids: list[int]) -> list[int]:
        key = (tuple(prompt_ids), tuple(stop_ids))
        if key not in done:
            done[key] = _hf_greedy(hf, prompt_ids, stop_ids)
        return done[key]

    return greedy


def _hf_greedy(hf: Any, prompt_ids: list[int], stop_ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=NUM_TOKENS,
            do_sample=False,
            eos_token_id=stop_ids,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_matches_transformers(llm: LLM, hf_greedy) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
    prompts = [llm.tokenizer.encode(p) for p in PLAIN]
    prompts += [llm.tokenizer.encode_chat(m) for m in CHAT]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stop_ids = list(llm.engine.eos_token_ids)
    for prompt_ids, out in zip(prompts, outs):
        ours = out.outputs[0].token_ids
        theirs = hf_greedy(prompt_ids, stop_ids)
        # transformers keeps the stop token in its output; so does tokenmill's token_ids.
        assert ours == theirs, f"prompt {llm.tokenizer.decode(prompt_ids)!r}"
        assert len(ours) == NUM_TOKENS or ours[-1] in stop_ids
    assert_all_blocks_free(llm.engine)


def test_greedy_alone_equals_greedy_in_batch_of_16(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    others = [f"Item {i}: the quick brown fox number {i} jumps over" for i in range(15)]
    alone = llm.generate(PLAIN[0], params, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(others[:7] + [PLAIN[0]] + others[7:], params, use_tqdm=False)
    assert batch[7].outputs[0].token_ids == alone
    assert_all_blocks_free(llm.engine)


def test_packed_weights_stay_near_the_file_size(llm: LLM) -> None:
    """The quantization issue's bound: packed weights at most 1.5x the GGUF file."""
    file_bytes = llm.engine.config.model_config.source.path.stat().st_size
    weight_bytes = llm.engine.info.weight_nbytes
    if llm.engine.config.quantization == "gguf":
        assert weight_bytes <= 1.5 * file_bytes
    else:  # dequantized to float32: about 4x the Q4_K_M file
        assert weight_bytes > 3 * file_bytes
