"""LLM (offline API) on the tiny random Llama: order, params broadcasting, validation before
anything is queued, metrics, chat with the family's default template."""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free

from tokenmill import LLM, SamplingParams
from tokenmill.tokenizer.chat import LLAMA2_TEMPLATE

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    # One thread: see the note in tests/engine/test_llm_engine.py.
    return LLM(
        model=str(tiny_model_dir("llama")),
        max_model_len=128,
        kv_cache_memory="8MiB",
        num_threads=1,
    )


def assert_untouched(llm: LLM) -> None:
    assert llm.engine.output_processor.states == {}
    assert_all_blocks_free(llm.engine)


def test_outputs_keep_input_order(llm):
    prompts = ["a long one", [1, 70, 71, 72], "mid", "x"]
    max_tokens = [9, 1, 5, 3]  # the first prompt finishes last
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
    assert outs[0].prompt == "a long one"
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("a long one")
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [1, 70, 71, 72]
    assert all(o.finished for o in outs)
    # Each output is the one its prompt gets alone.
    for prompt, p, out in zip(prompts, params, outs):
        (alone,) = llm.generate(prompt, p, use_tqdm=False)
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    assert_untouched(llm)


def test_one_params_for_all_or_one_per_prompt(llm):
    prompts = ["ab", "cd", "ef"]
    shared = llm.generate(prompts, GREEDY, use_tqdm=False)
    listed = llm.generate(prompts, [GREEDY] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in shared] == [o.outputs[0].token_ids for o in listed]
    assert all(len(o.outputs[0].token_ids) == 6 for o in shared)
    with pytest.raises(ValueError, match="got 2 sampling_params for 3 prompts"):
        llm.generate(prompts, [GREEDY] * 2, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams; got dict"):
        llm.generate(prompts, [GREEDY, {"max_tokens": 4}, GREEDY], use_tqdm=False)
    assert_untouched(llm)


def test_generate_keeps_the_callers_params_and_returns_whole_outputs(llm):
    """generate asks the engine for final outputs only, on copies of the caller's params."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    (out,) = llm.generate("whole", params, use_tqdm=False)
    assert params.output_kind == "cumulative"
    completion = out.outputs[0]
    assert out.finished and len(completion.token_ids) == len(completion.logprobs) == 6
    assert completion.text == llm.tokenizer.decode(completion.token_ids)
    assert_untouched(llm)


def test_single_prompt_forms(llm):
    (by_text,) = llm.generate("hello", GREEDY, use_tqdm=False)
    (by_ids,) = llm.generate(llm.tokenizer.encode("hello"), GREEDY, use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    outs = llm.generate([[1, 70], [1, 71]], GREEDY, use_tqdm=False)  # a list of token-id prompts
    assert [o.prompt_token_ids for o in outs] == [[1, 70], [1, 71]]
    assert_untouched(llm)


def test_default_params(llm):
    (out,) = llm.generate("hello", use_tqdm=False)
    assert 1 <= len(out.outputs[0].token_ids) <= 16  # SamplingParams() default max_tokens
    assert_untouched(llm)


@pytest.mark.parametrize(
    "prompts, params, match",
    [
        ([], None, "prompts must not be empty"),
        (["fine", ""], None, "prompt must not be empty"),
        (["fine", []], None, "prompt must not be empty"),
        (["fine", [1, 999]], None, "prompt token ids"),
        (["fine", [1] * 120], SamplingParams(max_tokens=10), r"max_tokens \(10\)"),
    ],
)
def test_a_bad_prompt_queues_nothing(llm, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert_untouched(llm)
    (out,) = llm.generate("still works", GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6


def test_metrics(llm):
    outs = llm.generate(["metrics", "more metrics"], GREEDY, use_tqdm=False)
    for out in outs:
        m = out.metrics
        assert m.ttft is not None and m.ttft > 0
        assert m.queue_time is not None and 0 <= m.queue_time <= m.ttft
        assert m.e2e_latency is not None and m.e2e_latency >= m.ttft
        assert m.num_prompt_tokens == len(out.prompt_token_ids)
        assert m.num_generation_tokens == 6
        expected_tpot = (m.finished_time - m.first_token_time) / 5
        assert m.time_per_output_token == pytest.approx(expected_tpot)
        assert m.time_per_output_token >= 0
    assert_untouched(llm)


def test_progress_bar(llm, capsys):
    outs = llm.generate(["one", "two"], GREEDY, use_tqdm=True)
    assert len(outs) == 2
    assert "Generating" in capsys.readouterr().err
    llm.generate(["one", "two"], GREEDY, use_tqdm=False)
    assert "Generating" not in capsys.readouterr().err


def test_n2(llm):
    (out,) = llm.generate("two ways", SamplingParams(n=2, seed=1, max_tokens=5), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) >= 1 for c in out.outputs)
    assert_untouched(llm)


def test_failure_mid_run_aborts_every_request(llm, monkeypatch):
    engine = llm.engine
    real_step = engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b", "c"], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    engine.step()  # the worker forgets the aborted requests
    assert engine.executor.worker.runner.requests == {}
    assert_untouched(llm)


def test_chat_uses_the_llama2_default_template(llm):
    assert llm.tokenizer.chat_template == LLAMA2_TEMPLATE  # the tiny vocabulary has no Llama 3 ids
    messages = [{"role": "user", "content": "hi"}]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
    expected_ids = [1] + llm.tokenizer.encode("[INST] hi [/INST]", add_special_tokens=False)
    assert out.prompt_token_ids == expected_ids  # exactly one BOS
    (plain,) = llm.generate(expected_ids, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    # A system prompt and a list of conversations.
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    outs = llm.chat([messages, system], GREEDY, use_tqdm=False)
    assert outs[0].prompt_token_ids == expected_ids
    text = llm.tokenizer.decode(outs[1].prompt_token_ids, skip_special_tokens=False)
    assert text == "<s>[INST] <<SYS>>\nbe brief\n<</SYS>>\n\nhi [/INST]"
    assert_untouched(llm)


def test_chat_rejects_bad_messages(llm):
    with pytest.raises(ValueError, match="role 'robot'"):
        llm.chat([{"role": "robot", "content": "x"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="alternate"):
        llm.chat([{"role": "assistant", "content": "x"}], GREEDY, use_tqdm=False)
    assert_untouched(llm)
