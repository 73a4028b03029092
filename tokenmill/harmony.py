"""OpenAI's harmony format (gpt-oss): a reply is a run of messages, each a header and a body.

    <|start|>assistant<|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>

The chat template's generation prompt ends in ``<|start|>assistant``, so an output starts in
its first header. The ``analysis`` channel is the thinking (``reasoning_content``), ``final``
the answer, and a ``commentary`` message addressed ``to=functions.NAME`` a tool call (others on
that channel, preambles, are answer text). ``<|return|>`` and ``<|call|>`` end generation (the
model's stop tokens: they may not reach the text).

``HarmonyStream`` reads an output's text (special tokens kept) delta by delta, as
reasoning.ReasoningStream reads ``<think>`` blocks, and gives (thinking, answer) text; a tool
call comes out in the answer as a Hermes ``<tool_call>`` block, which the tool-call parser reads
like any other model's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
ENDS = (END, RETURN, CALL)
# The thinking's tags, for the thinking budget and the count of thinking tokens.
THINKING_START = CHANNEL + "analysis" + MESSAGE
THINKING_END = END
# Hermes' tool-call tags: the one definition, which server/tools.py parses calls by.
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([\w.-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes harmony (its channels, and the analysis one)."""
    return chat_template is not None and CHANNEL in chat_template and "analysis" in chat_template


@dataclass
class HarmonyStream:
    """Splits a harmony output into thinking and answer text as it arrives."""

    saw_reasoning: bool = field(default=False, init=False)
    _in_body: bool = field(default=False, init=False)
    _header: str = field(default="", init=False)
    _pending: str = field(default="", init=False)  # body text that may start an end marker
    _channel: str = field(default="", init=False)
    _recipient: str = field(default="", init=False)
    _call: str = field(default="", init=False)  # a tool call's arguments so far

    def feed(self, delta: str) -> tuple[str, str]:
        """(thinking, answer) of ``delta``, less what may be a marker cut in two."""
        text = self._pending + delta
        self._pending = ""
        thinking, answer = [], []
        while text:
            if not self._in_body:  # a header: read whole, once its <|message|> arrives
                text, self._header = self._header + text, ""
                at = text.find(MESSAGE)
                if at < 0:
                    self._header = text
                    break
                self._begin(text[:at])
                text = text[at + len(MESSAGE) :]
                continue
            at, marker = min(((text.find(m), m) for m in ENDS if m in text), default=(-1, ""))
            body = text if at < 0 else text[:at]
            if at < 0:  # hold back what may be the start of a marker
                keep = _partial_marker(body)
                body, self._pending = body[: len(body) - keep], body[len(body) - keep :]
            self._route(body, thinking, answer)
            if at < 0:
                break
            self._close(answer)
            text = text[at + len(marker) :]
        return "".join(thinking), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended (a stop token ended its last
        message)."""
        thinking, answer = [], []
        if self._in_body:
            self._route(self._pending, thinking, answer)
            self._close(answer)
        elif "<|" not in self._header:  # text outside the format altogether: the answer
            answer.append(self._header)
        self._pending = self._header = ""
        return "".join(thinking), "".join(answer)

    def _begin(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else ""
        self._recipient = recipient.group(1) if recipient else ""
        self._in_body, self._header, self._call = True, "", ""
        if self._channel == "analysis":
            self.saw_reasoning = True

    def _route(self, body: str, thinking: list[str], answer: list[str]) -> None:
        if self._recipient.startswith("functions."):
            self._call += body
        elif self._channel == "analysis":
            thinking.append(body)
        else:  # final, a commentary preamble, or a message without a channel
            answer.append(body)

    def _close(self, answer: list[str]) -> None:
        if self._recipient.startswith("functions."):
            name = self._recipient.removeprefix("functions.")
            arguments = self._call.strip() or "{}"
            answer.append(f'{CALL_OPEN}{{"name": {json.dumps(name)}, '
                          f'"arguments": {arguments}}}{CALL_CLOSE}')  # fmt: skip
        self._in_body, self._channel, self._recipient, self._call = False, "", "", ""
        self._header = ""


def _partial_marker(text: str) -> int:
    """The length of the longest end of ``text`` that starts an end marker."""
    for n in range(min(max(len(m) for m in ENDS) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in ENDS):
            return n
    return 0
