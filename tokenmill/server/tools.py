"""Tool calling on /v1/chat/completions: tool definitions into the prompt, tool_choice into a
grammar, and the model's text back into OpenAI ``tool_calls``.

Formats (``--tool-call-parser``, or picked from the chat template):
- ``hermes`` (Hermes, Qwen): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- ``llama3_json``: a JSON object ``{"name": ..., "parameters": {...}}`` (after
  ``<|python_tag|>``, if any), several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` and a JSON list of ``{"name": ..., "arguments": {...}}``.

A template that reads ``tools`` gets them as that variable (and ``role: "tool"`` messages as
they are); one that does not (gemma-3's, the defaults) gets a generic prompt: a system message
listing the functions and asking for the hermes format, tool results as user turns in
``<tool_response>`` tags, earlier calls as assistant text. ``tool_choice`` ``"required"`` and
a named function are enforced by a grammar (the arguments validate against the function's
parameters schema); under ``"auto"`` the text is free until the model writes ``<tool_call>``,
and the call that follows is constrained the same way (hermes format only); ``"none"`` sends
no tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenmill.harmony import CALL_CLOSE, CALL_OPEN, is_harmony
from tokenmill.sampling_params import StructuredOutputs

# harmony (gpt-oss): its splitter (tokenmill/harmony.py) writes each call as a Hermes block.
PARSERS = ("hermes", "llama3_json", "mistral", "harmony")


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_tools(tools: list[Any]) -> list[Tool]:
    """The request's ``tools``; ValueError naming what is wrong ("tools[i]...")."""
    out = []
    for i, entry in enumerate(tools):
        fn = entry.get("function") if isinstance(entry, dict) else None
        if (
            not isinstance(entry, dict)
            or entry.get("type") != "function"
            or not isinstance(fn, dict)
        ):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 of [A-Za-z0-9_.-]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append(Tool(name, str(fn.get("description") or ""), params))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ValueError("tools must have distinct function names")
    return out


def chosen_tools(tools: list[Tool], tool_choice: Any) -> tuple[list[Tool], str]:
    """(the tools offered, the mode: "none", "auto", "required" or "named")."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return (tools if tool_choice != "none" else []), tool_choice
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
    match = [t for t in tools if t.name == name]
    if not match:
        raise ValueError(
            "tool_choice must be none, auto, required or {'type': 'function', 'function': "
            f"{{'name': ...}}}} naming one of the tools; got {tool_choice!r}"
        )
    return match, "named"


# The formats a call grammar can write: Hermes' tagged JSON, and Llama 3's bare JSON objects
# ({"name": ..., "parameters": ...}; several joined by "; "). Mistral's [TOOL_CALLS] is a
# control token its tokenizers drop from the text, so its calls are written as Hermes'.
CONSTRAINED_FORMATS = ("hermes", "llama3_json")


def constrained_format(parser: str) -> str:
    """The format the grammar writes calls in for a template read by ``parser``."""
    return parser if parser in CONSTRAINED_FORMATS else "hermes"


def call_grammar(tools: list[Tool], parallel: bool, fmt: str = "hermes") -> StructuredOutputs:
    """One call (or, with parallel calls, one or more) of these tools in format ``fmt``
    (CONSTRAINED_FORMATS), the arguments valid under each function's parameters schema."""
    if fmt == "llama3_json":
        call = f"%json {json.dumps(_call_schema(tools, 'parameters'))}"
        start = 'start: call ("; " call)*' if parallel else "start: call"
    else:
        call = f'"{CALL_OPEN}\\n" %json {json.dumps(_call_schema(tools))} "\\n{CALL_CLOSE}"'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return StructuredOutputs(grammar=f"{start}\ncall: {call}")


def auto_grammar(tools: list[Tool], fmt: str = "hermes") -> StructuredOutputs:
    """Hermes: free text, until the model writes ``<tool_call>``: from there on a valid call
    (the arguments following the function's schema), then free text again (llguidance's
    structural tags: a lazy lexeme triggers the call's grammar). Llama 3 JSON: a reply that
    begins with "{" is a call (as ``parse_tool_calls`` reads it), any other is free text."""
    from llguidance import StructTag

    if fmt == "llama3_json":
        calls = call_grammar(tools, parallel=True, fmt=fmt).grammar
        assert calls is not None
        return StructuredOutputs(
            grammar=calls.replace("start: call", "start: TEXT | call", 1)
            + "\nTEXT: /[^{\\s][\\s\\S]*/"
        )
    tag = StructTag(
        trigger=CALL_OPEN,
        begin=CALL_OPEN + "\n",
        grammar=_call_schema(tools),
        end="\n" + CALL_CLOSE,
    )
    # NOTE: "<tool_call>" is plain text to most tokenizers (gemma's among them), not a
    # special token: assume_special off.
    return StructuredOutputs(grammar=StructTag.to_grammar([tag], assume_special=False))


def _call_schema(tools: list[Tool], arguments: str = "arguments") -> dict[str, Any]:
    """A call of one of ``tools``: {"name": ..., <arguments>: {...}} (Llama 3 names the
    arguments "parameters")."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, arguments: t.parameters},
            "required": ["name", arguments],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    # JSON as json.dumps writes it, no free whitespace (structured/compiler.py says why).
    return {
        **schema,
        "x-guidance": {
            "whitespace_flexible": False,
            "item_separator": ", ",
            "key_separator": ": ",
            "lenient": False,
        },
    }


def template_reads_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def pick_parser(chat_template: str | None, configured: str | None) -> str:
    if configured:
        return configured
    template = chat_template or ""
    if is_harmony(template):
        return "harmony"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """What a chat request with tools runs with (``setup_tools``)."""

    messages: list[dict[str, Any]]  # the conversation, with the tools where the template has none
    template_kwargs: dict[
        str, Any
    ]  # the chat template's variables: its ``tools``, if it reads them
    parser: str  # how calls are read back from the text (``parse_tool_calls``)
    grammar: StructuredOutputs | None  # the calls' grammar, where one applies
    generic: bool  # the template knows no tools: they went into a generic system prompt


def setup_tools(
    chat_template: str | None,
    configured_parser: str | None,
    messages: list[dict[str, Any]],
    tools: list[Tool],
    mode: str,
    parallel: bool,
    other_format: bool,
) -> ToolSetup:
    """The tools of a chat request (``chosen_tools``' tools and mode), as the OpenAI and Ollama
    routes both run them: in the template's ``tools`` variable where it reads one, else in a
    generic system prompt that teaches Hermes' format; the parser that reads calls back; and
    the grammar: for mode "required" or "named" the calls themselves (``parallel``: several
    calls allowed), for "auto" a call, once the model starts one, following its function's
    schema (unless the request has ``other_format`` of its own)."""
    reads_tools = template_reads_tools(chat_template)
    parser = pick_parser(chat_template, configured_parser) if reads_tools else "hermes"
    grammar = None
    if parser == "harmony":
        # NOTE: a grammar would hold the model to text its messages' special tokens are not;
        # harmony's calls are read from its own channel, unconstrained.
        kwargs = {"tools": [t.as_dict() for t in tools]}
        return ToolSetup(harmony_history(messages), kwargs, parser, None, generic=False)
    if mode in ("required", "named"):
        parser = constrained_format(parser)  # the format the grammar writes
        grammar = call_grammar(tools, parallel, parser)
    elif not other_format and parser in CONSTRAINED_FORMATS:
        grammar = auto_grammar(tools, parser)
    if reads_tools:
        kwargs = {"tools": [t.as_dict() for t in tools]}
        return ToolSetup(messages, kwargs, parser, grammar, generic=False)
    return ToolSetup(generic_messages(messages, tools), {}, parser, grammar, generic=True)


def generic_messages(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: the functions in a system message,
    earlier calls as assistant text and tool results as user turns."""
    listing = "\n".join(json.dumps(t.as_dict()["function"]) for t in tools)
    instructions = (
        "To call a function, reply with only\n"
        f'{CALL_OPEN}\n{{"name": <name>, "arguments": <arguments object>}}\n{CALL_CLOSE}\n'
        f"Functions:\n{listing}"
    )
    out: list[dict[str, Any]] = []
    if messages and messages[0]["role"] == "system":
        out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{instructions}"})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": instructions})
    return out + plain_history(messages)


def history_for(chat_template: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation of a request that offers no tools (or tool_choice "none") as its
    template takes it: one that knows no tools gets earlier calls and their results as plain
    turns (plain_history), which it would otherwise refuse (Gemma's: roles must alternate)."""
    # (a tool result with no call before it stays as it is: the template says what it thinks)
    if is_harmony(chat_template):
        return harmony_history(messages)
    has_calls = any(m["role"] == "assistant" and m.get("tool_calls") for m in messages)
    if not has_calls or template_reads_tools(chat_template):
        return messages
    return plain_history(messages)


def harmony_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as gpt-oss's template reads it: an assistant's thinking as
    ``thinking`` (its reasoning_content), and its calls' arguments as objects (the template
    writes them with ``tojson``: a JSON string would be written as a string)."""
    out = []
    for m in messages:
        if m.get("role") != "assistant":
            out.append(m)
            continue
        m = dict(m)
        if m.get("reasoning_content") and "thinking" not in m:
            m["thinking"] = m.pop("reasoning_content")
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                name, arguments = _earlier_call(call)
                parsed = _json(arguments)
                calls.append({**call, "function": {"name": name, "arguments": parsed
                                                   if parsed is not None else arguments}})  # fmt: skip
            m["tool_calls"] = calls
        out.append(m)
    return out


def plain_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier calls as assistant text in Hermes' format, tool results as user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n'
                f"{CALL_CLOSE}"
                for name, arguments in map(_earlier_call, m["tool_calls"])
            ]
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    return out


def _earlier_call(call: Any) -> tuple[str, str]:
    """(name, arguments JSON text) of an assistant's earlier call; ValueError for a malformed
    one (the routes answer 400 naming messages)."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise ValueError(
            "an assistant message's tool_calls need function.name and function.arguments "
            "(a JSON string)"
        )
    return name, arguments


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(the content outside calls, or None; the calls) of a model's output. Text that only
    looks like a call but does not parse stays content."""
    found: list[tuple[str, Any]] = []
    content = text
    if parser in ("hermes", "harmony"):
        pattern = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)
        for m in pattern.finditer(text):
            call = _json(m.group(1))
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                found.append((call["name"], call.get("arguments", {})))
        if found:
            content = pattern.sub("", text)
    elif parser == "mistral" and "[TOOL_CALLS]" in text:
        before, _, after = text.partition("[TOOL_CALLS]")
        calls = _json(after.strip())
        if isinstance(calls, list) and all(isinstance(c, dict) and "name" in c for c in calls):
            found = [(c["name"], c.get("arguments", {})) for c in calls]
            content = before
    elif parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>")
        parts = [_json(p) for p in body.split(";")] if body.startswith("{") else []
        if parts and all(isinstance(p, dict) and isinstance(p.get("name"), str) for p in parts):
            found = [(p["name"], p.get("parameters", p.get("arguments", {}))) for p in parts]
            content = ""
    calls = [
        ToolCall(
            f"call_{uuid.uuid4().hex[:24]}",
            name,
            args if isinstance(args, str) else json.dumps(args),
        )
        for name, args in found
    ]
    content = content.strip() if calls else text
    return (content or None), calls


def may_be_call_start(text: str, parser: str) -> bool:
    """Whether streamed text so far could still begin a tool call (so it is held back)."""
    marker = {"hermes": CALL_OPEN, "harmony": CALL_OPEN, "mistral": "[TOOL_CALLS]",
              "llama3_json": "{"}[parser]  # fmt: skip
    head = text.lstrip()
    return (
        head.startswith(marker)
        or marker.startswith(head)
        or (parser == "llama3_json" and "<|python_tag|>".startswith(head[:14]))
    )


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
