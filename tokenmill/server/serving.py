"""The OpenAI endpoints' logic: request -> engine streams -> JSON response or SSE chunks.

One HTTP request becomes one engine request per prompt (each with ``n`` completions). Every
path that ends a request early closes its engine streams, which aborts them in the engine:
a client that disconnects (streamed or not), an error in a sibling stream, or a shutdown.

Metering (server/usage.py): when a run closes, its usage is metered under the caller's key id
and the request's ``user``: the ``usage`` its client was sent, or would have been (a stream
without include_usage; a client that disconnected: the tokens generated until then). A run
that failed (an engine error, aborted by the shutdown) is not metered.

SSE:  data: {chunk}  ...  [data: {usage chunk}]  data: [DONE]
      chat: a role chunk per choice, content chunks, a finish chunk per choice (empty delta).
      An error after the stream started is sent as ``data: {"error": {...}}`` before [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from tokenmill.engine.llm_engine import PreparedRequest
from tokenmill.harmony import HarmonyStream
from tokenmill.outputs import PositionLogprobs, RequestOutput
from tokenmill.reasoning import (
    REASONING_TAGS,
    ReasoningStream,
    prompt_opens_thinking,
    reasoning_stream,
    split_reasoning,
)
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.server import tools as tools_mod
from tokenmill.server.auth import NO_KEY_ID, OPEN_CALLER, Caller, caller_of
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError, bad_request, from_value_error
from tokenmill.server.limits import RateLimiter
from tokenmill.server.metrics import RequestTracker, ServerMetrics
from tokenmill.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionTokensDetails,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptTokenLogprob,
    PromptTokensDetails,
    Timings,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    UsageInfo,
)
from tokenmill.server.state import ServerState, ServerStatus, Ticket
from tokenmill.server.usage import UsageMeter
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DONE = "data: [DONE]\n\n"


class Aborted(Exception):
    """The engine aborted a request the client still waits for (shutdown deadline)."""


@dataclass
class Run:
    """One HTTP request's engine requests (one per prompt) and their bookkeeping."""

    request_id: str
    created: int
    model: str
    prepared: list[PreparedRequest]
    streams: list[AsyncIterator[RequestOutput]]
    trackers: list[RequestTracker]
    ticket: Ticket
    # Per prompt, its output so far: cumulative, whichever kind the engine sends (record).
    finals: list[RequestOutput | None] = field(default_factory=list)
    caller: Caller = OPEN_CALLER
    user: str | None = None
    # Called once, at the first close (metering).
    on_finish: Callable[[Run], None] | None = None
    # Set when the run ended in a server-side failure (not metered).
    failed: bool = False
    # Why the engine aborted it, when an administrator did (POST /abort_request).
    abort_reason: str | None = None
    _is_finished: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.finals = [None] * len(self.prepared)

    @property
    def n(self) -> int:
        return self.prepared[0].params.n

    def record(self, prompt_idx: int, out: RequestOutput) -> None:
        """Take a prompt's next output (a stream's deltas are added up in ``finals``)."""
        self.trackers[prompt_idx].observe(out)
        kept = self.finals[prompt_idx]
        if self.prepared[prompt_idx].params.output_kind != RequestOutputKind.DELTA:
            self.finals[prompt_idx] = out
        elif kept is None:
            self.finals[prompt_idx] = out.accumulating()
        else:
            kept.add(out)
        if any(c.finish_reason == "abort" for c in out.outputs):
            raise Aborted()

    def output(self, prompt_idx: int) -> RequestOutput:
        """A prompt's output so far, cumulative (after its first ``record``)."""
        out = self.finals[prompt_idx]
        assert out is not None, "no output recorded yet"
        return out

    @property
    def engine_request_ids(self) -> list[str]:
        if len(self.prepared) == 1:
            return [self.request_id]
        return [f"{self.request_id}-{i}" for i in range(len(self.prepared))]

    def aborted_error(self) -> APIError:
        reason = self.abort_reason or "the request was aborted: the server is shutting down"
        return APIError(503, reason, code="aborted")

    def close(self) -> None:
        self.ticket.release()
        for tracker in self.trackers:
            tracker.finish("abort")  # a no-op for requests that finished
        if not self._is_finished:
            self._is_finished = True
            if self.on_finish is not None:
                self.on_finish(self)

    def usage(self) -> UsageInfo:
        """The usage of what the engine has sent so far (all of it, once finished)."""
        return _usage([out for out in self.finals if out is not None])


@dataclass
class ChatPrompt:
    """A chat request ready to render: its messages and template variables (tools set up),
    its sampling and how its tool calls are read back (None: no tools)."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    params: SamplingParams
    parser: str | None

    def render(self, engine: AsyncEngine) -> list[int]:
        """The prompt's token ids (400 naming messages for a template's refusal)."""
        try:
            return engine.tokenizer.encode_chat(
                self.messages, self.add_generation_prompt, **self.template_kwargs
            )
        except ValueError as e:
            raise bad_request(str(e), param="messages") from None


@dataclass
class StartedChat:
    """A chat request running: its run, how tool calls are read back (None: no tools), and
    how its thinking is split (None: the model does not reason)."""

    run: Run
    parser: str | None
    thinking: Thinking | None

    async def deltas(self) -> AsyncIterator[tuple[str, str]]:
        """The new thinking and the new answer text of each output of the run (one prompt, one
        choice; recorded, so ``run.output(0)`` is the reply so far): what a stream of another
        API's events is made from."""
        split = self.thinking.stream() if self.thinking is not None else None
        async for _, out in merge_streams(self.run.streams):
            self.run.record(0, out)
            thinking, text = "", out.outputs[0].text_delta
            if split is not None:
                thinking, text = split.feed(text)
                if out.finished:
                    tail_thinking, tail_text = split.finish()
                    thinking, text = thinking + tail_thinking, text + tail_text
            yield thinking, text

    def calls(self, text: str) -> tuple[str, list[tools_mod.ToolCall]]:
        """(the answer text, the tool calls in it): with tools offered, the calls parsed out."""
        if self.parser is None:
            return text, []
        content, calls = tools_mod.parse_tool_calls(text, self.parser)
        return ((content or "") if calls else text), calls

    def reply(self, final: RequestOutput) -> tuple[str | None, str, list[tools_mod.ToolCall]]:
        """(thinking or None, answer text, tool calls) of the run's finished output."""
        thinking, text = None, final.outputs[0].text
        if self.thinking is not None:
            thinking, text = self.thinking.split(text)
        return (thinking, *self.calls(text))


class OpenAIServing:
    def __init__(
        self,
        state: ServerState,
        metrics: ServerMetrics,
        meter: UsageMeter | None = None,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.state = state
        self.config = state.config
        self.metrics = metrics
        self.meter = meter
        self.limiter = limiter
        self._logged_generic_tools = False
        # Runs not yet closed, by the id their responses carry (for POST /abort_request).
        self._runs: dict[str, Run] = {}

    # ---- small endpoints ------------------------------------------------------------------

    def models(self) -> ModelList:
        engine = self.state.require_engine()
        return ModelList(data=[self._model_card(engine)])

    def model(self, model_id: str) -> ModelCard:
        engine = self.state.require_engine()
        self.check_model(model_id)
        return self._model_card(engine)

    def _model_card(self, engine: AsyncEngine) -> ModelCard:
        return ModelCard(id=self.config.served_model_name, max_model_len=engine.info.max_model_len)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves "
                f"'{self.config.served_model_name}'",
                param="model",
                code="model_not_found",
            )

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        engine = self.state.require_engine()
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
        tokenizer = engine.tokenizer
        try:
            if body.prompt is not None:
                ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                messages = [m.as_dict() for m in body.messages or []]
                ids = tokenizer.encode_chat(messages, body.add_generation_prompt)
        except ValueError as e:
            raise bad_request(str(e), param="messages") from None
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.info.max_model_len)

    def tokenizer_info(self) -> TokenizerInfo:
        engine = self.state.require_engine()
        tokenizer = engine.tokenizer
        return TokenizerInfo(
            model_max_length=engine.info.max_model_len,
            vocab_size=tokenizer.vocab_size,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
            add_bos_token=tokenizer.add_bos,
            chat_template=tokenizer.chat_template,
        )

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        engine = self.state.require_engine()
        self.check_model(body.model)
        vocab = engine.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens must be token ids in [0, {vocab}); got {bad[:5]}", "tokens")
        text = engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)

    # ---- /v1/completions ------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        engine = self.state.require_engine()
        self.check_model(body.model)
        body = with_recipe_defaults(body, self.config)
        body.check(self.config)
        params = body.to_sampling_params(self.config, engine.info.max_model_len)
        prompts = body.prompts()
        prepared = await asyncio.to_thread(
            prepare_all, engine, prompts, params, {}, "prompt", self.config.max_tokens
        )
        run = self.start(engine, "cmpl", prepared, body.cache_salt, caller_of(raw), body.user)
        chunks = _CompletionChunks(run, body, engine)
        if body.stream:
            return StreamBody(self._sse(run, chunks, body.include_usage), on_close=run.close)
        finals = await self.collect(run, raw)
        if finals is None:
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(chunks.response(finals).model_dump(mode="json"))

    # ---- /v1/chat/completions -------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        chat = await self.start_chat(body, raw)
        chunks = _ChatChunks(chat.run, body, chat.parser, chat.thinking)
        run = chat.run
        if body.stream:
            return StreamBody(self._sse(run, chunks, body.include_usage), on_close=run.close)
        finals = await self.collect(run, raw)
        if finals is None:
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(chunks.response(finals).model_dump(mode="json"))

    async def start_chat(
        self, body: ChatCompletionRequest, raw: Request, prefix: str = "chatcmpl"
    ) -> StartedChat:
        """A chat request checked, rendered (tools, template variables) and running: what
        the OpenAI chat route and Anthropic's messages route (server/anthropic.py) share."""
        engine = self.state.require_engine()
        self.check_model(body.model)
        prompt = self.chat_prompt(engine, body)

        def prepare() -> list[PreparedRequest]:
            ids = prompt.render(engine)
            renames = {"max_tokens": body.max_tokens_name, "logprobs": "top_logprobs"}
            return prepare_all(
                engine, [ids], prompt.params, renames, "messages", self.config.max_tokens
            )

        prepared = await asyncio.to_thread(prepare)
        run = self.start(engine, prefix, prepared, body.cache_salt, caller_of(raw), body.user)
        return StartedChat(run, prompt.parser, thinking_of(engine, prepared[0].prompt_token_ids))

    def chat_prompt(self, engine: AsyncEngine, body: ChatCompletionRequest) -> ChatPrompt:
        """A chat request checked, with its tools set up: what it renders and samples with."""
        body = with_recipe_defaults(body, self.config)
        body.check()
        params = keeps_markup(
            engine, body.to_sampling_params(self.config, engine.info.max_model_len)
        )
        params, messages, template_kwargs, parser = self._tool_setup(engine, body, params)
        template_kwargs = {**(body.chat_template_kwargs or {}), **template_kwargs}
        return ChatPrompt(messages, template_kwargs, body.add_generation_prompt, params, parser)

    async def collect(self, run: Run, raw: Request) -> list[RequestOutput] | None:
        """A run's final outputs (None: the client went away), the run closed after."""
        try:
            return await unless_disconnected(raw, self._collect(run))
        finally:
            run.close()

    def _tool_setup(
        self, engine: AsyncEngine, body: ChatCompletionRequest, params: SamplingParams
    ) -> tuple[SamplingParams, list[dict[str, Any]], dict[str, Any], str | None]:
        """(params, messages, chat-template variables, tool-call parser or None): the tools
        in the prompt and, for tool_choice required or a named function, the call grammar."""
        messages = body.message_dicts()
        if self.config.recipe is not None:
            messages = self.config.recipe.conversation(messages)
        try:
            tools, mode = tools_mod.chosen_tools(
                tools_mod.parse_tools(body.tools or []), body.tool_choice
            )
        except ValueError as e:
            param = "tool_choice" if str(e).startswith("tool_choice") else "tools"
            raise bad_request(str(e), param=param) from None
        if not tools:
            try:
                messages = tools_mod.history_for(engine.tokenizer.chat_template, messages)
            except ValueError as e:
                raise bad_request(str(e), param="messages") from None
            return params, messages, {}, None
        if mode in ("required", "named") and params.structured_outputs is not None:
            raise bad_request(
                f"tool_choice {mode!r} is itself a format: drop response_format",
                param="response_format",
            )
        # A named function is called once; "required" may call several when allowed.
        parallel = mode == "required" and body.parallel_tool_calls is not False
        try:
            setup = tools_mod.setup_tools(
                engine.tokenizer.chat_template,
                self.config.tool_call_parser,
                messages,
                tools,
                mode,
                parallel,
                other_format=params.structured_outputs is not None,
            )
        except ValueError as e:
            raise bad_request(str(e), param="messages") from None
        if setup.grammar is not None:
            params = dataclasses.replace(params, structured_outputs=setup.grammar)
        if setup.generic and not self._logged_generic_tools:
            self._logged_generic_tools = True
            logger.info(
                "the chat template has no tool support: tools go in a generic system prompt "
                "(hermes <tool_call> format; server/tools.py)"
            )
        return params, setup.messages, setup.template_kwargs, setup.parser

    # ---- running --------------------------------------------------------------------------

    def start(
        self,
        engine: AsyncEngine,
        prefix: str,
        prepared: list[PreparedRequest],
        cache_salt: str | None = None,
        caller: Caller = OPEN_CALLER,
        user: str | None = None,
    ) -> Run:
        ticket = self.state.admit(len(prepared))  # 429 / 503 before any engine work
        # The admin key is not rate limited; a server without keys limits everyone as one.
        if self.limiter is not None and (not caller.is_admin or caller.key_id == NO_KEY_ID):
            try:
                self.limiter.admit(caller.key_id)
            except APIError:
                ticket.release()
                raise
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        streams = [
            engine.generate(
                p,
                request_id=request_id if len(prepared) == 1 else f"{request_id}-{i}",
                cache_salt=cache_salt,
            )
            for i, p in enumerate(prepared)
        ]
        trackers = [self.metrics.track() for _ in prepared]
        run = Run(
            request_id, int(time.time()), self.config.served_model_name, prepared, streams,
            trackers, ticket, caller=caller, user=user, on_finish=self._finish,
        )  # fmt: skip
        self._runs[request_id] = run
        return run

    def abort(self, engine: AsyncEngine, request_id: str) -> list[str]:
        """Abort the run whose responses carry ``request_id`` (every engine request of it);
        its client gets an "aborted" error. 404 when no unfinished run has that id."""
        run = self._runs.get(request_id)
        if run is None:
            raise APIError(
                404, f"no unfinished request has id {request_id!r}", code="not_found",
                param="request_id",
            )  # fmt: skip
        run.abort_reason = "the request was aborted by an administrator"
        for engine_id in run.engine_request_ids:
            engine.abort(engine_id)
        return run.engine_request_ids

    def _finish(self, run: Run) -> None:
        self._runs.pop(run.request_id, None)
        self._meter(run)

    def _meter(self, run: Run) -> None:
        if run.failed:
            return
        usage = run.usage()
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        if self.meter is not None:
            self.meter.record(
                run.caller.key_id, run.user, run.model, usage.prompt_tokens, cached,
                usage.completion_tokens,
            )  # fmt: skip
        if self.limiter is not None:
            self.limiter.add_tokens(run.caller.key_id, usage.total_tokens)

    async def _collect(self, run: Run) -> list[RequestOutput]:
        try:
            async with contextlib.aclosing(merge_streams(run.streams)) as events:
                async for prompt_idx, out in events:
                    run.record(prompt_idx, out)
        except Aborted:
            run.failed = True
            raise run.aborted_error() from None
        except Exception as e:
            run.failed = True
            raise self.engine_error(e) from None
        finally:
            run.close()
        return [out for out in run.finals if out is not None]

    async def _sse(
        self, run: Run, chunks: _CompletionChunks | _ChatChunks, include_usage: bool
    ) -> AsyncIterator[str]:
        try:
            for event in chunks.start():
                yield event
            try:
                async with contextlib.aclosing(merge_streams(run.streams)) as events:
                    async for prompt_idx, out in events:
                        aborted = False
                        try:
                            run.record(prompt_idx, out)
                        except Aborted:
                            aborted = True
                        for event in chunks.output(prompt_idx, out):
                            yield event
                        if aborted:
                            raise Aborted()
                if include_usage:
                    yield chunks.usage([o for o in run.finals if o is not None])
            except Aborted:
                run.failed = True
                yield _sse_error(run.aborted_error())
            except Exception as e:
                run.failed = True
                yield _sse_error(self.engine_error(e))
            yield _DONE
        finally:
            run.close()

    def engine_error(self, error: Exception) -> APIError:
        if isinstance(error, APIError):
            return error
        if isinstance(error, EngineOverloadedError):
            if self.state.status is not ServerStatus.READY:
                return APIError(503, "the server is shutting down", code="shutting_down")
            return APIError(429, str(error), code="queue_full", headers={"Retry-After": "1"})
        if isinstance(error, EngineDeadError):
            logger.error("engine failure: %s", error)
            return APIError(500, str(error), code="engine_error")
        logger.exception("unexpected error while generating", exc_info=error)
        return APIError(
            500, f"internal server error: {type(error).__name__}", code="internal_error"
        )


# ---- helpers --------------------------------------------------------------------------------


R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


def with_recipe_defaults(body: R, config: ServerConfig) -> R:
    """A request with its model's Modelfile PARAMETERs where it sets none of its own."""
    if config.recipe is None:
        return body
    unset = {k: v for k, v in config.recipe.openai_defaults().items()
             if k not in body.model_fields_set}  # fmt: skip
    return body.model_copy(update=unset) if unset else body


def prepare_all(
    engine: AsyncEngine,
    prompts: list[str | list[int]],
    params: SamplingParams,
    renames: dict[str, str],
    prompt_param: str,
    max_tokens_cap: int | None = None,
) -> list[PreparedRequest]:
    """Validate and tokenize every prompt (in a worker thread) before any reaches the engine.

    A request that names no max_tokens gets what its context leaves (the engine fills it in),
    at most ``max_tokens_cap`` (the server's --max-tokens-limit) when there is one.
    """
    if engine.info.pooling is not None and params.pooling is None:
        raise bad_request(
            f"'{engine.info.model}' is served for embeddings (--task embed, or an embedding "
            "model): use /v1/embeddings",
            param="model",
            code="unsupported",
        )
    prepared = []
    for prompt in prompts:
        try:
            one = engine.prepare(prompt, params)
            resolved = one.params.max_tokens or 0
            cap = resolved if max_tokens_cap is None else max_tokens_cap
            if params.max_tokens is None and resolved > cap:
                # SamplingParams checks min_tokens against the capped max_tokens (400).
                capped = dataclasses.replace(one.params, max_tokens=cap)
                one = dataclasses.replace(one, params=capped)
        except ValueError as e:
            raise from_value_error(e, renames, prompt_param=prompt_param) from None
        prepared.append(one)
    return prepared


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine streams as they come, tagged with the stream's index.

    Closing this generator closes every stream (each aborts its request if unfinished).
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:  # type: ignore[type-var]
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(idx: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream) as s:  # type: ignore[type-var]
                async for out in s:
                    queue.put_nowait((idx, out))
            queue.put_nowait((idx, None))
        except Exception as e:
            queue.put_nowait((idx, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            idx, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield idx, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``; if the client disconnects first, cancel it (aborting its engine
    requests) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        logger.info("client disconnected; request aborted")
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _wait_for_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    # The body has been read, so the next message can only be the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


class StreamBody(StreamingResponse):
    """A streamed response (SSE; Ollama's NDJSON with ``media_type``) that always closes its
    event generator and then calls ``on_close``: a stream abandoned while a chunk was being sent aborts its engine requests
    at once, and one never started still releases its admission."""

    def __init__(
        self,
        events: AsyncIterator[str],
        on_close: Callable[[], None],
        media_type: str = "text/event-stream",
    ) -> None:
        super().__init__(
            events,
            media_type=media_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self._on_close()


def _sse_error(error: APIError) -> str:
    return f"data: {JSONResponse(error.body()).body.decode()}\n\n"


def _usage_event(
    chunk_cls: type[ChatCompletionChunk] | type[CompletionChunk],
    run: Run,
    finals: list[RequestOutput],
    reasoning_tokens: int | None = None,
) -> str:
    """The SSE event with only usage and timings, sent last when include_usage is set."""
    chunk = chunk_cls(
        id=run.request_id,
        created=run.created,
        model=run.model,
        choices=[],
        usage=_usage(finals, reasoning_tokens),
        timings=_timings(finals),
    )
    return f"data: {chunk.model_dump_json()}\n\n"


def _usage(finals: list[RequestOutput], reasoning_tokens: int | None = None) -> UsageInfo:
    """The usage of finished outputs; ``reasoning_tokens``: a reasoning model's thinking."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in finals)
    details = None
    if reasoning_tokens is not None:
        details = CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=details,
    )


@dataclass(frozen=True)
class Thinking:
    """A reasoning model's thinking in one run's outputs: its format (reasoning.py), whether
    the prompt opened the block, and the tokenizer that tells how many of an output's tokens
    it took."""

    opened: bool
    tokenizer: Tokenizer
    format: str = "think"

    def stream(self) -> ReasoningStream | HarmonyStream:
        return reasoning_stream(self.format, self.opened)

    def split(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(text, self.opened, self.format)

    def num_tokens(self, token_ids: list[int]) -> int:
        """The tokens of the thinking, its closing tag included: read off the text (a tag may
        come as one token or several)."""
        start_tag, end_tag = REASONING_TAGS[self.format]

        def holds(tag: str) -> Callable[[int], bool]:
            return lambda k: tag in self.tokenizer.decode(token_ids[:k], skip_special_tokens=False)

        start = 0 if self.opened else _first(len(token_ids), holds(start_tag))
        if start is None:
            return 0
        end = _first(len(token_ids), holds(end_tag))
        return (len(token_ids) if end is None else end) - start


def _first(n: int, holds: Callable[[int], bool]) -> int | None:
    """The least k in [1, n] for which ``holds`` (false, then true from there on), or None."""
    if n == 0 or not holds(n):
        return None
    low, high = 1, n
    while low < high:
        mid = (low + high) // 2
        if holds(mid):
            high = mid
        else:
            low = mid + 1
    return low


def thinking_of(engine: AsyncEngine, prompt_ids: list[int]) -> Thinking | None:
    """How to split a run's outputs (None: the model does not reason, or its parser is off)."""
    fmt = engine.info.reasoning
    if fmt is None:
        return None
    opened = fmt == "think" and prompt_opens_thinking(engine.tokenizer, prompt_ids)
    return Thinking(opened, engine.tokenizer, fmt)


def keeps_markup(engine: AsyncEngine, params: SamplingParams) -> SamplingParams:
    """A chat request's parameters for its model's reasoning format: harmony's messages are
    told apart by special tokens, so its text keeps them (the splitter takes them out)."""
    if engine.info.reasoning != "harmony":
        return params
    return dataclasses.replace(params, skip_special_tokens=False)


def _timings(finals: list[RequestOutput]) -> Timings:
    ms = [o.metrics for o in finals]
    ttfts = [m.ttft for m in ms if m.ttft is not None]
    e2es = [m.e2e_latency for m in ms if m.e2e_latency is not None]
    queues = [m.queue_time for m in ms if m.queue_time is not None]
    firsts = [m.first_token_time for m in ms if m.first_token_time is not None]
    ends = [m.finished_time for m in ms if m.finished_time is not None]
    num_seqs = sum(len(o.outputs) for o in finals)
    num_decoded = sum(m.num_generation_tokens for m in ms) - num_seqs
    rate = None
    if firsts and ends and max(ends) > min(firsts) and num_decoded > 0:
        rate = round(num_decoded / (max(ends) - min(firsts)), 2)
    return Timings(
        queue_time_s=round(max(queues), 6) if queues else None,
        ttft_s=round(min(ttfts), 6) if ttfts else None,
        e2e_s=round(max(e2es), 6) if e2es else None,
        decode_tokens_per_s=rate,
        cached_prompt_tokens=sum(m.num_cached_tokens for m in ms),
    )


def _token_bytes(token: str) -> list[int] | None:
    # A token that is part of a multi-byte character decodes to U+FFFD alone; its own bytes
    # are not known here, so OpenAI's "no bytes representation" (null) is sent.
    return None if "\ufffd" in token else list(token.encode("utf-8"))


def _chat_logprobs(positions: list[PositionLogprobs]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=p.sampled.token,
                logprob=p.sampled.logprob,
                bytes=_token_bytes(p.sampled.token),
                top_logprobs=[
                    ChatTopLogprob(token=t.token, logprob=t.logprob, bytes=_token_bytes(t.token))
                    for t in p.top
                ],
            )
            for p in positions
        ]
    )


def _completion_logprobs(
    positions: list[PositionLogprobs], offset: int
) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy shape; ``offset`` is the text offset of the first token. Each
    top_logprobs entry also holds the sampled token (as vLLM does)."""
    lp = CompletionLogprobs()
    for p in positions:
        lp.tokens.append(p.sampled.token)
        lp.token_logprobs.append(p.sampled.logprob)
        top: dict[str, float] = {}
        for t in (*p.top, p.sampled):  # NOTE: distinct tokens may share a text; keep the best
            top.setdefault(t.token, t.logprob)
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(p.sampled.token)
    return lp, offset


class _ChatChunks:
    """Chat completion chunks and the final response of one run (one prompt, n choices).

    With tools (``parser`` set), text that may begin a tool call is held back; at the end it
    is parsed, and calls go out as ``delta.tool_calls`` (each whole, as one piece the openai
    SDK assembles) with finish_reason "tool_calls", or the held text as content."""

    def __init__(
        self,
        run: Run,
        body: ChatCompletionRequest,
        parser: str | None = None,
        thinking: Thinking | None = None,
    ) -> None:
        self.run = run
        self.logprobs = body.logprobs
        self.include_usage = body.include_usage
        self.parser = parser
        # A reasoning model's thinking goes out as reasoning_content, apart from the answer
        # (which alone may hold tool calls).
        self.thinking = thinking
        self._split = [thinking.stream() for _ in range(run.n)] if thinking else []
        self._finished: set[int] = set()
        self._held = [""] * run.n  # text that may still be a tool call, per choice
        self._streaming = [parser is None] * run.n  # a choice's text is plain content

    def _chunk(self, choice: ChatChunkChoice) -> str:
        chunk = ChatCompletionChunk(
            id=self.run.request_id, created=self.run.created, model=self.run.model, choices=[choice]
        )
        exclude = {"timings"} if self.include_usage else {"timings", "usage"}
        return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"

    def start(self) -> Iterator[str]:
        for idx in range(self.run.n):
            yield self._chunk(
                ChatChunkChoice(index=idx, delta={"role": "assistant", "content": ""})
            )

    def output(self, prompt_idx: int, out: RequestOutput) -> Iterator[str]:
        for c in out.outputs:
            idx = c.index
            new = c.logprobs or []  # a delta output's: its new tokens'
            finished = c.finish_reason is not None and c.finish_reason != "abort"
            reasoning, text = "", c.text_delta
            if self._split:
                reasoning, text = self._split[idx].feed(text)
                if finished:
                    tail_reasoning, tail_text = self._split[idx].finish()
                    reasoning, text = reasoning + tail_reasoning, text + tail_text
            text = self._content_delta(idx, text)
            if text or new or reasoning:
                delta = {"reasoning_content": reasoning} if reasoning else {}
                if text or not reasoning:
                    delta["content"] = text
                yield self._chunk(
                    ChatChunkChoice(
                        index=idx,
                        delta=delta,
                        logprobs=_chat_logprobs(new) if self.logprobs else None,
                    )
                )
            if finished and idx not in self._finished:
                self._finished.add(idx)
                finish_reason = c.finish_reason
                if not self._streaming[idx]:
                    content, calls = self._parse(self._held[idx])
                    delta: dict[str, Any] = {"content": content} if content else {}
                    if calls:
                        delta["tool_calls"] = [
                            {"index": i, **call.as_dict()} for i, call in enumerate(calls)
                        ]
                        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                    if delta:
                        yield self._chunk(ChatChunkChoice(index=idx, delta=delta))
                yield self._chunk(
                    ChatChunkChoice(
                        index=idx,
                        delta={},
                        finish_reason=finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )

    def _content_delta(self, idx: int, text: str) -> str:
        """What of a choice's new text streams now as content (the rest is held)."""
        if self._streaming[idx]:
            return text
        self._held[idx] += text
        assert self.parser is not None
        if tools_mod.may_be_call_start(self._held[idx], self.parser):
            return ""
        self._streaming[idx] = True  # plain text: send what was held, then stream
        held, self._held[idx] = self._held[idx], ""
        return held

    def _parse(self, text: str) -> tuple[str | None, list[tools_mod.ToolCall]]:
        if self.parser is None:
            return text, []
        return tools_mod.parse_tool_calls(text, self.parser)

    def usage(self, finals: list[RequestOutput]) -> str:
        return _usage_event(ChatCompletionChunk, self.run, finals, self._reasoning_tokens(finals))

    def _reasoning_tokens(self, finals: list[RequestOutput]) -> int | None:
        if self.thinking is None:
            return None
        return sum(self.thinking.num_tokens(c.token_ids) for o in finals for c in o.outputs)

    def response(self, finals: list[RequestOutput]) -> ChatCompletionResponse:
        choices = []
        for c in finals[0].outputs:
            reasoning, text = None, c.text
            if self.thinking is not None:
                reasoning, text = self.thinking.split(c.text)
            content, calls = self._parse(text)
            finish_reason = c.finish_reason
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(
                        content=content if calls else text,
                        reasoning_content=reasoning,
                        tool_calls=[call.as_dict() for call in calls] or None,
                    ),
                    logprobs=_chat_logprobs(c.logprobs or []) if self.logprobs else None,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.run.request_id,
            created=self.run.created,
            model=self.run.model,
            choices=choices,
            usage=_usage(finals, self._reasoning_tokens(finals)),
            timings=_timings(finals),
        )


class _CompletionChunks:
    """Text completion chunks and the final response (one or more prompts, n choices each)."""

    def __init__(self, run: Run, body: CompletionRequest, engine: AsyncEngine) -> None:
        self.run = run
        self.logprobs = body.logprobs is not None
        self.include_usage = body.include_usage
        self.echo_texts = (
            [_prompt_text(engine, p) for p in run.prepared]
            if body.echo
            else [""] * len(run.prepared)
        )
        # echo with logprobs: the prompt's tokens and log-probs lead each choice's (scoring);
        # streamed, the echo waits for the prompt's log-probs (after its prefill).
        self.scores_prompt = body.echo and self.logprobs
        self.scores_only = body.scores_only
        self.vllm_prompt_logprobs = body.prompt_logprobs is not None
        self.tokenizer = engine.tokenizer
        self._echoed: set[int] = set()
        num_choices = run.n * len(run.prepared)
        self._text_offsets = [len(self.echo_texts[i // run.n]) for i in range(num_choices)]
        self._finished: set[int] = set()
        self._prompt_sent: set[int] = set()

    def _chunk(self, choice: CompletionChoice) -> str:
        chunk = CompletionChunk(
            id=self.run.request_id, created=self.run.created, model=self.run.model, choices=[choice]
        )
        exclude = {"timings"} if self.include_usage else {"timings", "usage"}
        return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"

    def start(self) -> Iterator[str]:
        if self.scores_prompt:
            return
        for prompt_idx, text in enumerate(self.echo_texts):
            if text:
                for i in range(self.run.n):
                    yield self._chunk(
                        CompletionChoice(index=prompt_idx * self.run.n + i, text=text)
                    )

    def output(self, prompt_idx: int, out: RequestOutput) -> Iterator[str]:
        if self.scores_prompt and prompt_idx not in self._echoed:
            self._echoed.add(prompt_idx)
            # The prompt's log-probs so far (all of them: none is sent before its first token).
            echo, offset = self._prompt_logprobs(self.run.output(prompt_idx), prompt_idx)
            for i in range(self.run.n):
                idx = prompt_idx * self.run.n + i
                self._text_offsets[idx] = offset
                yield self._chunk(
                    CompletionChoice(index=idx, text=self.echo_texts[prompt_idx], logprobs=echo)
                )
        for c in out.outputs:
            idx = prompt_idx * self.run.n + c.index
            new = c.logprobs or []  # a delta output's: its new tokens'
            finished = c.finish_reason is not None and c.finish_reason != "abort"
            if finished and idx in self._finished:
                continue
            if self.scores_only:  # the one sampled token is not sent
                if finished:
                    self._finished.add(idx)
                    yield self._chunk(CompletionChoice(index=idx, text="", finish_reason="length"))
                continue
            if not (c.text_delta or new or finished):
                continue
            # vLLM's prompt_logprobs: with each choice's first chunk (the first output of a
            # request holds them all: none is sent before its first token).
            prompt_logprobs = None
            if self.vllm_prompt_logprobs and idx not in self._prompt_sent:
                self._prompt_sent.add(idx)
                prompt_logprobs = _by_token_id(self.run.output(prompt_idx))
            logprobs = None
            if self.logprobs:
                logprobs, self._text_offsets[idx] = _completion_logprobs(
                    new, self._text_offsets[idx]
                )
            if finished:
                self._finished.add(idx)
            yield self._chunk(
                CompletionChoice(
                    index=idx,
                    text=c.text_delta,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    finish_reason=c.finish_reason if finished else None,
                    stop_reason=c.stop_reason if finished else None,
                )
            )

    def usage(self, finals: list[RequestOutput]) -> str:
        if self.scores_only:
            return _usage_event(CompletionChunk, self.run, _unsampled(finals))
        return _usage_event(CompletionChunk, self.run, finals)

    def _prompt_logprobs(
        self, out: RequestOutput, prompt_idx: int
    ) -> tuple[CompletionLogprobs, int]:
        """The prompt's tokens and log-probs in the legacy shape (the first token's null: it
        has no context), and the text offset after them."""
        entries = out.prompt_logprobs or [None]
        first = self.tokenizer.decode(out.prompt_token_ids[:1], skip_special_tokens=False)
        lp, offset = _completion_logprobs([e for e in entries[1:] if e is not None], len(first))
        lp.tokens.insert(0, first)
        lp.token_logprobs.insert(0, None)
        lp.top_logprobs.insert(0, None)
        lp.text_offset.insert(0, 0)
        return lp, offset

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        if self.scores_only:
            finals = _unsampled(finals)
        for prompt_idx, out in enumerate(finals):
            echo = self.echo_texts[prompt_idx]
            for c in out.outputs:
                logprobs = None
                if self.scores_prompt:
                    logprobs, offset = self._prompt_logprobs(out, prompt_idx)
                    generated, _ = _completion_logprobs(c.logprobs or [], offset)
                    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(logprobs, name).extend(getattr(generated, name))
                elif self.logprobs:
                    logprobs, _ = _completion_logprobs(c.logprobs or [], len(echo))
                choices.append(
                    CompletionChoice(
                        index=prompt_idx * self.run.n + c.index,
                        text=echo + c.text,
                        logprobs=logprobs,
                        prompt_logprobs=_by_token_id(out) if self.vllm_prompt_logprobs else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        return CompletionResponse(
            id=self.run.request_id,
            created=self.run.created,
            model=self.run.model,
            choices=choices,
            usage=_usage(finals),
            timings=_timings(finals),
        )


def _by_token_id(out: RequestOutput) -> list[dict[str, PromptTokenLogprob] | None]:
    """A prompt's log-probs in vLLM's shape: per position, the prompt token's and the top-k
    alternatives' by token id (the first position has none)."""
    shaped: list[dict[str, PromptTokenLogprob] | None] = []
    for entry in out.prompt_logprobs or [None]:
        if entry is None:
            shaped.append(None)
            continue
        shaped.append({
            str(t.token_id): PromptTokenLogprob(logprob=t.logprob, rank=t.rank, decoded_token=t.token)
            for t in (entry.sampled, *entry.top)
        })  # fmt: skip
    return shaped


def _unsampled(finals: list[RequestOutput]) -> list[RequestOutput]:
    """Outputs as a scoring request (echo, max_tokens 0) answers them: the token the engine
    had to sample dropped, the choice ended by its length."""
    return [
        dataclasses.replace(
            out,
            outputs=[
                dataclasses.replace(
                    c, text="", token_ids=[], logprobs=None, finish_reason="length",
                    stop_reason=None,
                )
                for c in out.outputs
            ],
        )
        for out in finals
    ]  # fmt: skip


def _prompt_text(engine: AsyncEngine, prepared: PreparedRequest) -> str:
    if prepared.prompt is not None:
        return prepared.prompt
    return engine.tokenizer.decode(prepared.prompt_token_ids)
