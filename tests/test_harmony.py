"""OpenAI's harmony format (tokenmill/harmony.py): an output's messages split into thinking
(the analysis channel), answer (final, commentary preambles) and tool calls (commentary to
functions.NAME), whole and delta by delta; the format found from a chat template; and the
conversation as gpt-oss's template reads it (thinking, arguments as objects)."""

from __future__ import annotations

import json

import pytest

from tokenmill.harmony import HarmonyStream
from tokenmill.reasoning import reasoning_format, split_reasoning
from tokenmill.server.tools import harmony_history, parse_tool_calls, pick_parser

ANSWER = (
    "<|channel|>analysis<|message|>The user asks for a capital. Paris.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The capital of France is Paris.<|return|>"
)
# The model's own way to address a call, and the way gpt-oss's template writes earlier ones.
CALLS = {
    "model": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>',
    "template": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant "
    'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
}


def _streamed(text: str, size: int) -> tuple[str, str]:
    stream, thinking, answer = HarmonyStream(), "", ""
    for at in range(0, len(text), size):
        t, a = stream.feed(text[at : at + size])
        thinking, answer = thinking + t, answer + a
    t, a = stream.finish()
    return thinking + t, answer + a


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_thinking_and_answer_apart_whole_and_streamed(size: int) -> None:
    assert split_reasoning(ANSWER, False, "harmony") == (
        "The user asks for a capital. Paris.",
        "The capital of France is Paris.",
    )
    assert _streamed(ANSWER, size) == (
        "The user asks for a capital. Paris.",
        "The capital of France is Paris.",
    )


@pytest.mark.parametrize("form", sorted(CALLS))
@pytest.mark.parametrize("stop_token_in_text", [True, False])
def test_a_call_becomes_a_tool_call(form: str, stop_token_in_text: bool) -> None:
    text = CALLS[form] if stop_token_in_text else CALLS[form].removesuffix("<|call|>")
    for size in (1, 5, 1000):
        thinking, answer = _streamed(text, size)
        assert thinking == "Need the weather."
        content, calls = parse_tool_calls(answer, "harmony")
        assert content is None and len(calls) == 1
        assert calls[0].name == "get_weather"
        assert json.loads(calls[0].arguments) == {"city": "Paris"}


def test_a_preamble_is_answer_and_a_cut_output_keeps_its_thinking() -> None:
    preamble = "<|channel|>commentary<|message|>Let me check.<|end|>"
    assert _streamed(preamble, 3) == ("", "Let me check.")
    cut = "<|channel|>analysis<|message|>Still thinking about <|"  # max_tokens ran out
    assert _streamed(cut, 4) == ("Still thinking about <|", "")
    # A model that writes outside the format: its text is the answer (at the end).
    assert _streamed("plain text, no harmony", 4) == ("", "plain text, no harmony")
    assert _streamed("<|channel|>final", 4) == ("", "")  # a header cut short: nothing said


def test_the_format_is_found_from_the_template() -> None:
    harmony = "{{ '<|start|>assistant<|channel|>analysis<|message|>' }} to=functions."
    assert reasoning_format(harmony) == "harmony"
    assert pick_parser(harmony, None) == "harmony"
    assert reasoning_format(None, "openai_gptoss") == "harmony"
    assert reasoning_format("<think></think>") == "think"


def test_the_history_as_gpt_oss_reads_it() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    out = harmony_history(messages)
    assert out[0] == messages[0] and out[2] == messages[2]
    assert out[1]["thinking"] == "Need the weather." and "reasoning_content" not in out[1]
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["reasoning_content"] == "Need the weather."  # the request's unchanged
