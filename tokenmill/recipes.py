"""Models created from a Modelfile (Ollama's): a name for a base model with its own system
prompt, sampling parameters, conversation and chat template.

    FROM smollm2-135m-instruct          a model name, a .gguf path or a directory (required)
    PARAMETER temperature 0.2           Ollama's option names; stop may repeat
    SYSTEM You are a terse assistant.   the system message when a request sends none
    TEMPLATE \"\"\"{% for m in messages %}...\"\"\"   a Jinja chat template, rendered in the same
                                        sandbox as a model's own (an admin key's to create)
    MESSAGE user Hi                     a conversation every chat starts with (repeatable)

Values may be \"\"\"triple-quoted\"\"\" across lines, or "quoted". Created models live in the
model directory's aliases.toml beside the plain aliases, as ``[models.NAME]`` tables with the
Modelfile's text (``tokenmill`` rewrites that file when it creates, copies or deletes one:
comments in it are not kept). ``resolve.resolve_model`` serves a created model's name by its
base; the server applies the rest (server/serving.py, server/ollama.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from tokenmill.store import ALIAS_FILE, model_dir, read_alias_file, write_atomic

# Ollama's PARAMETER names and the type of each value.
PARAMETERS: dict[str, type] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "num_predict": int,
    "stop": str, "seed": int, "repeat_penalty": float, "presence_penalty": float,
    "frequency_penalty": float, "num_ctx": int, "repeat_last_n": int,
}  # fmt: skip
# The OpenAI routes' names of the PARAMETERs they have.
OPENAI_NAMES = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "num_predict": "max_tokens", "stop": "stop", "seed": "seed",
    "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}  # fmt: skip
ROLES = ("system", "user", "assistant")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True, slots=True)
class Recipe:
    """A created model: its base and what it adds."""

    name: str
    base: str
    system: str | None = None
    template: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: tuple[dict[str, str], ...] = ()

    @property
    def modelfile(self) -> str:
        """The Modelfile that creates it (what /api/show reports)."""
        lines = [f"FROM {self.base}"]
        for key, value in self.parameter_pairs():
            lines.append(f"PARAMETER {key} {json.dumps(value) if key == 'stop' else value}")
        if self.system is not None:
            lines.append(f'SYSTEM """{self.system}"""')
        if self.template is not None:
            lines.append(f'TEMPLATE """{self.template}"""')
        lines += [f'MESSAGE {m["role"]} """{m["content"]}"""' for m in self.messages]
        return "\n".join(lines) + "\n"

    def parameter_pairs(self) -> list[tuple[str, Any]]:
        """Its PARAMETERs one (name, value) each: a repeated ``stop`` once a value."""
        return [(key, one) for key, value in self.parameters.items()
                for one in (value if isinstance(value, list) else [value])]  # fmt: skip

    @property
    def parameters_text(self) -> str:
        """Its PARAMETERs as Ollama's /api/show lists them, "name value" a line."""
        return "\n".join(f"{key} {value}" for key, value in self.parameter_pairs())

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A request's messages as this model sees them: its SYSTEM first unless the request
        sends its own, then its MESSAGE turns, then the request's."""
        turns = [dict(m) for m in self.messages]
        if messages and messages[0].get("role") == "system":
            return [messages[0], *turns, *messages[1:]]
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*head, *turns, *messages]

    def openai_defaults(self) -> dict[str, Any]:
        """Its PARAMETERs by the OpenAI routes' field names (those that have one)."""
        return {OPENAI_NAMES[k]: v for k, v in self.parameters.items() if k in OPENAI_NAMES}

    def as_table(self) -> dict[str, Any]:
        table: dict[str, Any] = {"from": self.base}
        for key in ("system", "template"):
            if getattr(self, key) is not None:
                table[key] = getattr(self, key)
        if self.parameters:
            table["parameters"] = dict(self.parameters)
        if self.messages:
            table["messages"] = [dict(m) for m in self.messages]
        return table


def show_fields(recipe: Recipe | None, model: str) -> dict[str, str]:
    """Ollama's /api/show fields that come from a Modelfile: a created model's own, else one
    that says ``FROM model`` alone."""
    return {
        "modelfile": recipe.modelfile if recipe is not None else f"FROM {model}\n",
        "parameters": recipe.parameters_text if recipe is not None else "",
        "system": (recipe.system or "") if recipe is not None else "",
    }


def check_name(name: str) -> str:
    name = name.removesuffix(":latest")
    if not _NAME.match(name):
        raise ValueError(
            f"a model's name is letters, digits, '.', '_' and '-' (at most 128); got {name!r}"
        )
    return name


def parse_modelfile(name: str, text: str) -> Recipe:
    """A Modelfile's recipe. ValueError naming the line at fault."""
    base, system, template = None, None, None
    parameters: dict[str, Any] = {}
    messages: list[dict[str, str]] = []
    for number, command, value in _commands(text):
        where = f"Modelfile line {number}"
        if command == "FROM":
            base = value
        elif command == "SYSTEM":
            system = value
        elif command == "TEMPLATE":
            template = value
        elif command == "PARAMETER":
            key, _, raw = value.partition(" ")
            _add_parameter(parameters, key, _unquote(raw.strip()), where)
        elif command == "MESSAGE":
            role, _, content = value.partition(" ")
            if role not in ROLES:
                raise ValueError(f"{where}: MESSAGE's role must be one of {', '.join(ROLES)}; "
                                 f"got {role!r}")  # fmt: skip
            messages.append({"role": role, "content": _unquote(content.strip())})
        elif command in ("LICENSE", "REQUIRES"):
            continue  # nothing to apply
        else:
            raise ValueError(
                f"{where}: {command} is not supported (FROM, PARAMETER, SYSTEM, TEMPLATE, "
                "MESSAGE and LICENSE are)"
            )
    if not base:
        raise ValueError("the Modelfile has no FROM line: name the base model")
    return Recipe(check_name(name), base, system, template, parameters, tuple(messages))


def recipe_from_fields(
    name: str,
    base: str,
    system: str | None = None,
    template: str | None = None,
    parameters: dict[str, Any] | None = None,
    messages: list[dict[str, Any]] | None = None,
) -> Recipe:
    """A recipe from Ollama's /api/create fields. ValueError naming the field at fault."""
    for field_name, value, kind in (("system", system, str), ("template", template, str),
                                    ("parameters", parameters, dict),
                                    ("messages", messages, list)):  # fmt: skip
        if value is not None and not isinstance(value, kind):
            what = {str: "a string", dict: "an object", list: "a list"}[kind]
            raise ValueError(f"{field_name} must be {what}; got {type(value).__name__}")
    checked: dict[str, Any] = {}
    for key, value in (parameters or {}).items():
        for one in value if isinstance(value, list) and key == "stop" else [value]:
            _add_parameter(checked, key, one, "parameters")
    turns = []
    for i, m in enumerate(messages or []):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(
            m.get("content"), str
        ):  # fmt: skip
            raise ValueError(f"messages.{i} must be {{role: system|user|assistant, content}}")
        turns.append({"role": m["role"], "content": m["content"]})
    return Recipe(check_name(name), base, system, template, checked, tuple(turns))


def recipes(directory: Path | None = None) -> dict[str, Recipe]:
    """The created models of the model directory's aliases.toml."""
    tables = _read(directory).get("models", {})
    out = {}
    for name, t in tables.items():
        if not isinstance(t, dict) or not isinstance(t.get("from"), str):
            raise ValueError(f'{ALIAS_FILE}: [models.{name}] needs from = "base model"')
        out[name] = Recipe(
            name, t["from"], t.get("system"), t.get("template"), dict(t.get("parameters", {})),
            tuple(t.get("messages", ())),
        )  # fmt: skip
    return out


def save(recipe: Recipe, directory: Path | None = None) -> None:
    doc = _read(directory)
    doc.setdefault("models", {})[recipe.name] = recipe.as_table()
    _write(doc, directory)


def copy(source: str, destination: str, directory: Path | None = None) -> None:
    """Name ``destination`` as ``source`` is: a created model's copy, or a model made FROM any
    other (no file is copied)."""
    recipe = recipes(directory).get(check_name(source)) or Recipe(source, source)
    save(dataclasses.replace(recipe, name=check_name(destination)), directory)


def delete(name: str, directory: Path | None = None) -> None:
    """Forget a created model or a plain alias; a model's own files are never touched."""
    name = check_name(name)
    doc = _read(directory)
    if name in doc.get("models", {}):
        del doc["models"][name]
    elif name in doc.get("aliases", {}):
        del doc["aliases"][name]
    else:
        raise ValueError(f"'{name}' is neither a created model nor an alias: nothing to delete "
                         "(a model's files are never deleted)")  # fmt: skip
    _write(doc, directory)


def _add_parameter(parameters: dict[str, Any], key: str, value: Any, where: str) -> None:
    kind = PARAMETERS.get(key)
    if kind is None:
        raise ValueError(f"{where}: unknown parameter {key!r}; known: {', '.join(PARAMETERS)}")
    try:
        converted = kind(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        converted = None
    if converted is None or (kind is float and converted != converted):
        raise ValueError(f"{where}: parameter {key} must be a {kind.__name__}; got {value!r}")
    if key == "stop":
        parameters.setdefault("stop", []).append(converted)
    else:
        parameters[key] = converted


def _commands(text: str) -> list[tuple[int, str, str]]:
    """(line number, COMMAND, value) of each command; triple-quoted values span lines."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        number = i + 1
        i += 1
        if not line or line.startswith("#"):
            continue
        command, _, value = line.partition(" ")
        value = value.strip()
        if command.upper() in ("PARAMETER", "MESSAGE"):
            head, _, rest = value.partition(" ")
            if rest.strip().startswith('"""'):
                rest, i = _triple(rest.strip(), lines, i, number)
                value = f"{head} {rest}"
        elif value.startswith('"""'):
            value, i = _triple(value, lines, i, number)
        else:
            value = _unquote(value)
        out.append((number, command.upper(), value))
    return out


def _triple(start: str, lines: list[str], i: int, number: int) -> tuple[str, int]:
    body = start[3:]
    if body.endswith('"""') and len(body) >= 3:
        return body[:-3], i
    parts = [body]
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.rstrip().endswith('"""'):
            parts.append(line.rstrip()[:-3])
            return "\n".join(parts), i
        parts.append(line)
    raise ValueError(f'Modelfile line {number}: a """ value is never closed')


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        try:
            return str(json.loads(value))
        except ValueError:
            return value[1:-1]
    return value


def _read(directory: Path | None) -> dict[str, Any]:
    return read_alias_file(directory)


def _write(doc: dict[str, Any], directory: Path | None) -> None:
    directory = directory or model_dir()
    directory.mkdir(parents=True, exist_ok=True)
    text = "# Written by tokenmill (created models and aliases); comments are not kept.\n"
    text += tomli_w.dumps(doc)
    write_atomic(directory / ALIAS_FILE, lambda path: path.write_text(text))
