"""server/tools.py: parsing the three tool-call formats, the call grammar, the generic prompt."""

from __future__ import annotations

import json

from tokenmill.server.tools import (
    Tool,
    call_grammar,
    generic_messages,
    may_be_call_start,
    parse_tool_calls,
    pick_parser,
)


def names_and_args(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_and_the_text_around_them() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Sure."
    assert names_and_args(calls) == [("f", {"x": 1}), ("g", {})]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>", "hermes") == (
        "<tool_call>{not json}</tool_call>",
        [],
    )


def test_llama3_json_and_mistral_calls() -> None:
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "f", "parameters": {"x": 2}}', "llama3_json"
    )
    assert content is None and names_and_args(calls) == [("f", {"x": 2})]
    content, calls = parse_tool_calls(
        '[TOOL_CALLS] [{"name": "g", "arguments": {"y": "a"}}]', "mistral"
    )
    assert content is None and names_and_args(calls) == [("g", {"y": "a"})]
    assert parse_tool_calls("just text", "mistral") == ("just text", [])


def test_streamed_text_is_held_only_while_it_may_start_a_call() -> None:
    assert may_be_call_start("<tool", "hermes") and may_be_call_start(" <tool_call>{", "hermes")
    assert not may_be_call_start("Hello", "hermes")
    assert may_be_call_start("[TOOL", "mistral") and not may_be_call_start("No", "mistral")


def test_parser_from_the_template() -> None:
    assert pick_parser("... [TOOL_CALLS] ...", None) == "mistral"
    assert pick_parser("... <|python_tag|> ...", None) == "llama3_json"
    assert pick_parser("{{ messages }}", None) == "hermes"
    assert pick_parser("[TOOL_CALLS]", "hermes") == "hermes"


def test_call_grammar_and_generic_prompt() -> None:
    tools = [Tool("f", "does f", {"type": "object", "properties": {"x": {"type": "integer"}}})]
    grammar = call_grammar(tools, parallel=True).grammar
    assert grammar.startswith('start: call ("\\n" call)*') and '"const": "f"' in grammar
    messages = generic_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "x?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}],
            },
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ],
        tools,
    )
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert (
        messages[0]["content"].startswith("Be brief.") and '"name": "f"' in messages[0]["content"]
    )
    assert (
        messages[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    )
    assert messages[3]["content"] == "<tool_response>\n42\n</tool_response>"
