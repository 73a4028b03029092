"""Chat templates: message checks, Jinja rendering, and per-family defaults.

Templates render in a sandboxed Jinja environment set up like transformers' (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII),
so a model's own template renders here as it does there. A model that carries no template gets
its family's default: Gemma turns, Llama 3 headers (Llama 2 [INST] for older vocabularies),
Mistral [INST], or ChatML for Qwen.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

ALLOWED_ROLES = ("system", "user", "assistant", "tool")

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}"
    "{{ '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif -%}"
)

# Llama 2: the system prompt goes inside the first [INST] between <<SYS>> markers; every user
# turn opens with BOS and every assistant turn closes with EOS.
LLAMA2_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_message = messages[0]['content'] | trim -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_message = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if loop.first and system_message -%}"
    "{%- set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] | trim -%}"
    "{%- else -%}"
    "{%- set content = message['content'] | trim -%}"
    "{%- endif -%}"
    "{{ bos_token + '[INST] ' + content + ' [/INST]' }}"
    "{%- else -%}"
    "{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# Mistral: one BOS, the system prompt prepended to the first user turn.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ '[INST] ' + (system_prefix if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- else -%}"
    "{{ ' ' + message['content'] + eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Tokens that end an assistant turn, besides EOS, per family.
_END_OF_TURN_TOKENS = {
    "gemma": ("<end_of_turn>",),
    "llama": ("<|eot_id|>", "<|eom_id|>"),
    "mistral": (),
    "chatml": ("<|im_end|>",),
}


def chat_family(architecture: str) -> str | None:
    """Maps an architecture name ("gemma3", "qwen2", ...) to its chat format family."""
    name = architecture.lower()
    for prefix, family in (
        ("gemma", "gemma"),
        ("llama", "llama"),
        ("mistral", "mistral"),
        ("mixtral", "mistral"),
        ("qwen", "chatml"),
    ):
        if name.startswith(prefix):
            return family
    return None


def end_of_turn_tokens(architecture: str) -> tuple[str, ...]:
    """The end-of-turn token texts of an architecture's chat format (may be absent in a vocab)."""
    return _END_OF_TURN_TOKENS.get(chat_family(architecture) or "", ())


def default_chat_template(architecture: str, has_token: Callable[[str], bool]) -> str | None:
    """The chat template a model of `architecture` gets when it ships none.

    Args:
        architecture: the model family name ("gemma3", "llama", "mistral", "qwen2", "qwen3").
        has_token: whether the vocabulary holds a token text; picks Llama 3 vs Llama 2.

    Returns:
        The template source, or None for an unknown family.
    """
    family = chat_family(architecture)
    if family == "gemma":
        return GEMMA_TEMPLATE
    if family == "llama":
        return LLAMA3_TEMPLATE if has_token("<|start_header_id|>") else LLAMA2_TEMPLATE
    if family == "mistral":
        return MISTRAL_TEMPLATE
    if family == "chatml":
        return CHATML_TEMPLATE
    return None


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checks roles and flattens OpenAI content parts to a string.

    Content may be a string, None (read as ""), or a list of {"type": "text", "text": ...} parts,
    which are joined with newlines. Other keys of a message are kept.

    Raises:
        ValueError: for a role outside ALLOWED_ROLES, or content that is not text.
    """
    normalized = []
    for idx, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"message {idx} must be a dict with a 'role' key, got {message!r}")
        role = message["role"]
        if role not in ALLOWED_ROLES:
            raise ValueError(
                f"message {idx} has role {role!r}; allowed roles are {', '.join(ALLOWED_ROLES)}"
            )
        normalized.append({**message, "content": _content_text(message.get("content"), idx)})
    return normalized


def _content_text(content: Any, idx: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"message {idx} has a {kind!r} content part; only text is supported"
                )
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise ValueError(f"message {idx} content must be a string or a list of text parts")


class ChatTemplate:
    """A compiled chat template bound to a tokenizer's BOS/EOS texts.

    Args:
        source: the Jinja template source.
        bos_token / eos_token: the texts templates see as `bos_token` / `eos_token`.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e}") from e
        self._special_tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Renders normalized messages; extra keyword arguments become template variables.

        Raises:
            ValueError: for bad messages, or when the template rejects them (`raise_exception`).
        """
        try:
            return self._template.render(
                **self._special_tokens,
                **kwargs,
                messages=normalize_messages(messages),
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e
        except Exception as e:
            # NOTE: a template is a program from the model file: whatever it does at run time
            # (1 / 0, a bad format string, endless recursion, too big a result) is its error,
            # a ValueError for the caller (the server's 400), never a crash of the request path.
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e


class _GenerationTagExtension(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used to mark assistant text for
    training masks in some templates) and renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # NOTE: Jinja's own tojson escapes HTML characters; templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


# The most items (characters, list elements) one `*` may build, and the largest power `**`
# may raise to: a template must not build a terabyte string or an endless integer.
_MAX_REPEAT = 1 << 20
_MAX_EXPONENT = 256


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox (no attribute of Python's internals, no mutation of the
    messages), plus bounds on the two operators that can allocate without limit."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if (
            operator == "**"
            and isinstance(right, int)
            and right > _MAX_EXPONENT
            and (not isinstance(left, (int, float)) or abs(left) > 1)
        ):
            raise SecurityError(f"exponent {right} is too large in a chat template")
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if (
                    isinstance(seq, (str, list, tuple))
                    and isinstance(times, int)
                    and len(seq) * times > _MAX_REPEAT
                ):
                    raise SecurityError(
                        f"a chat template may not build more than {_MAX_REPEAT} items with '*'"
                    )
        return super().call_binop(context, operator, left, right)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _TemplateEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTagExtension, loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
