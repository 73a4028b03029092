"""Perplexity through the engine (tokenmill.bench.perplexity): the windows, the number against
transformers on a tiny random model (1e-4 relative, fp32), and the shipped text's size."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tokenmill import LLM
from tokenmill.bench.perplexity import Window, make_windows, measure_perplexity

TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "hamlet.txt"


@pytest.mark.parametrize(
    "args, expected",
    [
        ((10, 4), [Window(0, 4, 0), Window(4, 8, 4), Window(8, 10, 8)]),
        ((10, 4, 2), [Window(0, 4, 0), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]),
        ((10, 4, None, 6), [Window(0, 4, 0), Window(4, 6, 4)]),
        ((10, 4, 3, 5), [Window(0, 4, 0), Window(3, 5, 4)]),
        # No BOS: a window's first token is context only.
        ((10, 4, None, None, 1), [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]),
        (
            (10, 4, 2, None, 1),
            [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)],
        ),
        ((3, 8), [Window(0, 3, 0)]),
    ],
)
def test_windows(args, expected):
    assert make_windows(*args) == expected


@pytest.mark.parametrize("args", [(10, 4, 5), (10, 4, 0), (10, 1, None, None, 1), (10, 4, None, 0)])
def test_bad_windows_raise(args):
    with pytest.raises(ValueError):
        make_windows(*args)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir) -> LLM:
    path = tiny_model_dir("llama")
    return LLM(str(path), max_model_len=256, kv_cache_memory="8MiB", num_threads=1)


def hf_perplexity(path, token_ids: list[int], bos: int, window: int, stride: int) -> float:
    """The usual sliding-window recipe, straight on transformers: each window (BOS + text) is
    scored on the tokens that no earlier window scored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    total_nll, num_scored, prev_end = 0.0, 0, 0
    for begin in range(0, len(token_ids), stride - 1):
        end = min(begin + window - 1, len(token_ids))
        ids = torch.tensor([[bos] + token_ids[begin:end]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        for pos in range(prev_end, end):
            row = pos - begin  # position pos - begin + 1 in ids, predicted by the row before it
            total_nll -= logprobs[row, token_ids[pos]].item()
            num_scored += 1
        prev_end = end
        if end == len(token_ids):
            break
    return math.exp(total_nll / num_scored)


@pytest.mark.parametrize("window, stride", [(128, None), (128, 64)])
def test_perplexity_matches_transformers(tiny_llm, tiny_model_dir, window, stride):
    text = TEXT.read_text()
    result = measure_perplexity(tiny_llm, text, window, stride, max_tokens_total=300)
    assert result.num_tokens == 300
    assert result.num_windows == (3 if stride is None else 4)  # 127 + 63 + 63 + 47
    tokenizer = tiny_llm.tokenizer
    token_ids = tokenizer.encode(text, add_special_tokens=False)[:300]
    expected = hf_perplexity(
        tiny_model_dir("llama"), token_ids, tokenizer.bos_token_id, window, stride or window
    )
    assert result.perplexity == pytest.approx(expected, rel=1e-4)
    assert result.mean_nll == pytest.approx(math.log(expected), rel=1e-4)


def test_bad_stride_raises(tiny_llm):
    with pytest.raises(ValueError, match="stride"):
        measure_perplexity(tiny_llm, "some text", window=16, stride=17)


@pytest.mark.slow  # ~6 s: the gemma tokenizer's 262k-entry vocabulary is read from the GGUF
def test_shipped_text_holds_enough_gemma_tokens():
    from tokenmill.resolve import resolve_model
    from tokenmill.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("gemma-3-270m").path, "gemma3")
    num_tokens = len(tokenizer.encode(TEXT.read_text()))
    assert 20_000 <= num_tokens <= 30_000
    assert TEXT.stat().st_size < 200_000
