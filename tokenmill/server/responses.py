"""OpenAI's Responses API (POST /v1/responses; GET and DELETE /v1/responses/{id}) over the
chat route.

A request becomes a chat request, as Anthropic's does (server/anthropic.py): ``instructions``
a system message, ``input`` (a string, or items) the messages: message items by role,
``function_call`` items an assistant's ``tool_calls``, ``function_call_output`` items tool
messages, ``reasoning`` items the next assistant message's ``reasoning_content``. Function
tools and tool_choice map one to one, ``text.format`` becomes ``response_format``,
``reasoning.effort`` the template's thinking switch. It then runs as a chat completion does
(OpenAIServing.start_chat: keys, limits, metering, metrics), and its outputs come back as
output items: reasoning, message (output_text), function_call.

State: a response is stored (``store``, true by default as in OpenAI's API) in a bounded
in-memory ResponseStore with a time to live, under the key that made it; a later request
continues it with ``previous_response_id`` (its conversation, not its instructions, carries
over). A restart forgets them all; the server's ``responses_store_size`` 0 keeps none.

Streams are the Responses events, each with its sequence_number: response.created,
response.in_progress, then per output item output_item.added, content_part.added, the deltas
(output_text, reasoning_text, function_call_arguments) and their .done events,
content_part.done, output_item.done; response.completed (or response.incomplete when
max_output_tokens cut it). With tools offered, the text is held to the end (it may be a call).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.outputs import RequestOutput
from tokenmill.server import tools as tools_mod
from tokenmill.server.auth import caller_of
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving import Aborted, OpenAIServing, StartedChat, StreamBody

# Where "reasoning.effort" leaves the template's thinking switch (none: off).
_EFFORTS = ("none", "low", "medium", "high")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    # tokenmill's, as on chat completions: a reasoning model's thinking ends after this many.
    max_thinking_tokens: int | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Accepted as OpenAI's clients send them; nothing here depends on them.
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: bool | None = None


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    """A response as OpenAI's API returns it (the fields its SDK requires, and what was asked)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response (its SSE ``event:`` name is its type); the fields
    beside these depend on the type (response, item, delta, ...)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


@dataclass
class Stored:
    """A stored response: who made it, its conversation so far (chat messages, its own
    output included, its instructions not) and what GET returns."""

    key_id: str
    messages: list[dict[str, Any]]
    response: ResponseObject
    expires: float


class ResponseStore:
    """Responses by id, at most ``size`` of them (the oldest go first), each for ``ttl`` seconds."""

    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.size = size
        self.ttl = ttl
        self.clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, key_id: str, messages: list[dict[str, Any]], response: ResponseObject) -> None:
        if self.size == 0:
            return
        self._items[response.id] = Stored(key_id, messages, response, self.clock() + self.ttl)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, key_id: str, response_id: str, param: str | None = None) -> Stored:
        """The stored response (404 when none under this key has that id, or it expired)."""
        now = self.clock()
        while self._items and next(iter(self._items.values())).expires <= now:
            self._items.popitem(last=False)  # they expire in the order they were stored
        stored = self._items.get(response_id)
        if stored is None or stored.key_id != key_id:
            kept = (
                "this server keeps no responses (responses_store_size 0)"
                if self.size == 0
                else f"responses are kept {self.ttl:g} s, the last {self.size} of them"
            )
            raise APIError(
                404, f"no stored response has id {response_id!r}: {kept}", param=param,
                code="not_found",
            )  # fmt: skip
        return stored

    def delete(self, key_id: str, response_id: str) -> None:
        self.get(key_id, response_id)
        del self._items[response_id]


class ResponsesServing:
    def __init__(self, openai: OpenAIServing, store: ResponseStore) -> None:
        self.openai = openai
        self.store = store

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        key_id = caller_of(raw).key_id
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.store.get(key_id, body.previous_response_id, "previous_response_id")
            history = stored.messages
        request, messages = as_chat_request(body, history)
        chat = await self.openai.start_chat(request, raw, prefix="resp")
        response = _Response(body, chat, self._stored_by(key_id, body, messages))
        if body.stream:
            return StreamBody(self._events(chat, response), on_close=chat.run.close)
        finals = await self.openai.collect(chat.run, raw)
        if finals is None:
            return Response(status_code=499)
        done = response.final(finals[0], _items(chat, finals[0]))
        return JSONResponse(done.model_dump(mode="json"))

    def retrieve(self, raw: Request, response_id: str) -> ResponseObject:
        return self.store.get(caller_of(raw).key_id, response_id, "response_id").response

    def delete(self, raw: Request, response_id: str) -> DeletedResponse:
        self.store.delete(caller_of(raw).key_id, response_id)
        return DeletedResponse(id=response_id)

    def _stored_by(
        self, key_id: str, body: ResponsesRequest, messages: list[dict[str, Any]]
    ) -> Callable[[ResponseObject], None]:
        def keep(done: ResponseObject) -> None:
            if body.store and done.status != "failed":
                self.store.put(key_id, messages + _as_messages(done.output), done)

        return keep

    async def _events(self, chat: StartedChat, response: _Response) -> AsyncIterator[str]:
        run = chat.run
        items = _ItemWriter()
        held = ""  # with tools: the text, parsed at the end
        try:
            yield items.event("response.created", response=response.snapshot("in_progress"))
            yield items.event("response.in_progress", response=response.snapshot("in_progress"))
            try:
                async for thinking, text in chat.deltas():
                    for event in items.text("reasoning", thinking):
                        yield event
                    if chat.parser is not None:
                        held += text
                    else:
                        for event in items.text("message", text):
                            yield event
            except Exception as e:
                run.failed = True
                error = run.aborted_error() if isinstance(e, Aborted) else (
                    self.openai.engine_error(e))  # fmt: skip
                yield items.event("error", code=error.code, message=error.message, param=None)
                failed = response.snapshot("failed")
                failed.error = {"code": error.code or "server_error", "message": error.message}
                yield items.event("response.failed", response=failed)
                return
            final = run.output(0)  # the whole reply: the stream's deltas added up
            if chat.parser is not None:
                text, calls = chat.calls(held)
                for event in items.text("message", text):
                    yield event
                for call in calls:
                    for event in items.function_call(call):
                        yield event
            for event in items.close():
                yield event
            done = response.final(final, items.done)
            kind = "response.completed" if done.status == "completed" else "response.incomplete"
            yield items.event(kind, response=done)
        finally:
            run.close()


class _Response:
    """One request's response object: its snapshot while running, its final form (stored)."""

    def __init__(
        self,
        body: ResponsesRequest,
        chat: StartedChat,
        keep: Callable[[ResponseObject], None],
    ) -> None:
        self.body = body
        self.chat = chat
        self.keep = keep
        self.created = int(time.time())

    def snapshot(self, status: str) -> ResponseObject:
        b = self.body
        return ResponseObject(
            id=self.chat.run.request_id,
            created_at=self.created,
            status=status,
            model=b.model,
            output=[],
            instructions=b.instructions,
            max_output_tokens=b.max_output_tokens,
            temperature=b.temperature,
            top_p=b.top_p,
            tools=b.tools or [],
            tool_choice=b.tool_choice or "auto",
            parallel_tool_calls=b.parallel_tool_calls is not False,
            text=b.text or {"format": {"type": "text"}},
            reasoning=b.reasoning,
            previous_response_id=b.previous_response_id,
            store=b.store,
            metadata=b.metadata or {},
            user=b.user,
        )

    def final(self, out: RequestOutput, output: list[dict[str, Any]]) -> ResponseObject:
        completion = out.outputs[0]
        cut = completion.finish_reason == "length"
        done = self.snapshot("incomplete" if cut else "completed")
        done.output = output
        if cut:
            done.incomplete_details = {"reason": "max_output_tokens"}
        thinking = self.chat.thinking
        reasoning = thinking.num_tokens(completion.token_ids) if thinking is not None else 0
        done.usage = ResponseUsage(
            input_tokens=len(out.prompt_token_ids),
            input_tokens_details=InputTokensDetails(cached_tokens=out.metrics.num_cached_tokens),
            output_tokens=len(completion.token_ids),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
            total_tokens=len(out.prompt_token_ids) + len(completion.token_ids),
        )
        self.keep(done)
        return done


class _ItemWriter:
    """Output items as Responses events: a reasoning or message item opened by its first
    text, closed by the next item; function calls whole. ``done`` holds the finished items."""

    def __init__(self) -> None:
        self.sequence = 0
        self.done: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None
        self.text_so_far = ""

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence}
        for name, value in fields.items():
            data[name] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def text(self, kind: Literal["reasoning", "message"], delta: str) -> list[str]:
        if not delta:
            return []
        events = []
        if self.item is None or self.item["type"] != kind:
            events += self.close()
            self.item = _item(kind, "")
            self.item["status"] = "in_progress"
            self.text_so_far = ""
            events.append(
                self._item_event("response.output_item.added", {**self.item, "content": []})
            )
            events.append(self._part_event("response.content_part.added", _part(kind, "")))
        self.text_so_far += delta
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._in_item(name, content_index=0, delta=delta, **extra))
        return events

    def function_call(self, call: tools_mod.ToolCall) -> list[str]:
        """A call's events: its arguments come whole (the call is parsed once the text ends)."""
        events = self.close()
        item = _function_call(call)
        where = {"output_index": len(self.done)}
        opened = {**item, "arguments": "", "status": "in_progress"}
        arguments = {"item_id": item["id"], **where}
        events += [
            self.event("response.output_item.added", item=opened, **where),
            self.event("response.function_call_arguments.delta", delta=call.arguments, **arguments),
            self.event(
                "response.function_call_arguments.done", arguments=call.arguments, **arguments
            ),  # fmt: skip
            self.event("response.output_item.done", item=item, **where),
        ]
        self.done.append(item)
        return events

    def close(self) -> list[str]:
        if self.item is None:
            return []
        kind, text = self.item["type"], self.text_so_far
        if kind == "message":
            events = [self._in_item("response.output_text.done", content_index=0, text=text,
                                    logprobs=[])]  # fmt: skip
        else:
            events = [self._in_item("response.reasoning_text.done", content_index=0, text=text)]
        events.append(self._part_event("response.content_part.done", _part(kind, text)))
        item = _item(kind, text, self.item["id"])
        events.append(self._item_event("response.output_item.done", item))
        self.done.append(item)
        self.item = None
        return events

    def _item_event(self, kind: str, item: dict[str, Any]) -> str:
        return self.event(kind, output_index=len(self.done), item=item)

    def _part_event(self, kind: str, part: dict[str, Any]) -> str:
        return self._in_item(kind, content_index=0, part=part)

    def _in_item(self, kind: str, **fields: Any) -> str:
        assert self.item is not None
        return self.event(kind, item_id=self.item["id"], output_index=len(self.done), **fields)


def _items(chat: StartedChat, final: RequestOutput) -> list[dict[str, Any]]:
    """The output items of a finished run: reasoning, message, function calls."""
    thinking, text, calls = chat.reply(final)
    items = [_item("reasoning", thinking)] if thinking else []
    if text:
        items.append(_item("message", text))
    return items + [_function_call(call) for call in calls]


def _item(kind: str, text: str, item_id: str | None = None) -> dict[str, Any]:
    if kind == "message":
        return {"type": "message", "id": item_id or _id("msg"), "status": "completed",
                "role": "assistant", "content": [_part(kind, text)]}  # fmt: skip
    return {"type": "reasoning", "id": item_id or _id("rs"), "status": "completed",
            "summary": [], "content": [_part(kind, text)]}  # fmt: skip


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _function_call(call: tools_mod.ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}  # fmt: skip


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request -> chat request -----------------------------------------------------------------


def as_chat_request(
    body: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """(the chat request that runs a Responses one, its conversation without the instructions:
    what a stored response continues). 400 naming what does not map."""
    if isinstance(body.input, str):
        new = [{"role": "user", "content": body.input}]
    else:
        new = _as_messages(body.input, "input")
    conversation = history + new
    if not conversation:
        raise bad_request("input has no messages", param="input")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {"model": body.model, "messages": system + conversation}
    names = (
        "temperature",
        "top_p",
        "metadata",
        "user",
        "parallel_tool_calls",
        "max_thinking_tokens",
    )
    for name in names:
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None and body.text.get("format") is not None:
        chat["response_format"] = _response_format(body.text["format"])
    if body.reasoning is not None and body.reasoning.get("effort") is not None:
        effort = body.reasoning["effort"]
        if effort not in _EFFORTS:
            raise bad_request(
                f"reasoning.effort must be one of {', '.join(_EFFORTS)}; got {effort!r}",
                param="reasoning.effort",
            )
        kwargs: dict[str, Any] = {"enable_thinking": effort != "none"}
        if effort != "none":
            kwargs["reasoning_effort"] = effort
        chat["chat_template_kwargs"] = kwargs
    if body.background:
        raise bad_request("background responses are not supported", param="background")
    return ChatCompletionRequest.model_validate(chat), conversation


def _as_messages(items: list[dict[str, Any]], where: str = "output") -> list[dict[str, Any]]:
    """Input (or output) items as chat messages: consecutive calls one assistant message, a
    reasoning item the next assistant message's reasoning_content."""
    messages: list[dict[str, Any]] = []
    thinking: str | None = None
    for i, item in enumerate(items):
        param = f"{where}.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(
                    "a message's role must be user, assistant, system or developer",
                    param=f"{param}.role",
                )
            message = {"role": "system" if role == "developer" else role,
                       "content": _text(item.get("content", ""), f"{param}.content")}  # fmt: skip
            if role == "assistant" and thinking is not None:
                message["reasoning_content"], thinking = thinking, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id", ""), "type": "function", "function": {
                "name": item.get("name", ""), "arguments": item.get("arguments", "")}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if thinking is not None:
                    message["reasoning_content"], thinking = thinking, None
                messages.append(message)
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                             "content": _text(output, f"{param}.output")})  # fmt: skip
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thinking = "\n".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
        else:
            raise bad_request(
                f"input item type {kind!r} is not supported (message, function_call, "
                "function_call_output and reasoning are)",
                param=f"{param}.type",
            )
    return messages


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of text parts", param=param)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in (
            "input_text", "output_text", "text", "summary_text", "reasoning_text"
        ):  # fmt: skip
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"content part type {kind!r} is not supported: this server reads text "
                "(input_text, output_text)",
                param=f"{param}.{j}.type",
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _tool(tool: dict[str, Any], param: str) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(
            f"tool type {tool.get('type')!r} is not supported: function tools (with a name) are",
            param=f"{param}.type",
        )
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        "tool_choice must be auto, none, required or {type: function, name}", param="tool_choice"
    )


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = {"name": fmt.get("name", "response"), "schema": fmt.get("schema")}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise bad_request(
        f"text.format.type must be text, json_object or json_schema; got {kind!r}",
        param="text.format.type",
    )
