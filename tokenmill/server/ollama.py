"""Ollama's HTTP API on the same engine, for the tools that speak it rather than OpenAI's.

    POST /api/chat, POST /api/generate   NDJSON streams (Ollama's default) or one JSON object
    GET  /api/tags, GET /api/ps, POST /api/show, GET /api/version

Requests run through the OpenAI routes' machinery: the same admission limits (429), auth,
metrics and engine streams; ``tools`` on /api/chat are OpenAI's tool_choice "auto"
(server/tools.py), calls answered as ``message.tool_calls`` with arguments as objects. What differs is the wire format (ollama/docs/api.md): ``options``
carry the sampling parameters (num_predict is max_tokens, repeat_penalty the repetition
penalty), ``format`` is "json" or a JSON schema (structured outputs), durations are in
nanoseconds, and errors are ``{"error": message}`` (server/errors.py answers that way on /api/).

Options that only tune llama.cpp's runtime (num_gpu, num_thread, use_mmap, ...) are accepted
and have no effect, as are unknown ones (Ollama logs and ignores them too); options whose
sampling tokenmill does not implement (mirostat, typical_p, tfs_z) are refused unless they
have their "off" value, never silently ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.catalog import LOAD_DURATION_HEADER, parameter_size
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import PreparedRequest
from tokenmill.outputs import RequestOutput
from tokenmill.recipes import show_fields
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputs
from tokenmill.server import tools as tools_mod
from tokenmill.server.auth import caller_of
from tokenmill.server.errors import APIError, bad_request, from_value_error
from tokenmill.server.protocol import REASONING_EFFORTS
from tokenmill.server.serving import (
    Aborted,
    OpenAIServing,
    Run,
    StreamBody,
    Thinking,
    keeps_markup,
    merge_streams,
    prepare_all,
    thinking_of,
    unless_disconnected,
)

logger = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
# Options that tune llama.cpp's runtime, not the output: accepted, no effect here.
RUNTIME_OPTIONS = {
    "num_keep", "num_batch", "num_gpu", "main_gpu", "low_vram", "vocab_only", "use_mmap",
    "use_mlock", "num_thread", "numa", "f16_kv", "logits_all", "embedding_only",
}  # fmt: skip
MAX_WARNED_OPTIONS = 64
# Sampling options tokenmill does not implement, and the value that means "off".
# SamplingParams' names -> the options that set them, for errors (errors.from_value_error).
OLLAMA_NAMES = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}
UNSUPPORTED_OPTIONS = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0, "penalize_newline": False}


class Options(BaseModel):
    """``options``: the sampling parameters by Ollama's names."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    num_predict: int | None = None
    stop: list[str] | str | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_last_n: int | None = None
    num_ctx: int | None = None


class _OllamaRequest(BaseModel):
    # Unknown top-level fields are ignored, as Ollama's server ignores them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None  # the model stays loaded: no effect
    think: bool | str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_name: str | None = None  # a tool message: the function that answered


class ChatRequest(_OllamaRequest):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    template: str | None = None  # refused, as /api/generate's: not ignored like other extras


class GenerateRequest(_OllamaRequest):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[int] | None = None


def _refuse_template(template: str | None) -> None:
    if template:
        raise bad_request(
            "'template' is not supported: the model's own chat template is used, or none with raw",
            param="template",
        )


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    name: str = ""  # older clients' spelling
    verbose: bool = False


# ---- responses (their shapes, for /openapi.json; the handlers build plain dicts) ------------


class ModelDetails(BaseModel):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ModelEntry(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class RunningModelEntry(ModelEntry):
    size_vram: int
    expires_at: str
    context_length: int


class TagsResponse(BaseModel):
    models: list[ModelEntry]


class PsResponse(BaseModel):
    models: list[RunningModelEntry]


class ShowResponse(BaseModel):
    license: str
    modelfile: str
    parameters: str
    template: str
    system: str = ""
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class ResponseMessage(BaseModel):
    role: str
    content: str
    thinking: str | None = None  # a reasoning model's thinking, with "think": true
    tool_calls: list[dict[str, Any]] | None = None


class _Reply(BaseModel):
    """One NDJSON object (a delta, or the last with ``done`` and the counts), or the whole
    reply when not streamed."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None  # nanoseconds
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatResponse(_Reply):
    message: ResponseMessage


class GenerateResponse(_Reply):
    response: str
    thinking: str | None = None  # a reasoning model's thinking, with "think": true
    context: list[int] | None = None


class OllamaErrorResponse(BaseModel):
    """Ollama's error body."""

    error: str


class OllamaServing:
    def __init__(self, openai: OpenAIServing) -> None:
        self.openai = openai
        self.state = openai.state
        self.config = openai.config
        self._warned_options: set[str] = set()

    # ---- model listing --------------------------------------------------------------------

    def tags(self) -> dict[str, Any]:
        return {"models": [self._model_entry(self.state.require_engine())]}

    def ps(self) -> dict[str, Any]:
        engine = self.state.require_engine()
        entry = self._model_entry(engine)
        entry["size"] = engine.info.weight_nbytes + engine.info.kv_cache_nbytes
        entry["size_vram"] = entry["size"] if engine.info.device.startswith("cuda") else 0
        entry["expires_at"] = "9999-12-31T23:59:59Z"  # loaded for the server's lifetime
        entry["context_length"] = engine.info.max_model_len
        return {"models": [entry]}

    def show(self, body: ShowRequest) -> dict[str, Any]:
        engine = self.state.require_engine()
        self.check_model(body.model or body.name)
        info = engine.info
        template = engine.tokenizer.chat_template or ""
        capabilities = ["completion"]
        if "tools" in template:
            capabilities.append("tools")
        return {
            "license": "",
            **show_fields(self.config.recipe, info.model),
            "template": template,
            "details": self._details(engine),
            "model_info": {
                "general.architecture": info.architecture,
                "general.parameter_count": info.num_parameters,
                f"{info.architecture}.context_length": info.max_model_len,
                f"{info.architecture}.vocab_size": info.vocab_size,
            },
            "capabilities": capabilities,
            "modified_at": self._modified_at(info.model_path),
        }

    def _model_entry(self, engine: AsyncEngine) -> dict[str, Any]:
        name = self.config.served_model_name
        path = engine.info.model_path
        return {
            "name": name,
            "model": name,
            "modified_at": self._modified_at(path),
            "size": _file_size(path) or engine.info.weight_nbytes,
            # Ollama's digest is its blob's sha256; hashing a multi-GB file per listing is
            # not worth it: this one names the file (its path, size and mtime).
            "digest": hashlib.sha256(_file_identity(path).encode()).hexdigest(),
            "details": self._details(engine),
        }

    def _details(self, engine: AsyncEngine) -> dict[str, Any]:
        info = engine.info
        return {
            "parent_model": "",
            "format": "gguf" if info.weight_format == "gguf" else "safetensors",
            "family": info.architecture,
            "families": [info.architecture],
            "parameter_size": parameter_size(info.num_parameters),
            "quantization_level": info.file_type or (info.quantization or info.dtype).upper(),
        }

    @staticmethod
    def _modified_at(path: str) -> str:
        with contextlib.suppress(OSError):
            mtime = os.stat(path).st_mtime
            return _timestamp(datetime.datetime.fromtimestamp(mtime, datetime.UTC))
        return _timestamp(datetime.datetime.now(datetime.UTC))

    def check_model(self, model: str) -> None:
        served = self.config.served_model_name
        if model not in (served, f"{served}:latest"):
            raise APIError(
                404,
                f"model '{model}' not found; this server serves '{served}'",
                param="model",
                code="model_not_found",
            )

    # ---- generation -----------------------------------------------------------------------

    async def chat(self, body: ChatRequest, raw: Request) -> Response:
        engine = self.state.require_engine()
        self.check_model(body.model)
        _refuse_template(body.template)
        if any(m.images for m in body.messages):
            raise bad_request("images are not supported: the model reads text", param="images")
        if not body.messages:  # Ollama's way to load a model: nothing to generate
            return JSONResponse(self._loaded(body, {"message": _message("")}))
        messages = [_chat_message(m) for m in body.messages]
        if self.config.recipe is not None:
            messages = self.config.recipe.conversation(messages)
        template_kwargs = _think_kwargs(engine, body)
        parser, calls_format = None, None
        if not body.tools:
            messages = tools_mod.history_for(engine.tokenizer.chat_template, messages)
        else:  # Ollama's tool calling is OpenAI's tool_choice "auto"
            try:
                tools = tools_mod.parse_tools(body.tools)
            except ValueError as e:
                raise bad_request(str(e), param="tools") from None
            setup = tools_mod.setup_tools(
                engine.tokenizer.chat_template,
                self.config.tool_call_parser,
                messages,
                tools,
                "auto",
                parallel=True,
                other_format=body.format is not None,
            )
            messages = setup.messages
            template_kwargs = {**template_kwargs, **setup.template_kwargs}
            parser, calls_format = setup.parser, setup.grammar

        def prepare() -> tuple[list[int], PreparedRequest]:
            try:
                ids = engine.tokenizer.encode_chat(
                    messages, add_generation_prompt=True, **template_kwargs
                )
            except ValueError as e:
                raise bad_request(str(e), param="messages") from None
            return ids, self._prepare(engine, body, ids, "messages", calls_format)

        ids, prepared = await asyncio.to_thread(prepare)
        return await self._respond(
            engine, body, raw, ids, prepared, chat=True, parser=parser,
            thinking=_thinking(engine, body, ids),
        )  # fmt: skip

    async def generate(self, body: GenerateRequest, raw: Request) -> Response:
        engine = self.state.require_engine()
        self.check_model(body.model)
        if body.images:
            raise bad_request("images are not supported: the model reads text", param="images")
        if body.suffix:
            raise bad_request("'suffix' (fill in the middle) is not supported", param="suffix")
        _refuse_template(body.template)
        if not body.prompt and not body.context:
            return JSONResponse(self._loaded(body, {"response": ""}))
        think_kwargs = _think_kwargs(engine, body)

        def prepare() -> tuple[list[int], PreparedRequest]:
            ids = list(body.context or [])
            tokenizer = engine.tokenizer
            try:
                if body.raw or tokenizer.chat_template is None:
                    ids += tokenizer.encode(body.prompt, add_special_tokens=not ids)
                else:
                    messages = [{"role": "user", "content": body.prompt}]
                    if body.system:
                        messages.insert(0, {"role": "system", "content": body.system})
                    if self.config.recipe is not None:
                        messages = self.config.recipe.conversation(messages)
                    ids += tokenizer.encode_chat(
                        messages, add_generation_prompt=True, **think_kwargs
                    )
            except ValueError as e:
                raise bad_request(str(e), param="prompt") from None
            return ids, self._prepare(engine, body, ids, "prompt")

        ids, prepared = await asyncio.to_thread(prepare)
        thinking = None if body.raw else _thinking(engine, body, ids)
        return await self._respond(engine, body, raw, ids, prepared, chat=False, thinking=thinking)

    def _prepare(
        self,
        engine: AsyncEngine,
        body: _OllamaRequest,
        ids: list[int],
        prompt_param: str,
        calls_format: StructuredOutputs | None = None,
    ) -> PreparedRequest:
        params = keeps_markup(
            engine, self._sampling_params(body, len(ids), engine.info.max_model_len)
        )
        if calls_format is not None:
            params = dataclasses.replace(params, structured_outputs=calls_format)
        return prepare_all(engine, [ids], params, OLLAMA_NAMES, prompt_param)[0]

    def _sampling_params(
        self, body: _OllamaRequest, prompt_len: int, max_model_len: int
    ) -> SamplingParams:
        """SamplingParams from ``options`` and ``format``; 400 naming the option at fault."""
        opts = body.options or Options()
        if self.config.recipe is not None and self.config.recipe.parameters:
            given = opts.model_dump(exclude_unset=True)
            opts = Options.model_validate({**self.config.recipe.parameters, **given})
        for name, value in (opts.model_extra or {}).items():
            if name in UNSUPPORTED_OPTIONS and value != UNSUPPORTED_OPTIONS[name]:
                raise bad_request(f"option '{name}' is not supported by tokenmill", param=name)
            known = name in RUNTIME_OPTIONS or name in UNSUPPORTED_OPTIONS
            # Capped: a client sending ever new names neither floods the log nor grows this.
            warned = self._warned_options
            if not known and name not in warned and len(warned) < MAX_WARNED_OPTIONS:
                self._warned_options.add(name)
                logger.warning("ignoring unknown Ollama option %r", name)
        window = min(opts.num_ctx or max_model_len, max_model_len)
        if prompt_len >= window:
            raise bad_request(
                f"prompt has {prompt_len} tokens, which fills the context of {window} "
                "(num_ctx, or the server's --max-model-len)",
                param="num_ctx",
                code="context_length_exceeded",
            )
        room = window - prompt_len
        cap = self.config.max_tokens  # the server's --max-tokens, as on the OpenAI routes
        # num_predict -1 (no limit) and -2 (fill the context): as far as the context goes.
        num_predict = opts.num_predict if opts.num_predict not in (None, -1, -2) else None
        if num_predict is not None and not 1 <= num_predict <= (cap or num_predict):
            raise bad_request(
                f"num_predict must be in [1, {cap or 'context'}], -1 or -2; got {num_predict}",
                param="num_predict",
            )
        if num_predict is None:
            num_predict = min(room, cap or room)
        stop = [opts.stop] if isinstance(opts.stop, str) else list(opts.stop or [])
        if len(stop) > self.config.max_stop:
            raise bad_request(
                f"stop has {len(stop)} strings; at most {self.config.max_stop} are allowed",
                param="stop",
            )
        try:
            return SamplingParams(
                max_tokens=min(num_predict, room),
                temperature=0.8 if opts.temperature is None else opts.temperature,
                top_p=0.9 if opts.top_p is None else opts.top_p,
                top_k=40 if opts.top_k is None else (opts.top_k or -1),
                min_p=opts.min_p or 0.0,
                repetition_penalty=1.0 if opts.repeat_penalty is None else opts.repeat_penalty,
                presence_penalty=opts.presence_penalty or 0.0,
                frequency_penalty=opts.frequency_penalty or 0.0,
                seed=opts.seed,
                stop=stop,
                structured_outputs=_format(body.format),
                # A stream reads each step's new part (the run adds them up, Run.record); a
                # reply sent whole reads only the final output: none is built before.
                output_kind=(
                    RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
                ),
            )
        except ValueError as e:
            raise from_value_error(e, OLLAMA_NAMES) from None

    async def _respond(
        self,
        engine: AsyncEngine,
        body: _OllamaRequest,
        raw: Request,
        ids: list[int],
        prepared: PreparedRequest,
        chat: bool,
        parser: str | None = None,
        thinking: Thinking | None = None,
    ) -> Response:
        run = self.openai.start(engine, "ollama", [prepared], caller=caller_of(raw))
        chunks = _Chunks(body.model, ids, chat, parser, thinking, _load_seconds(raw),
                         show_thinking=body.think not in (None, False))  # fmt: skip
        if body.stream:
            return StreamBody(self._ndjson(run, chunks), on_close=run.close, media_type=NDJSON)
        try:
            final = await unless_disconnected(raw, self._collect(run, chunks))
        finally:
            run.close()
        if final is None:
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(final)

    async def _collect(self, run: Run, chunks: _Chunks) -> dict[str, Any]:
        last: RequestOutput | None = None
        try:
            async with contextlib.aclosing(merge_streams(run.streams)) as events:
                async for _, out in events:
                    run.record(0, out)
                    last = out
        except Aborted:
            run.failed = True
            raise run.aborted_error() from None
        except Exception as e:
            run.failed = True
            raise self.openai.engine_error(e) from None
        assert last is not None
        thinking, text = chunks.split(last.outputs[0].text)
        text = chunks.streamed(text)  # held back if it may be a tool call
        return chunks.final(last, text, thinking)

    async def _ndjson(self, run: Run, chunks: _Chunks) -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(merge_streams(run.streams)) as events:
                async for _, out in events:
                    run.record(0, out)
                    thinking, delta = chunks.split(out.outputs[0].text_delta, out.finished)
                    delta = chunks.streamed(delta)
                    if delta or thinking:
                        yield json.dumps(chunks.delta(delta, thinking)) + "\n"
                    if out.finished:
                        yield json.dumps(chunks.final(run.output(0), "")) + "\n"
        except Aborted:
            run.failed = True
            yield json.dumps({"error": run.aborted_error().message}) + "\n"
        except Exception as e:
            run.failed = True
            yield json.dumps({"error": self.openai.engine_error(e).message}) + "\n"

    def _loaded(self, body: _OllamaRequest, content: dict[str, Any]) -> dict[str, Any]:
        now = _timestamp(datetime.datetime.now(datetime.UTC))
        return {"model": body.model, "created_at": now, **content, "done": True,
                "done_reason": "load"}  # fmt: skip


class _Chunks:
    """The objects of one response: deltas, then the final one with counts and durations.

    With tools (``parser`` set), text that may begin a tool call is held back (``streamed``);
    the final object parses it into ``message.tool_calls`` (arguments as objects, Ollama's
    shape), or sends it as content."""

    def __init__(
        self,
        model: str,
        prompt_ids: list[int],
        chat: bool,
        parser: str | None = None,
        thinking: Thinking | None = None,
        load_seconds: float = 0.0,
        show_thinking: bool = True,
    ) -> None:
        self.model = model
        self.prompt_ids = prompt_ids
        self.load_seconds = load_seconds  # waited for the model to load (a host's runner)
        self.chat = chat
        self.parser = parser
        self._held = ""
        self._streaming = parser is None
        self._split = thinking.stream() if thinking is not None else None
        self.show_thinking = show_thinking  # else the thinking is split off and dropped

    def split(self, text: str, finished: bool = True) -> tuple[str, str]:
        """(thinking, the rest) of new ``text`` ("think": true; ``finished``: the output
        ended, so nothing is held back for a tag cut in two)."""
        if self._split is None:
            return "", text
        thinking, text = self._split.feed(text)
        if finished:
            tail_thinking, tail_text = self._split.finish()
            thinking, text = thinking + tail_thinking, text + tail_text
        return (thinking if self.show_thinking else ""), text

    def streamed(self, text: str) -> str:
        """What of the new ``text`` goes out now (the rest is held until the end)."""
        if self._streaming:
            return text
        self._held += text
        assert self.parser is not None
        if tools_mod.may_be_call_start(self._held, self.parser):
            return ""
        self._streaming = True  # plain text: what was held, then the rest as it comes
        held, self._held = self._held, ""
        return held

    def _base(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": _timestamp(datetime.datetime.now(datetime.UTC))}

    def delta(self, text: str, thinking: str = "") -> dict[str, Any]:
        if self.chat:
            content: dict[str, Any] = {"message": _message(text, thinking)}
        else:
            content = {"response": text, **({"thinking": thinking} if thinking else {})}
        return {**self._base(), **content, "done": False}

    def final(self, out: RequestOutput, text: str, thinking: str = "") -> dict[str, Any]:
        """The last object; ``text``, ``thinking``: what was not sent yet (besides what is
        held)."""
        completion = out.outputs[0]
        calls: list[tools_mod.ToolCall] = []
        if self._held:
            assert self.parser is not None
            content, calls = tools_mod.parse_tool_calls(self._held, self.parser)
            text += content or ""
            self._held = ""
        m = out.metrics
        ns = 1_000_000_000
        first = m.first_token_time or m.finished_time or m.arrival_time
        end = m.finished_time or first
        final = {
            **self.delta(text, thinking),
            "done": True,
            "done_reason": "length" if completion.finish_reason == "length" else "stop",
            "total_duration": int((end - m.arrival_time + self.load_seconds) * ns),
            "load_duration": int(self.load_seconds * ns),
            "prompt_eval_count": m.num_prompt_tokens,
            "prompt_eval_duration": int((first - m.arrival_time) * ns),
            "eval_count": len(completion.token_ids),
            "eval_duration": int((end - first) * ns),
        }
        if calls:
            final["message"]["tool_calls"] = [
                {"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls
            ]
        if not self.chat:  # the tokens so far, for a follow-up's ``context``
            final["context"] = self.prompt_ids + list(completion.token_ids)
        return final


def _load_seconds(raw: Request) -> float:
    """The wait for the model's load that the host (serve with no model) measured."""
    try:
        seconds = float(raw.headers.get(LOAD_DURATION_HEADER, 0.0))
    except ValueError:
        return 0.0
    return seconds if 0.0 <= seconds < 86_400.0 else 0.0


def _message(text: str, thinking: str = "") -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    return message


def _thinking(engine: AsyncEngine, body: _OllamaRequest, ids: list[int]) -> Thinking | None:
    """How a reply's thinking is split off: "think" asks for it apart (message.thinking); a
    harmony model's is always split off (its channels are markup), and dropped unless asked."""
    if body.think not in (None, False) or engine.info.reasoning == "harmony":
        return thinking_of(engine, ids)
    return None


def _think_kwargs(engine: AsyncEngine, body: _OllamaRequest) -> dict[str, Any]:
    """The chat template's variables for Ollama's ``think``: true / false, or an effort."""
    if body.think is None:
        return {}
    if engine.info.reasoning is None:
        if body.think is False:
            return {}
        raise bad_request(f"'{body.model}' does not support thinking", param="think")
    if isinstance(body.think, str):
        if body.think not in REASONING_EFFORTS:
            raise bad_request(
                f"think must be true, false or one of {', '.join(REASONING_EFFORTS)}; "
                f"got {body.think!r}",
                param="think",
            )
        return {"enable_thinking": True, "reasoning_effort": body.think}
    return {"enable_thinking": body.think}


def _chat_message(m: Message) -> dict[str, Any]:
    """A message as the chat templates (and server/tools.py) read it: OpenAI's shape, an
    earlier call's arguments as JSON text."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": call.get("function", {}).get("name", ""),
                    "arguments": _json_text(call.get("function", {}).get("arguments", {})),
                },
            }
            for call in m.tool_calls
        ]
    if m.tool_name:
        message["name"] = m.tool_name
    return message


def _json_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _format(fmt: str | dict[str, Any] | None) -> StructuredOutputs | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return StructuredOutputs(json_object=True)
    if isinstance(fmt, dict):
        return StructuredOutputs(json=fmt)
    raise bad_request(f'format must be "json" or a JSON schema object; got {fmt!r}', "format")


def _timestamp(when: datetime.datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def _file_size(path: str) -> int:
    """Bytes of a model file, or of a directory's files."""
    with contextlib.suppress(OSError):
        if os.path.isdir(path):
            return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
        return os.stat(path).st_size
    return 0


def _file_identity(path: str) -> str:
    with contextlib.suppress(OSError):
        st = os.stat(path)
        return f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"
    return path
