"""max_thinking_tokens through the engine: a reasoning model's thinking ends at the budget,
the model's end-of-thinking tag forced there, then it answers; in a batch with speculative
drafts too. The tiny random Qwen3s never close their thinking on their own, so where
the tag appears is the budget's doing."""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.reasoning import THINK_END, THINK_START, split_reasoning
from tokenmill.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


def _engine(path, **kwargs) -> LLMEngine:
    return LLMEngine(
        EngineArgs(model=str(path), max_model_len=256, kv_cache_memory="8MiB", **kwargs)
    )


def _run(engine: LLMEngine, params: SamplingParams, template_kwargs=None) -> tuple[list[int], str]:
    ids = engine.tokenizer.encode_chat(MESSAGES, True, **(template_kwargs or {}))
    engine.add_request(ids, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert_all_blocks_free(engine)
    assert final is not None
    return final.outputs[0].token_ids, final.outputs[0].text


def _ids(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("budget", [0, 1, 7, 20])
def test_an_opened_block_ends_exactly_at_the_budget(reasoning_model_dir, budget) -> None:
    """DeepSeek-R1's template opens <think>: the first ``budget`` tokens think, then </think>."""
    engine = _engine(reasoning_model_dir("deepseek_r1"))
    assert engine.reasoning == "think"
    params = SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, max_thinking_tokens=budget
    )
    tokens, text = _run(engine, params)
    (end,) = _ids(engine, THINK_END)
    assert tokens[budget] == end and end not in tokens[:budget]
    reasoning, content = split_reasoning(text, opened=True)
    assert reasoning == engine.tokenizer.decode(tokens[:budget])
    assert content == engine.tokenizer.decode(tokens[budget + 1 :]).lstrip("\n")


def test_a_block_the_model_opens_is_budgeted_from_its_tag(reasoning_model_dir) -> None:
    """Qwen3's template leaves <think> to the model: the budget counts from the tag on. The
    random model does not write it; the structured-output-free way to make it is max_tokens
    of a prompt that ends in it, so here the prompt carries it as its last token."""
    engine = _engine(reasoning_model_dir("qwen3"))
    (start,) = _ids(engine, THINK_START)
    (end,) = _ids(engine, THINK_END)
    ids = engine.tokenizer.encode_chat(MESSAGES, True) + [start]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, max_thinking_tokens=5)
    engine.add_request(ids, params)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    assert out is not None
    tokens = out.outputs[0].token_ids
    assert tokens[5] == end and end not in tokens[:5]
    assert_all_blocks_free(engine)


def test_thinking_off_needs_no_budget(reasoning_model_dir) -> None:
    """enable_thinking: false closes the block in the prompt: nothing is forced."""
    engine = _engine(reasoning_model_dir("qwen3"))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, max_thinking_tokens=0)
    tokens, _ = _run(engine, params, {"enable_thinking": False})
    plain, _ = _run(engine, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                    {"enable_thinking": False})  # fmt: skip
    assert tokens == plain  # (a random model may write the tag itself; nothing was forced)


def test_the_budget_holds_with_drafts_and_in_a_batch(reasoning_model_dir) -> None:
    path = reasoning_model_dir("deepseek_r1")
    engine = _engine(path, speculative_method="ngram", speculative_max_batch=8)
    (end,) = _ids(engine, THINK_END)
    ids = engine.tokenizer.encode_chat(MESSAGES, True)
    budgets = [3, 9, 16]
    for budget in budgets:
        engine.add_request(
            ids,
            SamplingParams(
                max_tokens=32, temperature=0, ignore_eos=True, max_thinking_tokens=budget
            ),
        )
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    assert_all_blocks_free(engine)
    for budget, tokens in zip(budgets, [finals[k] for k in sorted(finals, key=int)], strict=True):
        assert tokens[budget] == end and end not in tokens[:budget]


def test_a_budget_needs_a_reasoning_model(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="max_thinking_tokens needs a reasoning model"):
        engine.add_request([1, 40, 41], SamplingParams(max_thinking_tokens=4))
    with pytest.raises(ValueError, match="max_thinking_tokens must be an integer >= 0"):
        SamplingParams(max_thinking_tokens=-1)


def test_the_cli_takes_a_budget(reasoning_model_dir, tiny_model_dir, capsys) -> None:
    from tokenmill.cli import main

    path = str(reasoning_model_dir("deepseek_r1"))
    flags = ["--max-model-len", "256", "--kv-cache-memory", "8MiB", "--max-tokens", "12"]
    code = main(["generate", path, "--chat", "--prompt", "hi", "--ignore-eos",
                 "--max-thinking-tokens", "4", *flags])  # fmt: skip
    assert code == 0
    assert THINK_END in capsys.readouterr().out
    code = main(["chat", str(tiny_model_dir("llama")), "--max-thinking-tokens", "4", *flags])
    assert code != 0
    assert "needs a reasoning model" in capsys.readouterr().err
