"""Reasoning models: the thinking they write before their answer, told apart from the answer.

Qwen3, QwQ, DeepSeek-R1 and its distills think inside ``<think>...</think>`` and answer after
it; gpt-oss thinks in harmony's ``analysis`` channel (harmony.py). Some chat templates open the block themselves (the generation prompt ends in ``<think>``:
DeepSeek-R1's, QwQ's), so the output starts inside it; others leave it to the model (Qwen3),
or close it at once when thinking is off (Qwen3's ``enable_thinking: false`` writes an empty
block into the prompt).

- ``reasoning_format`` says which format a chat template uses (``--reasoning-parser`` names one
  or turns it off); ``opens_thinking`` whether a rendered prompt leaves the block open.
- ``split_reasoning`` splits a finished output; ``ReasoningStream`` splits one delta at a time,
  holding back the text that may be the start of a tag.
- ``ThinkingBudget`` is what the worker needs to end the thinking at ``max_thinking_tokens``:
  the token ids that open and close the block, and whether the prompt left it open.
  ``BudgetState`` follows a request's tokens and names the token it must take next (the
  closing sequence, once the budget is spent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill import harmony

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

THINK_START = "<think>"
THINK_END = "</think>"
# --reasoning-parser's names (vLLM's), each the format of the families that use it.
REASONING_PARSERS = {"qwen3": "think", "deepseek_r1": "think", "openai_gptoss": "harmony"}
# Each format's tags around the thinking: where a thinking budget ends it, and what counts as
# thinking tokens.
REASONING_TAGS = {
    "think": (THINK_START, THINK_END),
    "harmony": (harmony.THINKING_START, harmony.THINKING_END),
}


def reasoning_format(chat_template: str | None, parser: str = "auto") -> str | None:
    """The reasoning format of a model: ``parser``'s when it names one, None for "none", else
    ("auto") "think" when the chat template writes a ``<think>`` block, "harmony" when it
    writes harmony's channels (gpt-oss)."""
    if parser == "none":
        return None
    if parser in REASONING_PARSERS:
        return REASONING_PARSERS[parser]
    if parser != "auto":
        raise ValueError(
            f"reasoning_parser must be auto, none or one of {', '.join(REASONING_PARSERS)}; "
            f"got {parser!r}"
        )
    if harmony.is_harmony(chat_template):
        return "harmony"
    template = chat_template or ""
    if THINK_START in template and THINK_END in template:
        return "think"
    return None


def reasoning_stream(fmt: str, opened: bool) -> ReasoningStream | harmony.HarmonyStream:
    """The splitter of an output of the format ``fmt`` (``reasoning_format``'s)."""
    return harmony.HarmonyStream() if fmt == "harmony" else ReasoningStream(opened)


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` block (the template opened
    it: the output starts with thinking)."""
    start = prompt.rfind(THINK_START)
    return start >= 0 and prompt.rfind(THINK_END) < start


# The tokens of a prompt's end that tell whether it left a block open.
PROMPT_TAIL_TOKENS = 16


def prompt_opens_thinking(tokenizer: Tokenizer, prompt_ids: list[int]) -> bool:
    """``opens_thinking`` of a tokenized prompt, read off its last tokens."""
    tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return opens_thinking(tail)


def split_reasoning(text: str, opened: bool, fmt: str = "think") -> tuple[str | None, str]:
    """(reasoning, content) of a finished output; ``opened``: the prompt opened the block.

    An output that never closes its block is all reasoning (it ran out of tokens thinking);
    one that never opens it is all content."""
    stream = reasoning_stream(fmt, opened)
    reasoning, content = stream.feed(text)
    tail_reasoning, tail_content = stream.finish()
    reasoning += tail_reasoning
    content += tail_content
    return (reasoning if stream.saw_reasoning else None), content


@dataclass
class ReasoningStream:
    """Splits an output into reasoning and content as its text arrives, delta by delta."""

    opened: bool = False  # the prompt opened the block: the output starts inside it
    _state: str = field(init=False)  # "start" (may open), "thinking", "closed", "answer"
    _pending: str = field(default="", init=False)  # text that may be the start of a tag
    saw_reasoning: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._state = "thinking" if self.opened else "start"
        self.saw_reasoning = self.opened

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) of ``delta``, less what may be a tag cut in two."""
        text = self._pending + delta
        self._pending = ""
        reasoning, content = [], []
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if not stripped:  # whitespace before a possible <think>: wait
                    self._pending = text
                    break
                if stripped.startswith(THINK_START):
                    self._state, self.saw_reasoning = "thinking", True
                    text = stripped[len(THINK_START) :]
                    continue
                if THINK_START.startswith(stripped):  # "<thi": wait for the rest
                    self._pending = text
                    break
                self._state = "answer"
                continue
            if self._state == "thinking":
                end = text.find(THINK_END)
                if end >= 0:
                    reasoning.append(text[:end])
                    text = text[end + len(THINK_END) :]
                    self._state = "closed"
                    continue
                keep = _partial_suffix(text, THINK_END)
                reasoning.append(text[: len(text) - keep])
                self._pending = text[len(text) - keep :]
                break
            if self._state == "closed":  # the newlines after the tag belong to neither
                text = text.lstrip("\n")
                if text:
                    self._state = "answer"
                continue
            content.append(text)
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended."""
        text, self._pending = self._pending, ""
        if self._state == "thinking":
            return text, ""
        return "", text


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that starts ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ---- the thinking budget (max_thinking_tokens) ------------------------------------------------


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    """Ends a request's thinking after ``max_tokens`` tokens of it by making the model write
    ``end_ids`` (the tokens of ``</think>``); it then answers as it would have."""

    max_tokens: int
    start_ids: tuple[int, ...]  # the tokens of <think>
    end_ids: tuple[int, ...]  # the tokens of </think>
    opened: bool  # the prompt opened the block

    def state(self) -> BudgetState:
        return BudgetState(self)


@dataclass(slots=True)
class BudgetState:
    """Where one request is: before, inside or after its thinking, and how much it spent."""

    budget: ThinkingBudget
    thinking: bool = field(init=False)
    done: bool = field(default=False, init=False)  # the block closed: nothing more to do
    spent: int = field(default=0, init=False)  # tokens of thinking so far
    forced: int = field(default=0, init=False)  # tokens of end_ids written since the budget ran out
    _tail: list[int] = field(default_factory=list, init=False)  # recent ids, to see tags
    _keep: int = field(default=0, init=False)  # how many: the longer tag's

    def __post_init__(self) -> None:
        self.thinking = self.budget.opened
        self._keep = max(len(self.budget.start_ids), len(self.budget.end_ids))

    def forced_token(self) -> int | None:
        """The token the request must take next, or None when it may take any."""
        if self.thinking and self.spent >= self.budget.max_tokens:
            return self.budget.end_ids[self.forced]
        return None

    def accept(self, token_ids: list[int]) -> None:
        for token in token_ids:
            self._accept(token)

    def copy(self) -> BudgetState:
        other = BudgetState(self.budget)
        other.thinking, other.done, other.spent = self.thinking, self.done, self.spent
        other.forced, other._tail = self.forced, list(self._tail)
        return other

    def _accept(self, token: int) -> None:
        if self.done:
            return
        self._tail = (self._tail + [token])[-self._keep :]
        if not self.thinking:
            if _ends_with(self._tail, self.budget.start_ids):
                self.thinking = True
            return
        if self.spent >= self.budget.max_tokens:  # writing the forced end
            self.forced += 1
            if self.forced == len(self.budget.end_ids):
                self.thinking, self.done = False, True
            return
        self.spent += 1
        if _ends_with(self._tail, self.budget.end_ids):  # the model closed the block itself
            self.thinking, self.done = False, True


def _ends_with(tokens: list[int], suffix: tuple[int, ...]) -> bool:
    return bool(suffix) and tuple(tokens[-len(suffix) :]) == suffix
