"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the chat route.

A request becomes an OpenAI chat request: the system prompt a system message, text blocks the
message's text, ``tool_use`` blocks an assistant's ``tool_calls``, ``tool_result`` blocks
``role: "tool"`` messages, ``thinking`` blocks ``reasoning_content``; tools and tool_choice map
one to one (auto, any -> required, tool -> a named function, none). It then runs as a chat
completion does (OpenAIServing.start_chat: keys, limits, metering, metrics), and its outputs
come back as Anthropic's content blocks: thinking, text, tool_use.

Streams are Anthropic's events: message_start, a content_block_start / _delta / _stop per
block (text_delta, thinking_delta, input_json_delta), message_delta with the stop_reason and
usage, message_stop. With tools offered, the text is held to the end (it may be a call).
Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (errors.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.outputs import RequestOutput
from tokenmill.server import tools as tools_mod
from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving import (
    Aborted,
    OpenAIServing,
    StartedChat,
    StreamBody,
)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class ToolDefinition(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom"
    cache_control: dict[str, Any] | None = None


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Strict):
    model: str
    max_tokens: int
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: Usage


class MessageStreamEvent(BaseModel):
    """One event of a streamed message (its SSE ``event:`` name is its type); the fields
    beside it depend on the type (message, content_block, delta, ...)."""

    model_config = ConfigDict(extra="allow")

    type: str


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicError(BaseModel):
    type: str  # invalid_request_error, authentication_error, ...
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body, which its routes answer (errors.error_body_for)."""

    type: Literal["error"] = "error"
    error: AnthropicError


class AnthropicServing:
    def __init__(self, openai: OpenAIServing) -> None:
        self.openai = openai

    async def messages(self, body: MessagesRequest, raw: Request) -> Response:
        chat = await self.openai.start_chat(as_chat_request(body), raw, prefix="msg")
        if body.stream:
            return StreamBody(self._events(chat, body), on_close=chat.run.close)
        finals = await self.openai.collect(chat.run, raw)
        if finals is None:
            return Response(status_code=499)
        final = finals[0]
        blocks, stop_reason, stop_sequence = _blocks(chat, final, body)
        usage = _usage(final)
        reply = MessageResponse(
            id=chat.run.request_id, content=blocks, model=body.model, stop_reason=stop_reason,
            stop_sequence=stop_sequence, usage=usage,
        )  # fmt: skip
        return JSONResponse(reply.model_dump(mode="json"))

    async def count_tokens(self, body: CountTokensRequest) -> CountTokensResponse:
        engine = self.openai.state.require_engine()
        request = as_chat_request(MessagesRequest(**body.model_dump(), max_tokens=1))
        prompt = self.openai.chat_prompt(engine, request)
        ids = await asyncio.to_thread(prompt.render, engine)
        return CountTokensResponse(input_tokens=len(ids))

    async def _events(self, chat: StartedChat, body: MessagesRequest) -> AsyncIterator[str]:
        run = chat.run
        blocks = _BlockWriter()
        held = ""  # with tools: the text, parsed at the end
        try:
            start = {
                "id": run.request_id,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": body.model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": len(run.prepared[0].prompt_token_ids),
                    "output_tokens": 0,
                },
            }
            yield _event("message_start", {"type": "message_start", "message": start})
            try:
                async for thinking, text in chat.deltas():
                    for event in blocks.delta("thinking", thinking):
                        yield event
                    if chat.parser is not None:
                        held += text
                    else:
                        for event in blocks.delta("text", text):
                            yield event
            except Aborted:
                run.failed = True
                yield _event("error", _error_body(run.aborted_error().message, "api_error"))
                return
            except Exception as e:
                run.failed = True
                error = self.openai.engine_error(e)
                yield _event("error", _error_body(error.message, "api_error"))
                return
            final = run.output(0)  # the whole reply: the stream's deltas added up
            calls: list[tools_mod.ToolCall] = []
            if chat.parser is not None:
                text, calls = chat.calls(held)
                for event in blocks.delta("text", text):
                    yield event
            for call in calls:
                for event in blocks.tool_use(call):
                    yield event
            for event in blocks.close():
                yield event
            stop_reason, stop_sequence = _stop(final, body, bool(calls))
            delta = {"type": "message_delta",
                     "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     "usage": {"output_tokens": len(final.outputs[0].token_ids)}}  # fmt: skip
            yield _event("message_delta", delta)
            yield _event("message_stop", {"type": "message_stop"})
        finally:
            run.close()


class _BlockWriter:
    """Content blocks as events: each opened by its first delta, closed by the next block."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def delta(self, kind: str, text: str) -> list[str]:
        if not text:
            return []
        events = []
        if kind != self.kind:
            events += self.close()
            self.index += 1
            self.kind = kind
            block = {"type": kind, kind: ""}
            events.append(_event("content_block_start", {
                "type": "content_block_start", "index": self.index, "content_block": block}))  # fmt: skip
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(_event("content_block_delta", {
            "type": "content_block_delta", "index": self.index, "delta": delta}))  # fmt: skip
        return events

    def tool_use(self, call: tools_mod.ToolCall) -> list[str]:
        events = self.close()
        self.index += 1
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        events.append(_event("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block}))  # fmt: skip
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        events.append(_event("content_block_delta", {
            "type": "content_block_delta", "index": self.index, "delta": delta}))  # fmt: skip
        self.kind = "tool_use"
        return events + self.close()

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def as_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The OpenAI chat request that runs an Anthropic one (400 naming what does not map)."""
    messages: list[dict[str, Any]] = []
    system = _text(body.system, "system") if body.system is not None else None
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        messages += _chat_messages(m, f"messages.{i}")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_tokens,
        "stream": False,
    }
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    if body.metadata and isinstance(body.metadata.get("user_id"), str):
        chat["user"] = body.metadata["user_id"]
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": {
                "name": t.name, "description": t.description or "",
                "parameters": t.input_schema}}
            for t in body.tools
        ]  # fmt: skip
    if body.tool_choice is not None:
        chat["tool_choice"], parallel = _tool_choice(body.tool_choice)
        if parallel is False:
            chat["parallel_tool_calls"] = False
    if body.thinking is not None:
        kind = body.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad_request("thinking.type must be enabled, disabled or adaptive", "thinking")
        chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
        budget = body.thinking.get("budget_tokens")
        if kind == "enabled" and isinstance(budget, int):
            chat["max_thinking_tokens"] = budget
    return ChatCompletionRequest.model_validate(chat)


def _chat_messages(m: Message, where: str) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text, calls, results, thinking = [], [], [], []
    for j, block in enumerate(m.content):
        kind = block.get("type")
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use" and m.role == "assistant":
            calls.append({"id": block.get("id", ""), "type": "function", "function": {
                "name": block.get("name", ""), "arguments": json.dumps(block.get("input", {}))}})  # fmt: skip
        elif kind == "tool_result" and m.role == "user":
            content = block.get("content", "")
            if not isinstance(content, str):
                content = _text(content, f"{where}.content.{j}.content")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""),
                            "content": content})  # fmt: skip
        elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
            thinking.append(str(block.get("thinking", "")))
        else:
            raise bad_request(
                f"content block type {kind!r} is not supported in a {m.role} message "
                "(text, tool_use, tool_result and thinking are)",
                param=f"{where}.content.{j}.type",
            )
    out: list[dict[str, Any]] = list(results)
    if text or calls or thinking or not results:
        message: dict[str, Any] = {"role": m.role, "content": "\n".join(text) or None}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "\n".join(thinking)
        out.append(message)
    return out


def _text(content: str | list[dict[str, Any]], param: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if block.get("type") != "text":
            raise bad_request(f"only text blocks are supported in {param}", param=param)
        parts.append(str(block.get("text", "")))
    return "\n".join(parts)


def _tool_choice(choice: dict[str, Any]) -> tuple[Any, bool | None]:
    kind = choice.get("type")
    parallel = None if "disable_parallel_tool_use" not in choice else (
        not choice["disable_parallel_tool_use"])  # fmt: skip
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request("tool_choice.type must be auto, any, tool (with name) or none", "tool_choice")


def _blocks(
    chat: StartedChat, final: RequestOutput, body: MessagesRequest
) -> tuple[list[dict[str, Any]], str | None, str | None]:
    thinking, text, calls = chat.reply(final)
    blocks: list[dict[str, Any]] = []
    if thinking:
        blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if text:
        blocks.append({"type": "text", "text": text})
    for call in calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                       "input": json.loads(call.arguments)})  # fmt: skip
    stop_reason, stop_sequence = _stop(final, body, bool(calls))
    return blocks, stop_reason, stop_sequence


def _stop(final: RequestOutput, body: MessagesRequest, called: bool) -> tuple[str, str | None]:
    completion = final.outputs[0]
    if called:
        return "tool_use", None
    if completion.finish_reason == "length":
        return "max_tokens", None
    reason = completion.stop_reason
    if isinstance(reason, str) and reason in (body.stop_sequences or []):
        return "stop_sequence", reason
    return "end_turn", None


def _usage(final: RequestOutput) -> Usage:
    return Usage(
        input_tokens=len(final.prompt_token_ids),
        output_tokens=len(final.outputs[0].token_ids),
        cache_read_input_tokens=final.metrics.num_cached_tokens,
    )


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def _error_body(message: str, kind: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}
