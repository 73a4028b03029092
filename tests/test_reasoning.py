"""reasoning.py: which templates reason, splitting thinking from answer whole and delta by
delta (tags cut anywhere), and the budget's state machine."""

from __future__ import annotations

import pytest
from reasoning_templates import DEEPSEEK_R1, QWEN3

from tokenmill.reasoning import (
    ReasoningStream,
    ThinkingBudget,
    opens_thinking,
    reasoning_format,
    split_reasoning,
)


def test_formats_come_from_the_template_or_the_flag() -> None:
    assert reasoning_format(QWEN3) == reasoning_format(DEEPSEEK_R1) == "think"
    assert reasoning_format("{{ messages[0].content }}") is None
    assert reasoning_format(None, "qwen3") == "think"
    assert reasoning_format(QWEN3, "none") is None
    with pytest.raises(ValueError, match="reasoning_parser must be"):
        reasoning_format(QWEN3, "glm")


def test_a_prompt_opens_the_block_only_when_it_leaves_it_open() -> None:
    assert opens_thinking("<｜Assistant｜><think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("text", "opened", "want"),
    [
        ("<think>\nhmm\n</think>\n\nParis", False, ("\nhmm\n", "Paris")),
        ("hmm</think>Paris", True, ("hmm", "Paris")),
        ("Paris", False, (None, "Paris")),
        ("still thinking", True, ("still thinking", "")),  # ran out of tokens thinking
        ("  <think>a</think>b", False, ("a", "b")),
        ("<thinker", False, (None, "<thinker")),
    ],
)
def test_split_whole(text, opened, want) -> None:
    assert split_reasoning(text, opened) == want


@pytest.mark.parametrize("opened", [False, True])
def test_split_delta_by_delta_agrees_with_the_whole(opened) -> None:
    text = ("" if opened else "<think>") + "a < b, so </thi ng>.</think>\n\nThe answer: <x>"
    want = split_reasoning(text, opened)
    for size in (1, 2, 3, 5, 8):
        stream = ReasoningStream(opened)
        reasoning, content = "", ""
        for i in range(0, len(text), size):
            r, c = stream.feed(text[i : i + size])
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        assert (reasoning + r, content + c) == want, size


def test_the_budget_forces_the_end_after_its_tokens() -> None:
    start, end = (7,), (8, 9)
    state = ThinkingBudget(3, start, end, opened=False).state()
    state.accept([1, 2])  # before the block: free
    assert state.forced_token() is None
    state.accept([7, 1, 2, 3])  # the block opens, three tokens think
    assert state.forced_token() == 8
    state.accept([8])
    assert state.forced_token() == 9
    state.accept([9, 4, 5])
    assert state.forced_token() is None and state.done and state.spent == 3


def test_a_model_that_closes_the_block_itself_is_left_alone() -> None:
    state = ThinkingBudget(5, (7,), (8,), opened=True).state()
    state.accept([1, 8, 2, 3, 4, 5, 6, 7])
    assert state.forced_token() is None and state.done and state.spent == 2
