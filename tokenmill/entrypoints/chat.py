"""``tokenmill chat``: an interactive conversation with a model in the terminal, as
``ollama run`` offers.

Each turn renders the whole conversation with the model's chat template and streams the reply;
the engine's prefix cache finds the earlier turns' blocks, so a turn's time to first token pays
only for the new message (``/stats`` shows the cached prompt tokens). Input ending in ``\\``
continues on the next line, and a block between lines of ``\"\"\"`` is one message. Ctrl-C stops
the reply being written (what was written stays in the history); Ctrl-D or ``/bye`` leaves.
When stdin is not a terminal, every line is one message and only the replies are printed, so
the chat can be scripted.

A conversation longer than the context loses its oldest turns (the system message stays), with
a notice; a message that alone does not fit is refused with a notice, never a crash.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tokenmill.engine import LLMEngine
from tokenmill.harmony import HarmonyStream
from tokenmill.outputs import RequestMetrics
from tokenmill.sampling_params import SamplingParams

HELP = """Commands:
  /params [key=value ...]  show or set sampling: temperature, top_p, top_k, min_p, max_tokens,
                           seed, repetition_penalty, presence_penalty, frequency_penalty,
                           ignore_eos, max_thinking_tokens
  /system TEXT             set the system message (/system alone clears it)
  /reset                   forget the conversation (the system message stays)
  /stats                   the last reply: TTFT, tokens/s, prompt tokens found in the cache
  /save FILE, /load FILE   write or read the conversation as JSON
  /bye                     leave (as Ctrl-D does)
Input ending in \\ continues on the next line; \"\"\" opens and closes a multi-line message.
Ctrl-C stops a reply."""
# /params keys -> their type.
PARAMS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "max_tokens": int,
    "seed": int,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "ignore_eos": bool,
    "max_thinking_tokens": int,
}


@dataclass
class ReplyStats:
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft: float
    tokens_per_second: float
    finish_reason: str


@dataclass
class ChatSession:
    """A conversation with one engine: messages, sampling settings, the last reply's figures."""

    engine: LLMEngine
    settings: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.7, "top_p": 0.9})
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    last: ReplyStats | None = None
    notice: Callable[[str], None] = lambda text: print(text, file=sys.stderr)
    # A reasoning model's thinking as it streams (harmony's): stderr, without line breaks added.
    notice_part: Callable[[str], None] = lambda text: print(text, end="", file=sys.stderr)

    def reply(self, text: str, write: Callable[[str], None]) -> str | None:
        """Add the user's ``text``, stream the model's reply through ``write`` and keep it.
        None when the message does not fit the context (a notice says so)."""
        with _sigint_flag() as interrupted:  # from here on, Ctrl-C only raises a flag
            self.messages.append({"role": "user", "content": text})
            ids = self._fitting_prompt()
            if ids is None:
                self.messages.pop()
                return None
            room = self.engine.info.max_model_len - len(ids)
            settings = dict(self.settings)
            max_tokens = min(settings.pop("max_tokens", room), room)
            # harmony (gpt-oss): its channels are special tokens, kept for the splitter, which
            # sends the thinking to stderr and the answer to ``write``.
            split = HarmonyStream() if self.engine.reasoning == "harmony" else None
            params = SamplingParams(max_tokens=max_tokens, skip_special_tokens=split is None,
                                    **settings)  # fmt: skip
            request_id = self.engine.add_request(ids, params)
            parts: list[str] = []
            last = None
            while self.engine.has_unfinished_requests():
                if interrupted():
                    self.engine.abort_request(request_id)
                    self.notice("\n[interrupted]")
                    break
                for out in self.engine.step():
                    delta = out.outputs[0].text_delta
                    if split is not None:
                        thinking, delta = split.feed(delta)
                        if out.finished:
                            tail_thinking, tail = split.finish()
                            thinking, delta = thinking + tail_thinking, delta + tail
                        if thinking:
                            self.notice_part(thinking)
                    parts.append(delta)
                    write(delta)
                    last = out
        reply = "".join(parts)
        self.messages.append({"role": "assistant", "content": reply})
        if last is not None:
            self.last = _stats(last.metrics, last.outputs[0].finish_reason or "abort")
        return reply

    def _conversation(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def _fitting_prompt(self) -> list[int] | None:
        """The conversation's prompt ids, its oldest turns dropped until a reply has room."""
        tokenizer = self.engine.tokenizer
        limit = self.engine.info.max_model_len - 1
        system = self._conversation()[: 1 if self.system else 0]
        alone = tokenizer.encode_chat(system + self.messages[-1:], add_generation_prompt=True)
        if len(alone) > limit:  # refused before any history is dropped for it
            self.notice(
                f"[that message takes {len(alone)} tokens with the template; the context holds "
                f"{limit + 1}: shorten it]"
            )
            return None
        dropped = 0
        while True:
            ids = tokenizer.encode_chat(self._conversation(), add_generation_prompt=True)
            if len(ids) <= limit:
                break
            # The oldest turn: a user message and the reply that followed it.
            del self.messages[:2]
            dropped += 1
        if dropped:
            self.notice(
                f"[the conversation outgrew the context of {limit + 1} tokens: "
                f"dropped its {dropped} oldest turn(s)]"
            )
        return ids

    def set_params(self, assignments: list[str]) -> str:
        """/params key=value ...: the new settings, or ValueError naming what is wrong."""
        updates: dict[str, Any] = {}
        for item in assignments:
            key, sep, value = item.partition("=")
            if not sep or key not in PARAMS:
                raise ValueError(f"unknown parameter {key!r}; known: {', '.join(PARAMS)}")
            kind = PARAMS[key]
            try:
                if kind is bool:
                    if value.lower() not in ("true", "false", "1", "0"):
                        raise ValueError
                    updates[key] = value.lower() in ("true", "1")
                else:
                    updates[key] = kind(value)
            except ValueError:
                raise ValueError(f"{key} must be a {kind.__name__}; got {value!r}") from None
        merged = self.settings | updates
        check = {k: v for k, v in merged.items() if k != "max_tokens"}
        SamplingParams(**check)  # ValueError naming the field, before anything changes
        if merged.get("max_tokens", 1) < 1:
            raise ValueError(f"max_tokens must be >= 1; got {merged['max_tokens']}")
        self.settings = merged
        return " ".join(f"{k}={v}" for k, v in self.settings.items())

    def save(self, path: str) -> None:
        data = {"system": self.system, "messages": self.messages, "params": self.settings}
        try:
            Path(path).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            raise ValueError(f"cannot write {path!r}: {e.strerror}") from None

    def load(self, path: str) -> None:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"cannot read {path!r}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path!r} is not a saved conversation: {e}") from None
        messages = data.get("messages") if isinstance(data, dict) else None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant") for m in messages
        ):
            raise ValueError(f"{path!r} is not a saved conversation (no user/assistant messages)")
        params = data.get("params") or {}
        self.set_params([f"{k}={v}" for k, v in params.items()])
        self.system = data.get("system")
        self.messages = [{"role": m["role"], "content": str(m["content"])} for m in messages]


def run_chat(
    engine: LLMEngine,
    system: str | None,
    settings: dict[str, Any],
    turns: list[dict[str, str]] | None = None,
) -> int:
    """The chat loop on stdin / stdout; returns the exit status (0 on Ctrl-D or /bye).
    ``turns``: messages the conversation starts with (a Modelfile's MESSAGEs)."""
    interactive = sys.stdin.isatty()
    session = ChatSession(engine, system=system, messages=[dict(m) for m in turns or []])
    session.set_params([f"{k}={v}" for k, v in settings.items() if v is not None])
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        print(f"{engine.info.model}: /help for commands, Ctrl-D to leave.", file=sys.stderr)
    for message in _messages(interactive, sys.stdin):
        if message.startswith("/"):
            if _command(session, message) == "bye":
                break
            continue
        if not message.strip():
            continue
        if session.reply(message, _writer(sys.stdout)) is not None:
            sys.stdout.write("\n\n" if interactive else "\n")
            sys.stdout.flush()
    return 0


def _command(session: ChatSession, line: str) -> str | None:
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    try:
        if name in ("/bye", "/exit", "/quit"):
            return "bye"
        if name == "/help":
            print(HELP)
        elif name == "/reset":
            session.messages.clear()
            print("[the conversation is cleared]")
        elif name == "/system":
            session.system = rest or None
            print("[system message set]" if rest else "[system message cleared]")
        elif name == "/params":
            print(session.set_params(rest.split()))
        elif name == "/stats":
            print(_format_stats(session.last))
        elif name in ("/save", "/load"):
            if not rest:
                raise ValueError(f"{name} needs a file name")
            getattr(session, name[1:])(rest)
            print(f"[{'saved to' if name == '/save' else 'loaded'} {rest}]")
        else:
            raise ValueError(f"unknown command {name}; /help lists them")
    except ValueError as e:
        print(f"error: {e}")
    return None


def _format_stats(stats: ReplyStats | None) -> str:
    if stats is None:
        return "no reply yet"
    return (
        f"TTFT {stats.ttft * 1000:.0f} ms, {stats.tokens_per_second:.1f} tokens/s, "
        f"{stats.generated_tokens} tokens ({stats.finish_reason}); prompt "
        f"{stats.prompt_tokens} tokens, {stats.cached_tokens} of them cached"
    )


def _stats(m: RequestMetrics, finish_reason: str) -> ReplyStats:
    first = m.first_token_time or m.arrival_time
    end = m.finished_time or first
    n = m.num_generation_tokens
    rate = (n - 1) / (end - first) if n > 1 and end > first else 0.0
    return ReplyStats(
        m.num_prompt_tokens, m.num_cached_tokens, n, m.ttft or 0.0, rate, finish_reason
    )


def _messages(interactive: bool, stdin: TextIO) -> Iterator[str]:
    """User messages: a line, lines joined by a trailing backslash, or a triple-quoted block.
    Ctrl-C at the prompt is a reminder, not an exit; Ctrl-D (end of input) ends."""
    while True:
        try:
            line = _read(interactive, stdin, ">>> ")
            if line is None:
                return
            if line.strip().startswith('"""'):
                block = [line.strip()[3:]]
                while not block[-1].rstrip().endswith('"""'):
                    more = _read(interactive, stdin, "... ")
                    if more is None:
                        return
                    block.append(more)
                block[-1] = block[-1].rstrip()[:-3]
                yield "\n".join(block).strip("\n")
                continue
            while line.endswith("\\"):
                more = _read(interactive, stdin, "... ")
                line = line[:-1] + "\n" + (more or "")
                if more is None:
                    break
            yield line
        except KeyboardInterrupt:
            print("\n[Ctrl-D or /bye leaves]", file=sys.stderr)


def _read(interactive: bool, stdin: TextIO, prompt: str) -> str | None:
    if interactive:
        try:
            return input(prompt)
        except EOFError:
            print(file=sys.stderr)
            return None
    line = stdin.readline()
    return None if not line else line.rstrip("\n")


def _writer(out: TextIO) -> Callable[[str], None]:
    def write(text: str) -> None:
        out.write(text)
        out.flush()

    return write


@contextlib.contextmanager
def _sigint_flag() -> Iterator[Callable[[], bool]]:
    """While a reply is written, Ctrl-C raises a flag the loop checks between engine steps (an
    exception in the middle of a step would leave the engine half-updated)."""
    hit = [False]

    def handler(signum: int, frame: Any) -> None:
        hit[0] = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: no Ctrl-C to catch
        yield lambda: False
        return
    try:
        yield lambda: hit[0]
    finally:
        signal.signal(signal.SIGINT, previous)
